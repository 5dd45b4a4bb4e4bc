// Shadow verbs objects: what the application holds instead of the HCA's.
//
// Each embeds the public libibverbs struct first (the application's pointer
// is to it; inline verbs dereference its fields and function pointers) and
// keeps the real object, the owning shadows and the journal of how it was
// made. A Context embeds a full verbs_context so the extended inline verbs
// (ibv_create_qp_ex, ibv_create_cq_ex, ibv_query_port ...) find the shim's
// entries; a Qp is a full ibv_qp_ex and a Cq a full ibv_cq_ex for the same
// reason.
//
// Fields read on the data path are set before the object is published and
// not changed while the application may post or poll on it.
#ifndef RDMAVIRT_SHIM_CORE_OBJECTS_H_
#define RDMAVIRT_SHIM_CORE_OBJECTS_H_

#include <infiniband/verbs.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "shim/core/backend.h"
#include "shim/core/identity.h"
#include "shim/core/mutex.h"
#include "shim/core/remote_map.h"
#include "shim/datapath/pause.h"
#include "shim/datapath/recv_log.h"
#include "shim/datapath/write_relay.h"

namespace rdmavirt::shim {

class Shim;
class MrTable;
// The objects the data path reads start and end on cache lines of their
// own: a line shared with another allocation that another thread writes
// (the provider's objects, the application's data) would make every post
// or poll miss in the cache.
inline constexpr size_t kObjectAlign = 64;

struct Cq;
class QpIndex;
struct Qp;

// A send WR posted during a pause: replayed, in order, when it ends.
struct QueuedSend {
  ibv_send_wr wr;
  std::vector<ibv_sge> sge;
  std::vector<uint8_t> inline_data;  // an inline send's bytes, copied at post
};

// A receive WR posted during a pause.
struct QueuedRecv {
  uint64_t wr_id;
  std::vector<ibv_sge> sge;
};

struct Context {
  verbs_context vctx;  // the application gets &vctx.context
  ibv_context* real = nullptr;
  Shim* shim = nullptr;
  IdentityMode mode;
  // The file status flags the application gave async_fd (O_NONBLOCK, as
  // UCX sets): kept across a release, given to the re-opened device's fd.
  int async_fd_flags = 0;
  // From a restore to the next release: relays the doorbell writes of
  // threads other than the one that re-opened the device (write_relay.h).
  // Owned (Shim::RelayWrites, Shim::DropRelay); a plain pointer keeps
  // Context standard-layout, which AsContext's offsetof needs.
  WriteRelay* relay = nullptr;
};

inline Context* AsContext(ibv_context* c) {
  return reinterpret_cast<Context*>(reinterpret_cast<char*>(c) - offsetof(Context, vctx.context));
}
inline ibv_context* Shadow(Context* c) { return &c->vctx.context; }

struct Pd {
  ibv_pd shadow;
  ibv_pd* real = nullptr;
  Context* ctx = nullptr;
};

struct Mr {
  ibv_mr shadow;  // lkey: virtual slot key; rkey: virtual (identity.h)
  ibv_mr* real = nullptr;
  Pd* pd = nullptr;
  uint32_t slot = 0;
  uint64_t iova = 0;
  unsigned int access = 0;
};

// A completion channel. ibv_get_cq_event waits on the real channel's fd
// and on `wake_fd`, which the shim writes (under `mu`) when the waiter must
// look again: the real channel goes away at a release (the waiter then
// waits for the restore) or the shim owes an event (below). The waiter
// empties it, under `mu`, once it has seen neither.
struct Channel {
  ibv_comp_channel shadow;
  ibv_comp_channel* real = nullptr;
  Context* ctx = nullptr;
  int wake_fd = -1;  // eventfd, nonblocking
  // The file status flags the application gave the channel's fd
  // (O_NONBLOCK, as UCX sets): kept across a release, given to the
  // re-created channel's fd.
  int fd_flags = 0;
  std::mutex mu;  // guards the fields below; never held across a verb
  std::condition_variable cv;
  bool released = false;  // no real channel: between a release and a restore
  int in_use = 0;         // threads in poll(2) or read(2) on the real channel's fd
  // CQs the shim owes an event: armed by the application when a pause
  // moved their completions into the shadow CQ, where no real event
  // will announce them.
  std::vector<Cq*> owed;
};

struct alignas(kObjectAlign) Cq {
  ibv_cq_ex shadow;  // ibv_cq is its prefix (ibv_cq_ex_to_cq is a cast)
  ibv_cq* real = nullptr;
  // kDirect or kMarked while no completion on it needs an identity
  // translated or counted, nor a pause held completions for it.
  PathState path;
  // What `path` returns to once held completions are handed out.
  std::atomic<bool> marked_base{false};
  // A drain gave up before its marker came: the translating path drops it.
  // `path` takes the long way (PathState::kLongWayBit) while completions
  // are held (pending), markers are late, or held completions handed out
  // must be followed by a return to the marked path (marked_base).
  bool markers_late = false;
  int (*real_poll_cq)(ibv_cq*, int, ibv_wc*) = nullptr;
  ibv_cq_ex* real_ex = nullptr;  // when created with ibv_create_cq_ex
  bool extended = false;         // it was: a restore re-creates it so
  Context* ctx = nullptr;
  const QpIndex* qps = nullptr;  // for completions' qp_num
  // qps->home_slots(): the translating poll's lookup of one completion.
  const std::atomic<Qp*>* qp_home = nullptr;
  Channel* channel = nullptr;
  int comp_vector = 0;
  uint64_t wc_flags = 0;
  int cqe = 0;    // as asked at creation
  int slack = 0;  // entries the real CQ has beyond `cqe`: the drain's markers
  // Migration (migration/release.cc): completions found while the CQ was paused,
  // handed out before the real CQ's. Written by the control thread while
  // paused only; `pending_head` is claimed by pollers with a CAS.
  PauseGate* pause = nullptr;  // the shim's, when the process is migratable
  std::vector<ibv_wc> pending;
  std::atomic<uint32_t> pending_head{0};
  uint32_t pending_count = 0;
  // An extended poll batch (ibv_start_poll .. ibv_end_poll) reads held
  // completions from `cursor` until they run out, then the real CQ's.
  // One batch at a time per CQ, as the verbs require.
  bool cursor_held = false;  // the batch's current completion is `cursor`
  bool real_batch = false;   // the real CQ's start_poll succeeded in this batch
  ibv_wc cursor{};

