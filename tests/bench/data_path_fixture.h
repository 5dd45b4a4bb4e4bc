// DataPathFixture: the same RC QP stack built four times over one
// NullBackend: on the backend directly, through a Shim in its default mode
// (virtual identities equal to the hardware's until a move: the fast path),
// through a Shim in offset mode (every identity translated: the path taken
// after a move) and through a migratable Shim in its default mode (every
// post and poll behind its queue's pause gate, on the translating path),
// with ready-made work requests for each; what the data-path benchmark and
// the instruction counter post and poll on.
//
// The stacks differ only in the path the inline verbs take: on `direct`
// ibv_post_send(qp, ...) calls the null backend's op; on a shim's stack it
// calls the shim's, which translates and then calls the same null op. So
// the difference between a shim's stack and `direct` is what that shim adds.
//
// Single-threaded: build, use and destroy on one thread.
#ifndef RDMAVIRT_TESTS_BENCH_DATA_PATH_FIXTURE_H_
#define RDMAVIRT_TESTS_BENCH_DATA_PATH_FIXTURE_H_

#include <infiniband/verbs.h>

#include <memory>

#include "absl/status/statusor.h"
#include "shim/core/shim.h"
#include "tests/bench/null_backend.h"

namespace rdmavirt::bench {

// Receives outstanding at most (the QP's max_recv_wr): post and poll
// receives in batches of at most this many.
inline constexpr int kQueueDepth = 256;

// One RC QP, its PD, MR, CQs and work requests. The work requests carry
// this stack's keys: on the shim's stack the virtual lkey and rkey the
// application would have. On the null backend, send_cq always has one send
// completion and recv_cq one receive completion (null_backend.h).
struct DataPathStack {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_mr* mr = nullptr;
  ibv_cq* send_cq = nullptr;
  ibv_cq* recv_cq = nullptr;
  ibv_qp* qp = nullptr;

  ibv_sge send_sge{};
  ibv_sge write_sge{};
  ibv_sge recv_sge{};
  ibv_send_wr send{};   // IBV_WR_SEND, one SGE, signaled
  ibv_send_wr write{};  // IBV_WR_RDMA_WRITE, one SGE, rkey of mr
  ibv_recv_wr recv{};   // one SGE; every receive has the same wr_id
};

class DataPathFixture {
 public:
  // All five stacks, or the first error with the verb that failed.
  static absl::StatusOr<std::unique_ptr<DataPathFixture>> Create();

  DataPathFixture(const DataPathFixture&) = delete;
  DataPathFixture& operator=(const DataPathFixture&) = delete;
  ~DataPathFixture();  // destroys every stack, QP first

  DataPathStack& direct() { return direct_; }
  DataPathStack& shim() { return shim_stack_; }
  DataPathStack& shim_offset() { return offset_stack_; }
  DataPathStack& shim_migratable() { return migratable_stack_; }
  // A migratable process whose identities are all translated, as after a
  // move: offset mode, every call through the pause gate.
  DataPathStack& shim_migratable_offset() { return migratable_offset_stack_; }
  // A QP and its CQs per thread of the two-thread benchmark, on the direct
  // backend and on the migratable shim (the same Shim as above).
  DataPathStack& direct_thread(int i) { return direct_threads_[i]; }
  DataPathStack& migratable_thread(int i) { return migratable_threads_[i]; }
  static constexpr int kThreads = 2;

 private:
  DataPathFixture();

  NullBackend backend_;
  shim::Shim shim_;
  shim::Shim offset_shim_;
  shim::Shim migratable_shim_;
  shim::Shim migratable_offset_shim_;
  static constexpr size_t kPart = 1536;  // of buffer_, one per stack
  char buffer_[9 * kPart] = {};
  DataPathStack direct_;
  DataPathStack shim_stack_;
  DataPathStack offset_stack_;
  DataPathStack migratable_stack_;
  DataPathStack migratable_offset_stack_;
  DataPathStack direct_threads_[kThreads];
  DataPathStack migratable_threads_[kThreads];
};

}  // namespace rdmavirt::bench

#endif  // RDMAVIRT_TESTS_BENCH_DATA_PATH_FIXTURE_H_
