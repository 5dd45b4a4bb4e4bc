// Google Benchmark of the shim's data path over the null backend: each verb
// posted or polled through the shim (*_Shim, *_ShimOffset,
// *_ShimMigratable, *_ShimMigratableOffset) against the same verb on the null backend's own objects
// (*_Direct). Both sides use the inline verbs an application calls, so the
// difference is what the shim adds.
//
// Receives are measured in the steady state of a real receiver: the shim
// journals each posted receive and drops it at its completion, so
// BM_PostRecv posts kQueueDepth receives (timed) then polls their
// completions (not timed), and BM_PollCqRecv the other way round. BM_PollCq
// polls send completions, which the journal does not see.
//
// Not a test: it asserts nothing about time. tools/bench-shim runs it with
// the instruction counts from callgrind (shim_data_path_count.cc).
#include <benchmark/benchmark.h>
#include <infiniband/verbs.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "tests/bench/data_path_fixture.h"

namespace rdmavirt::bench {
namespace {

DataPathFixture& Fixture() {
  // Built once for the whole run; benchmarks run one at a time.
  static DataPathFixture* fixture = [] {
    auto f = DataPathFixture::Create();
    if (!f.ok()) {
      std::fprintf(stderr, "shim_data_path_bench: %s\n", f.status().ToString().c_str());
      std::exit(1);
    }
    return f->release();
  }();
  return *fixture;
}

void PostSendLoop(benchmark::State& state, ibv_qp* qp, ibv_send_wr* wr) {
  ibv_send_wr* bad = nullptr;
  for (auto _ : state) {
    int rc = ibv_post_send(qp, wr, &bad);
    benchmark::DoNotOptimize(rc);
  }
  state.SetItemsProcessed(state.iterations());
}

void PollCqLoop(benchmark::State& state, ibv_cq* cq) {
  ibv_wc wc;
  for (auto _ : state) {
    int n = ibv_poll_cq(cq, 1, &wc);
    benchmark::DoNotOptimize(n);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}

// Receives, in batches of kQueueDepth: post them all, then poll all their
// completions; only the half named by `timed` counts (manual time).
enum class Timed { kPost, kPoll };
void RecvBatches(benchmark::State& state, DataPathStack& s, Timed timed) {
  using Clock = std::chrono::steady_clock;
  ibv_recv_wr* bad = nullptr;
  ibv_wc wc;
  while (state.KeepRunningBatch(kQueueDepth)) {
    const Clock::time_point t0 = Clock::now();
    for (int i = 0; i < kQueueDepth; ++i) {
      int rc = ibv_post_recv(s.qp, &s.recv, &bad);
      benchmark::DoNotOptimize(rc);
    }
    const Clock::time_point t1 = Clock::now();
    for (int i = 0; i < kQueueDepth; ++i) {
      int n = ibv_poll_cq(s.recv_cq, 1, &wc);
      benchmark::DoNotOptimize(n);
      benchmark::ClobberMemory();
    }
    const Clock::time_point t2 = Clock::now();
    const std::chrono::duration<double> d = timed == Timed::kPost ? t1 - t0 : t2 - t1;
    state.SetIterationTime(d.count());
  }
  state.SetItemsProcessed(state.iterations());
}

// Each verb five ways: straight to the null backend, through the shim in
// its default mode (nothing to translate before a move), in offset mode
// (everything translated, as after a move), in the default mode of a
// migratable process (nothing to translate, every call inside the
// thread's mark) and in offset mode for a migratable process (a
// migratable process after a move: translated, inside the mark).
#define RDMAVIRT_BENCH5(name, body)                                \
  void BM_##name##_Direct(benchmark::State& state) {               \
    DataPathStack& s = Fixture().direct();                         \
    body;                                                          \
  }                                                                \
  void BM_##name##_Shim(benchmark::State& state) {                 \
    DataPathStack& s = Fixture().shim();                           \
    body;                                                          \
  }                                                                \
  void BM_##name##_ShimOffset(benchmark::State& state) {           \
    DataPathStack& s = Fixture().shim_offset();                    \
    body;                                                          \
  }                                                                \
  void BM_##name##_ShimMigratable(benchmark::State& state) {       \
    DataPathStack& s = Fixture().shim_migratable();                \
    body;                                                          \
  }                                                                \
  void BM_##name##_ShimMigratableOffset(benchmark::State& state) { \
    DataPathStack& s = Fixture().shim_migratable_offset();         \
    body;                                                          \
  }