  // Completion events (shim.cc). A real CQ's destroy waits until every
  // event it delivered is acknowledged; a release acknowledges, on the
  // application's behalf, those it has not, and the application's later
  // acknowledgements of them are absorbed here.
  Mutex events_mu;  // never held across a blocking verb
  // Delivered by the real CQ, not acknowledged to it.
  uint32_t events_unacked ABSL_GUARDED_BY(events_mu) = 0;
  // The application still owes these to the shim.
  uint32_t events_absorbed ABSL_GUARDED_BY(events_mu) = 0;
  // The real CQ is being destroyed.
  bool events_closed ABSL_GUARDED_BY(events_mu) = false;
  std::atomic<bool> armed{false};  // ibv_req_notify_cq since its last event
};

struct alignas(kObjectAlign) Srq {
  ibv_srq shadow;
  ibv_srq* real = nullptr;
  PathState path;  // as Qp::path
  int (*real_post_srq_recv)(ibv_srq*, ibv_recv_wr*, ibv_recv_wr**) = nullptr;
  MrLookup mrs;  // the shim's MR table
  Pd* pd = nullptr;
  ibv_srq_init_attr init{};
  RecvLog recvs;
  PauseGate* pause = nullptr;  // as Cq::pause
  // Successful receive completions: an SRQ's receives are not flushed when
  // its QPs fail, so its CQs count them (kTranslated).
  std::atomic<uint64_t> recvs_done{0};
  std::vector<QueuedRecv> queued_recvs ABSL_GUARDED_BY(pause->queue_mu());
  std::vector<QueuedRecv> outstanding;  // at release: to re-post
};

// One successful ibv_modify_qp, with the virtual identities the
// application gave: replayed in order to rebuild the QP elsewhere.
struct QpTransition {
  ibv_qp_attr attr;
  int mask;
};

struct alignas(kObjectAlign) Qp {
  ibv_qp_ex shadow;  // ibv_qp is its prefix; qp_num is the virtual QPN
  ibv_qp* real = nullptr;
  // kDirect or kMarked while nothing this QP posts needs translating (no
  // key or QPN differs from the hardware's, no AH to swap, not UD).
  PathState path;
  int (*real_post_send)(ibv_qp*, ibv_send_wr*, ibv_send_wr**) = nullptr;
  int (*real_post_recv)(ibv_qp*, ibv_recv_wr*, ibv_recv_wr**) = nullptr;
  // The translating path's post of one WR with one SGE, by opcode
  // (data_path.cc: InstallSendPath): by the QP's type, and for RC and UC
  // whether `remote` is set. Set before `remote` is, cleared after it is:
  // a post that sees `remote` set finds the table that looks it up.
  std::atomic<int (*const*)(Qp*, ibv_send_wr*, ibv_send_wr**)> post_one{nullptr};
  // What a probed entry dispatches one WR with one SGE through, its path
  // word not compared (data_path.cc: PublishSendPath): `post_one` while
  // `path` is exactly kTranslated, the provider's entry while exactly
  // kMarked, else the gate for every opcode. Written again after every
  // change of `path` or of `post_one` (under the shim's lock): a pause
  // points it at the gate before it asks the threads where they are.
  std::atomic<int (*const*)(Qp*, ibv_send_wr*, ibv_send_wr**)> post_probed{nullptr};
  ibv_qp_ex* real_ex = nullptr;  // when created with send_ops_flags
  MrLookup mrs;                  // the shim's MR table
  IdentityMode mode;
  uint32_t physical_rkey_mask = ~uint32_t{0};  // mode.PhysicalRkeyMask()
  Context* ctx = nullptr;
  Pd* pd = nullptr;
  Cq* send_cq = nullptr;
  Cq* recv_cq = nullptr;
  Srq* srq = nullptr;
  // Not UD and without an SRQ: a completion's QPN is all there is to
  // translate (and an invalidated rkey), nothing is counted for the drain.
  bool plain_completions = false;
  uint32_t physical_qpn = 0;
  // physical_qpn when plain_completions, else kNoQpn: the completion
  // path's one compare finds the QP and that it needs nothing more.
  static constexpr uint32_t kNoQpn = ~uint32_t{0};  // QPNs have 24 bits
  uint32_t plain_qpn = kNoQpn;
  void SetPhysicalQpn(uint32_t qpn) {
    physical_qpn = qpn;
    plain_qpn = plain_completions ? qpn : kNoQpn;
  }
  // The moved peer this QP is connected to, once one has published its
  // mapping (RC/UC; set under the shim's mutex, read on the translating path).
  std::atomic<const RemoteEndpoint*> remote{nullptr};
  ibv_gid remote_gid{};      // the virtual GID it was connected to
  uint32_t remote_qpn = 0;   // and the virtual QPN
  RecvLog* recvs = nullptr;  // own_recvs, or the SRQ's
  RecvLog own_recvs;
  ibv_qp_init_attr_ex init{};
  std::vector<QpTransition> transitions;
  // The multicast groups the QP is attached to (UD), attached again to
  // the QP a restore creates (under the shim's mutex).
  struct Group {
    ibv_gid gid;
    uint16_t lid;
  };
  std::vector<Group> groups;