RDMAVIRT_BENCH5(PostSend, PostSendLoop(state, s.qp, &s.send))
RDMAVIRT_BENCH5(PostSendRdmaWrite, PostSendLoop(state, s.qp, &s.write))
RDMAVIRT_BENCH5(PostRecv, RecvBatches(state, s, Timed::kPost))
RDMAVIRT_BENCH5(PollCq, PollCqLoop(state, s.send_cq))
RDMAVIRT_BENCH5(PollCqRecv, RecvBatches(state, s, Timed::kPoll))
#undef RDMAVIRT_BENCH5

// Two threads, each posting a SEND and polling its completion on its own
// QP and CQ, all in one process: on the direct backend and on one
// migratable shim. Real time per iteration over both threads: the ratio of
// the two is the shim's throughput against the direct path's.
void PostPollThreads(benchmark::State& state, DataPathStack& s) {
  ibv_send_wr* bad = nullptr;
  ibv_wc wc;
  for (auto _ : state) {
    int rc = ibv_post_send(s.qp, &s.send, &bad);
    int n = ibv_poll_cq(s.send_cq, 1, &wc);
    benchmark::DoNotOptimize(rc);
    benchmark::DoNotOptimize(n);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}
void BM_PostPollThreads_Direct(benchmark::State& state) {
  PostPollThreads(state, Fixture().direct_thread(state.thread_index()));
}
void BM_PostPollThreads_ShimMigratable(benchmark::State& state) {
  PostPollThreads(state, Fixture().migratable_thread(state.thread_index()));
}

BENCHMARK(BM_PostSend_Direct);
BENCHMARK(BM_PostSend_Shim);
BENCHMARK(BM_PostSend_ShimOffset);
BENCHMARK(BM_PostSend_ShimMigratable);
BENCHMARK(BM_PostSend_ShimMigratableOffset);
BENCHMARK(BM_PostSendRdmaWrite_Direct);
BENCHMARK(BM_PostSendRdmaWrite_Shim);
BENCHMARK(BM_PostSendRdmaWrite_ShimOffset);
BENCHMARK(BM_PostSendRdmaWrite_ShimMigratable);
BENCHMARK(BM_PostSendRdmaWrite_ShimMigratableOffset);
BENCHMARK(BM_PostRecv_Direct)->UseManualTime();
BENCHMARK(BM_PostRecv_Shim)->UseManualTime();
BENCHMARK(BM_PostRecv_ShimOffset)->UseManualTime();
BENCHMARK(BM_PostRecv_ShimMigratable)->UseManualTime();
BENCHMARK(BM_PostRecv_ShimMigratableOffset)->UseManualTime();
BENCHMARK(BM_PollCq_Direct);
BENCHMARK(BM_PollCq_Shim);
BENCHMARK(BM_PollCq_ShimOffset);
BENCHMARK(BM_PollCq_ShimMigratable);
BENCHMARK(BM_PollCq_ShimMigratableOffset);
BENCHMARK(BM_PollCqRecv_Direct)->UseManualTime();
BENCHMARK(BM_PollCqRecv_Shim)->UseManualTime();
BENCHMARK(BM_PollCqRecv_ShimOffset)->UseManualTime();
BENCHMARK(BM_PollCqRecv_ShimMigratable)->UseManualTime();
BENCHMARK(BM_PollCqRecv_ShimMigratableOffset)->UseManualTime();
// One thread too: the same loop's ratio without a second thread beside it.
BENCHMARK(BM_PostPollThreads_Direct)->Threads(1)->Threads(DataPathFixture::kThreads)->UseRealTime();
BENCHMARK(BM_PostPollThreads_ShimMigratable)
    ->Threads(1)
    ->Threads(DataPathFixture::kThreads)
    ->UseRealTime();

}  // namespace
}  // namespace rdmavirt::bench

BENCHMARK_MAIN();