  // Migration (migration/release.cc). The drain of an RC or UC QP posts a marker
  // (a signaled zero-length RDMA WRITE) and waits for its completion: the
  // send queue completes in order. A UD QP's signaled sends are counted
  // instead (its posts translate anyway). A release counts a QP's
  // receives still posted from their flushes.
  PauseGate* pause = nullptr;                // as Cq::pause
  bool in_batch = false;                     // between ibv_wr_start and wr_complete/abort
  std::atomic<uint64_t> signaled_posted{0};  // UD
  std::atomic<uint64_t> sends_done{0};       // UD
  std::atomic<bool> unsignaled_tail{false};  // UD: unsignaled sends after the last signaled one
  // Control thread only, while paused.
  bool send_marker_pending = false;
  // Its sends were drained in this pause: while paused nothing reaches its
  // send queue, so a second quiesce (a peer's, then the endpoint's own)
  // has nothing to wait for on it. Cleared at the resume.
  bool drained = false;
  bool recv_marker_seen = false;
  // Where a peer re-point last brought it up (the moved endpoint it was
  // reset toward); nullptr since the application's own transition or a
  // re-creation. A re-point toward the same place again (a request asked
  // again after a migrator's restart) leaves it running as it is: reset,
  // it would start over from the PSNs of its first connection, while the
  // QP at the other end has gone on.
  const RemoteEndpoint* repointed_at = nullptr;
  uint32_t recv_flushes = 0;           // flushed receives counted since the QP was failed
  uint32_t recv_flushes_expected = 0;  // when no marker receive fit: the queue's size
  std::vector<QueuedSend> queued_sends ABSL_GUARDED_BY(pause->queue_mu());
  std::vector<QueuedRecv> queued_recvs ABSL_GUARDED_BY(pause->queue_mu());
  std::vector<QueuedRecv> outstanding;  // at release or re-point: to re-post
  int64_t reposted = -1;                // of them, re-posted in this pause (-1: not re-made)
  bool flushing = false;                // its flush completions are dropped
  uint64_t builder_signaled = 0;        // ibv_wr_* between wr_start and wr_complete
};

// An AH addresses a virtual GID, behind which several endpoints may live
// (every process started on one host has that host's GID). `real` reaches
// the GID's own place: the endpoints that never moved. Each endpoint that
// moved away has a route, an AH of its own to where it is now, chosen per
// datagram by the remote QPN it is sent to (UdRoute, data_path.cc).
inline constexpr int kMaxAhRoutes = 8;
struct AhRoute {
  const RemoteEndpoint* remote = nullptr;
  ibv_ah* real = nullptr;
};
struct Ah {
  ibv_ah shadow;
  ibv_ah* real = nullptr;
  Pd* pd = nullptr;
  ibv_ah_attr attr{};  // virtual GID, as the application gave it
  // Written under the shim's mutex while the endpoint is paused (or before
  // the AH is handed out), read on the data path.
  std::atomic<int> nroutes{0};
  AhRoute routes[kMaxAhRoutes];
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_OBJECTS_H_
