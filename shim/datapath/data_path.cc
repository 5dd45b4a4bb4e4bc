#include "shim/datapath/data_path.h"

#include <errno.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "shim/core/grh.h"
#include "shim/core/log.h"
#include "shim/core/shim.h"
#include "shim/core/tables.h"

namespace rdmavirt::shim {
namespace {

inline Qp* AsQp(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
inline Qp* AsQp(ibv_qp_ex* q) { return reinterpret_cast<Qp*>(q); }
inline Cq* AsCq(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }
inline Cq* AsCq(ibv_cq_ex* c) { return reinterpret_cast<Cq*>(c); }
inline Srq* AsSrq(ibv_srq* s) { return reinterpret_cast<Srq*>(s); }

int PostRecvGated(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
int PostSrqRecvGated(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad);
[[gnu::always_inline]] inline Qp* VirtualizeWc(const QpIndex* qps, ibv_wc* wc);

// Fields rewritten in the application's work requests for the length of
// one call into the provider, and put back afterwards. On the stack: a
// chain needing more is posted in pieces.
class Patches {
 public:
  static constexpr int kKeys = 64;
  static constexpr int kPtrs = 16;

  bool Fits(int keys, int ptrs) const { return nkeys_ + keys <= kKeys && nptrs_ + ptrs <= kPtrs; }
  void Key(uint32_t* where, uint32_t value) {
    keys_[nkeys_++] = {where, *where};
    *where = value;
  }
  template <typename T>
  void Ptr(T** where, T* value) {
    ptrs_[nptrs_++] = {reinterpret_cast<void**>(where), *where};
    *where = value;
  }
  void Restore() {
    for (int i = nkeys_ - 1; i >= 0; --i) *keys_[i].where = keys_[i].old;
    for (int i = nptrs_ - 1; i >= 0; --i) *ptrs_[i].where = ptrs_[i].old;
  }

 private:
  struct KeyPatch {
    uint32_t* where;
    uint32_t old;
  };
  struct PtrPatch {
    void** where;
    void* old;
  };
  KeyPatch keys_[kKeys];
  PtrPatch ptrs_[kPtrs];
  int nkeys_ = 0;
  int nptrs_ = 0;
};

// A peer's rkey: through what it published if it has moved.
inline uint32_t PeerRkey(const Qp* qp, uint32_t rkey) {
  const RemoteEndpoint* r = qp->remote.load(std::memory_order_acquire);
  if (r != nullptr) [[unlikely]]
    return r->Rkey(rkey);
  return rkey & qp->physical_rkey_mask;
}
// A datagram's way to its peer: the route of the moved endpoint that owns
// the QPN it is sent to, else the AH's own (the GID's place). No route on
// an AH toward peers that never moved: one load.
inline const AhRoute* UdRoute(const Ah* ah, uint32_t qpn) {
  for (int i = ah->nroutes.load(std::memory_order_acquire); i-- > 0;)
    if (ah->routes[i].remote->Owns(qpn)) return &ah->routes[i];
  return nullptr;
}
inline uint32_t UdPeerQpn(const Qp* qp, const AhRoute* route, uint32_t qpn) {
  return route != nullptr ? route->remote->Qpn(qpn) : qp->mode.PhysicalQpn(qpn);
}

// Where the peer's rkey sits in a send WR, by opcode (0: it has none).
constexpr std::array<uint8_t, 32> kRkeyOffset = [] {
  std::array<uint8_t, 32> a{};
  for (const int op :
       {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_WRITE})
    a[op] = offsetof(ibv_send_wr, wr.rdma.rkey);
  for (const int op : {IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD})
    a[op] = offsetof(ibv_send_wr, wr.atomic.rkey);
  a[IBV_WR_SEND_WITH_INV] = offsetof(ibv_send_wr, invalidate_rkey);
  return a;
}();

// A send WR's opcode as the application stored it: any number (a C
// program may put any int in the enum; C++ may not load one outside the
// enum's range as the enum, so it is read as the number it is).
inline uint32_t OpcodeOf(const ibv_send_wr* wr) {
  uint32_t op;
  static_assert(sizeof(wr->opcode) == sizeof(op));
  std::memcpy(&op, &wr->opcode, sizeof(op));
  return op;
}

// Where in a WR the peer's rkey sits (0: its opcode has none).
inline unsigned RkeyOffset(const ibv_send_wr* wr) {
  const uint32_t op = OpcodeOf(wr);
  return op < kRkeyOffset.size() ? kRkeyOffset[op] : 0;
}
// The field of a WR that holds the peer's rkey, if its opcode has one.
inline uint32_t* RkeyField(ibv_send_wr* wr) {
  const unsigned off = RkeyOffset(wr);
  return off == 0 ? nullptr : reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(wr) + off);
}

// Rewrites one send WR to physical identities; false if it does not fit.
inline bool PatchSendWr(const Qp* qp, ibv_send_wr* wr, Patches* p) {
  const int nsge = wr->num_sge;
  // Keys: the SGEs' lkeys, an rkey or invalidate key, a UD remote QPN.
  // Pointers: a UD AH, plus one kept for cutting the chain after this WR.
  if (!p->Fits(nsge + 2, 2)) return false;
  for (int i = 0; i < nsge; ++i) {
    uint32_t* lkey = &wr->sg_list[i].lkey;
    p->Key(lkey, qp->mrs.ToPhysicalAt(lkey));
  }
  if (uint32_t* rkey = RkeyField(wr)) p->Key(rkey, PeerRkey(qp, *rkey));
  if (qp->shadow.qp_base.qp_type == IBV_QPT_UD) {
    const Ah* ah = reinterpret_cast<Ah*>(wr->wr.ud.ah);
    const AhRoute* route = UdRoute(ah, wr->wr.ud.remote_qpn);
    p->Key(&wr->wr.ud.remote_qpn, UdPeerQpn(qp, route, wr->wr.ud.remote_qpn));
    p->Ptr(&wr->wr.ud.ah, route != nullptr ? route->real : ah->real);
  }
  return true;
}

// The code of the probed path (thread_probe.h): a thread with a frame in
// this section is inside a post or poll of a process whose pause probes
// its threads (it has passed its check, or is about to). The translating
// functions below are in it too: a probed post jumps into them.
#define RDMAVIRT_PROBED_PATH gnu::section("rdmavirt_probed_path")

// The common cases of the translating path: one RC/UC WR with one SGE,
// translated from locals (no patch list), the application's values put
// back after the call. Each is a function of its own, so that each saves
// only the registers it needs.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostOneTranslated(Qp* qp, ibv_send_wr* wr,
                                                              ibv_send_wr** bad) {
  ibv_sge* sg = wr->sg_list;
  const uint32_t lkey = sg->lkey;
  sg->lkey = qp->mrs.ToPhysicalAt(&sg->lkey);
  const int rc = qp->real_post_send(qp->real, wr, bad);
  sg->lkey = lkey;
  return rc;
}
// ... one whose peer's rkey is `off` bytes into the WR. The SGE and the
// rkey are found again through `wr` after the call, so fewer registers are
// kept across it. kToMoved: the QP's peer may have moved (SetPeer),
// and its rkeys are looked up in what it published; else they are made
// physical as the mode says (one AND).
template <bool kToMoved>
[[gnu::always_inline]] inline int PostOneWithRkeyAt(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad,
                                                    unsigned off) {
  auto rkey = [wr, off] { return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(wr) + off); };
  const uint32_t r = *rkey();
  *rkey() = kToMoved ? PeerRkey(qp, r) : r & qp->physical_rkey_mask;
  const uint32_t lkey = wr->sg_list->lkey;
  wr->sg_list->lkey = qp->mrs.ToPhysicalAt(&wr->sg_list->lkey);
  const int rc = qp->real_post_send(qp->real, wr, bad);
  *rkey() = r;
  wr->sg_list->lkey = lkey;
  return rc;
}
// RDMA WRITE (with or without immediate) and READ: the rkey at wr.rdma.rkey.
template <bool kToMoved>
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostOneTranslatedRdma(Qp* qp, ibv_send_wr* wr,
                                                                  ibv_send_wr** bad) {
  return PostOneWithRkeyAt<kToMoved>(qp, wr, bad, offsetof(ibv_send_wr, wr.rdma.rkey));
}
// Any other opcode: the rkey where the opcode has one.
template <bool kToMoved>
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostOneTranslatedRkey(Qp* qp, ibv_send_wr* wr,
                                                                  ibv_send_wr** bad) {
  const unsigned off = RkeyOffset(wr);
  if (off == 0) return PostOneTranslated(qp, wr, bad);
  return PostOneWithRkeyAt<kToMoved>(qp, wr, bad, off);
}

// Posts a chain with every identity translated in place, restoring the
// application's values afterwards.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostChainTranslated(Qp* qp, ibv_send_wr* wr,
                                                                ibv_send_wr** bad) {
  ibv_qp* real = qp->real;
  while (wr != nullptr) {
    Patches p;
    ibv_send_wr* first = wr;
    ibv_send_wr* last = nullptr;
    for (; wr != nullptr && PatchSendWr(qp, wr, &p); wr = wr->next) last = wr;
    if (last == nullptr) {
      // More SGEs than any HCA takes: the provider would refuse it too.
      *bad = first;
      return EINVAL;
    }
    if (wr != nullptr) p.Ptr(&last->next, static_cast<ibv_send_wr*>(nullptr));
    const int rc = qp->real_post_send(real, first, bad);
    p.Restore();
    if (rc != 0) return rc;
  }
  return 0;
}

// How one RC or UC work request with one SGE is posted on the translating
// path, by its opcode's low byte (no bound to check): the function that
// translates just what that opcode carries. Every WR of a UD QP takes
// the chain's path; on the probed path (PostSendProbed), the gate, which
// counts them for the drain. An opcode past 255, which no provider takes,
// is translated as the one of its low byte would be: the provider refuses
// it, and the WR is put back as always.
constexpr int kPostOneOps = 256;
using PostOneFn = int (*)(Qp*, ibv_send_wr*, ibv_send_wr**);
// Chosen from kRkeyOffset: no rkey (an unknown opcode too), the rkey
// where RDMA ops keep it, or elsewhere. Two tables: for a QP whose peer
// has moved (its rkeys looked up in what it published) and for the rest.
template <bool kToMoved>
constexpr std::array<PostOneFn, kPostOneOps> kPostOneConnected = [] {
  std::array<PostOneFn, kPostOneOps> a{};
  for (int op = 0; op < kPostOneOps; ++op) {
    const unsigned off = op < static_cast<int>(kRkeyOffset.size()) ? kRkeyOffset[op] : 0;
    a[op] = off == 0                                     ? PostOneTranslated
            : off == offsetof(ibv_send_wr, wr.rdma.rkey) ? PostOneTranslatedRdma<kToMoved>
                                                         : PostOneTranslatedRkey<kToMoved>;
  }
  return a;
}();
constexpr std::array<PostOneFn, kPostOneOps> kPostOneDatagram = [] {
  std::array<PostOneFn, kPostOneOps> a{};
  a.fill(PostChainTranslated);
  return a;
}();
[[gnu::noinline]] int PostSendNotProbed(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
// Every opcode to the gate: a UD QP's translating table in a probed
// process (its sends are counted there), and what a probed entry finds on
// a QP that is paused or on no path of its own (Qp::post_probed).
constexpr std::array<PostOneFn, kPostOneOps> kPostOneGate = [] {
  std::array<PostOneFn, kPostOneOps> a{};
  a.fill(PostSendNotProbed);
  return a;
}();
// A QP on the marked path, reached from an entry that compared no word:
// the provider's entry by a tail call, as the marked path's own entry.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostOneToProvider(Qp* qp, ibv_send_wr* wr,
                                                              ibv_send_wr** bad) {
  return qp->real_post_send(qp->real, wr, bad);
}
constexpr std::array<PostOneFn, kPostOneOps> kPostOneProvider = [] {
  std::array<PostOneFn, kPostOneOps> a{};
  a.fill(PostOneToProvider);
  return a;
}();

// The translating post of one WR with one SGE, by its opcode's low byte.
inline PostOneFn PostOneOf(const Qp* qp, const ibv_send_wr* wr) {
  return qp->post_one.load(std::memory_order_relaxed)[static_cast<uint8_t>(OpcodeOf(wr))];
}
// The same through the table the QP's path chose (Qp::post_probed), read
// as an acquire: what its function reads of the QP is not read before it.
inline PostOneFn ProbedOneOf(const Qp* qp, const ibv_send_wr* wr) {
  return qp->post_probed.load(std::memory_order_acquire)[static_cast<uint8_t>(OpcodeOf(wr))];
}

[[gnu::always_inline]] inline int PostSendTranslated(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  if (wr != nullptr && wr->next == nullptr && wr->num_sge == 1) [[likely]]
    return PostOneOf(qp, wr)(qp, wr, bad);
  return PostChainTranslated(qp, wr, bad);
}

// Posts during a pause: copied (with an inline send's bytes, which the
// application may reuse as soon as the call returns) and reported as
// posted (*rc). False, with nothing queued, when the pause ended while
// this thread waited for the queue: the post is to go through after all.
bool QueueSends(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad, int* rc) {
  MutexLock lock(&qp->pause->queue_mu());
  if (!qp->path.paused()) return false;
  *rc = 0;
  for (ibv_send_wr* w = wr; w != nullptr; w = w->next) {
    if (w->num_sge < 0 || static_cast<uint32_t>(w->num_sge) > qp->init.cap.max_send_sge + 0u) {
      *bad = w;  // the provider refuses it too
      *rc = EINVAL;
      return true;
    }
    QueuedSend q{};
    q.wr = *w;
    q.wr.next = nullptr;
    q.sge.assign(w->sg_list, w->sg_list + w->num_sge);
    if (w->send_flags & IBV_SEND_INLINE) {
      for (const ibv_sge& s : q.sge) {
        const uint8_t* p = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(s.addr));
        q.inline_data.insert(q.inline_data.end(), p, p + s.length);
      }
    }
    qp->queued_sends.push_back(std::move(q));
  }
  return true;
}

int QueueRecvsInto(PauseGate* pause, const PathState& path, std::vector<QueuedRecv>* queue,
                   uint32_t max_sge, ibv_recv_wr* wr, ibv_recv_wr** bad, bool* resumed) {
  MutexLock lock(&pause->queue_mu());
  if (!path.paused()) {
    *resumed = true;
    return 0;
  }
  for (ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
    if (w->num_sge < 0 || static_cast<uint32_t>(w->num_sge) > max_sge) {
      *bad = w;
      return EINVAL;
    }
    queue->push_back({w->wr_id, std::vector<ibv_sge>(w->sg_list, w->sg_list + w->num_sge)});
  }
  return 0;
}

int QueueRecvs(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  bool resumed = false;
  const int rc = QueueRecvsInto(qp->pause, qp->path, &qp->queued_recvs, qp->init.cap.max_recv_sge,
                                wr, bad, &resumed);
  return resumed ? PostRecvGated(qp, wr, bad) : rc;
}

int QueueRecvs(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  bool resumed = false;
  const int rc = QueueRecvsInto(srq->pause, srq->path, &srq->queued_recvs, srq->init.attr.max_sge,
                                wr, bad, &resumed);
  return resumed ? PostSrqRecvGated(srq, wr, bad) : rc;
}

// Signaled sends posted, for the drain at a pause (migration/release.cc).
inline void CountSignaled(Qp* qp, const ibv_send_wr* wr, const ibv_send_wr* stop, int sign) {
  const bool all = qp->init.sq_sig_all != 0;
  uint64_t n = 0;
  bool unsignaled_tail = qp->unsignaled_tail.load(std::memory_order_relaxed);
  for (; wr != stop; wr = wr->next) {
    const bool signaled = all || (wr->send_flags & IBV_SEND_SIGNALED);
    n += signaled;
    unsignaled_tail = !signaled;
  }
  if (n != 0) {
    if (sign > 0)
      qp->signaled_posted.fetch_add(n, std::memory_order_relaxed);
    else
      qp->signaled_posted.fetch_sub(n, std::memory_order_relaxed);
  }
  if (sign > 0) qp->unsignaled_tail.store(unsignaled_tail, std::memory_order_relaxed);
}

// A post that found its process paused: first the step the control
// thread left for an application thread, if any; then queued, reported as
// posted; or, the pause over by then, posted inside the thread's mark
// (and, paused again meanwhile, the same once more).
[[gnu::noinline]] int PostSendPaused(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  for (;;) {
    qp->ctx->shim->RunPendingStep();
    int rc = 0;
    if (QueueSends(qp, wr, bad, &rc)) return rc;
    if (Enter(qp->path)) {
      rc = PostSendReal(qp, wr, bad);
      LeaveFast();
      return rc;
    }
  }
}

// The slow path of a migratable process's posts: translating, inside the
// thread's mark (registered here on its first call).
[[gnu::noinline]] int PostSendGated(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  if (!Enter(qp->path)) [[unlikely]]
    return PostSendPaused(qp, wr, bad);
  const int rc = PostSendReal(qp, wr, bad);
  LeaveFast();
  return rc;
}

// A process the migrator cannot move: a tail call, or the translating path.
int PostSend(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* qp = AsQp(ibqp);
  if (qp->path.Is(Path::kDirect)) [[likely]]
    return qp->real_post_send(qp->real, wr, bad);
  return PostSendTranslated(qp, wr, bad);
}
// The same in offset mode, where every queue translates: one WR with one
// SGE through the table its path chose (Qp::post_probed), no word
// compared.
int PostSendTranslatingFirst(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* qp = AsQp(ibqp);
  if (wr != nullptr && wr->next == nullptr && wr->num_sge == 1) [[likely]]
    return ProbedOneOf(qp, wr)(qp, wr, bad);
  if (qp->path.Is(Path::kDirect)) return qp->real_post_send(qp->real, wr, bad);
  return PostChainTranslated(qp, wr, bad);
}

// The translating path inside a mark EnterGate raised (a migratable
// process after a move): out of line, so that the marked path keeps its
// few registers.
[[gnu::noinline]] int PostSendInMark(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  // A UD QP's sends are counted for the drain (PostSendReal).
  const int rc = qp->shadow.qp_base.qp_type == IBV_QPT_UD ? PostSendReal(qp, wr, bad)
                                                          : PostSendTranslated(qp, wr, bad);
  LeaveFast();
  return rc;
}

// A process the migrator may move: the provider's call inside the mark,
// translated if its queue needs it.
int PostSendPausable(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* qp = AsQp(ibqp);
  const Gate gate = EnterGate(qp->path);
  if (gate == Gate::kMarked) [[likely]] {
    const int rc = qp->real_post_send(qp->real, wr, bad);
    LeaveFast();
    return rc;
  }
  if (gate == Gate::kTranslated) return PostSendInMark(qp, wr, bad);
  return PostSendGated(qp, wr, bad);
}

// A migratable process whose pause asks its threads where they are
// (thread_probe.h). On the marked path and not paused: the provider's
// entry by a tail call, as on the fast path. On the translating path (a
// process after a move): translated without a mark, by functions of the
// probed path's section (a frame of theirs is on the stack until the
// application's WR is put back). The rest (a UD QP's counted sends, a
// pause) through the gate.
[[gnu::noinline]] int PostSendNotProbed(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  if (EnterTranslated(qp->path)) [[likely]]
    return PostSendInMark(qp, wr, bad);
  return PostSendGated(qp, wr, bad);
}
// A probed post but the marked path's: one WR with one SGE through the
// table its path word chose (ProbedOneOf), which spares the entry that
// word's compare; the rest by the word. A UD QP's translating table sends
// its WRs to the gate (kPostOneGate).
[[gnu::always_inline]] inline int PostSendProbedOn(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  if (wr != nullptr && wr->next == nullptr && wr->num_sge == 1) [[likely]]
    return ProbedOneOf(qp, wr)(qp, wr, bad);
  const uint16_t path = qp->path.word();
  if (path == static_cast<uint16_t>(Path::kTranslated) && qp->shadow.qp_base.qp_type != IBV_QPT_UD)
    return PostChainTranslated(qp, wr, bad);
  if (path == static_cast<uint16_t>(Path::kMarked)) return qp->real_post_send(qp->real, wr, bad);
  return PostSendNotProbed(qp, wr, bad);
}
[[RDMAVIRT_PROBED_PATH]] int PostSendProbed(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* qp = AsQp(ibqp);
  if (qp->path.word() == static_cast<uint16_t>(Path::kMarked)) [[likely]]
    return qp->real_post_send(qp->real, wr, bad);
  return PostSendProbedOn(qp, wr, bad);
}
// The same, for a context whose queues translate (offset mode, or a
// process after a move: InstallTranslatingOps): no word compared first.
[[RDMAVIRT_PROBED_PATH]] int PostSendProbedTranslating(ibv_qp* ibqp, ibv_send_wr* wr,
                                                       ibv_send_wr** bad) {
  return PostSendProbedOn(AsQp(ibqp), wr, bad);
}

// Receive WRs: only their SGEs' lkeys are identities. Every WR is also
// recorded in the queue's RecvLog (the journal of recent receives). The
// caller is the log's writer (RecvLog::Writer).
template <typename Post>
int WriteRecvsTranslated(MrLookup mrs, RecvLog* log, ibv_recv_wr* wr, ibv_recv_wr** bad,
                         Post post) {
  while (wr != nullptr) {
    Patches p;
    ibv_recv_wr* first = wr;
    ibv_recv_wr* last = nullptr;
    // A WR the log refuses (more SGEs than the queue takes) ends the piece,
    // so every WR in a piece is logged and a refusal is undone exactly.
    for (; wr != nullptr && p.Fits(wr->num_sge, 1) && log->Push(wr); wr = wr->next) {
      for (int i = 0; i < wr->num_sge; ++i) {
        uint32_t* lkey = &wr->sg_list[i].lkey;
        p.Key(lkey, mrs.ToPhysicalAt(lkey));
      }
      last = wr;
    }
    if (last == nullptr) {
      *bad = first;  // the provider refuses it too
      return EINVAL;
    }
    ibv_recv_wr* const rest = last->next;
    if (rest != nullptr) p.Ptr(&last->next, static_cast<ibv_recv_wr*>(nullptr));
    const int rc = post(first, bad);
    p.Restore();
    if (rc != 0) {
      uint32_t refused = 0;  // from *bad on, nothing was posted
      for (ibv_recv_wr* w = *bad; w != nullptr && w != rest; w = w->next) ++refused;
      log->Unpush(refused);
      return rc;
    }
    wr = rest;
  }
  return 0;
}

template <typename Post>
int PostRecvTranslated(MrLookup mrs, RecvLog* log, ibv_recv_wr* wr, ibv_recv_wr** bad, Post post) {
  RecvLog::Writer writer(log);
  return WriteRecvsTranslated(mrs, log, wr, bad, post);
}

// Nothing to translate: record, post, and forget what the provider
// refused. A WR the log refuses sends the chain down the piecewise path,
// which stops at it.
template <typename Post>
inline int PostRecvLogged(MrLookup mrs, RecvLog* log, ibv_recv_wr* wr, ibv_recv_wr** bad,
                          Post post) {
  RecvLog::Writer writer(log);
  uint32_t logged = 0;
  for (ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
    if (!log->Push(w)) [[unlikely]] {
      log->Unpush(logged);
      return WriteRecvsTranslated(mrs, log, wr, bad, post);
    }
    ++logged;
  }
  const int rc = post(wr, bad);
  if (rc != 0) [[unlikely]] {
    uint32_t refused = 0;
    for (ibv_recv_wr* w = *bad; w != nullptr; w = w->next) ++refused;
    log->Unpush(refused);
  }
  return rc;
}

// One receive WR with one SGE, the common case, by the queue's owning
// thread: logged, then posted; with kTranslate its lkey is made physical
// for the call and put back after. False, nothing done, for anything else
// (another thread's post included: the slow path takes a Writer).
template <bool kTranslate, typename Real>
[[gnu::always_inline]] inline bool PostOneRecv(MrLookup mrs, RecvLog* log, Real* real,
                                               int (*post)(Real*, ibv_recv_wr*, ibv_recv_wr**),
                                               ibv_recv_wr* wr, ibv_recv_wr** bad, int* rc) {
  if (wr == nullptr || wr->next != nullptr || wr->num_sge != 1) [[unlikely]]
    return false;
  if (!log->BeginOwned()) [[unlikely]]
    return false;
  log->PushSingle(wr);
  uint32_t lkey = 0;
  if constexpr (kTranslate) {
    lkey = wr->sg_list->lkey;
    wr->sg_list->lkey = mrs.ToPhysicalAt(&wr->sg_list->lkey);
  }
  *rc = post(real, wr, bad);
  if constexpr (kTranslate) wr->sg_list->lkey = lkey;
  if (*rc != 0) [[unlikely]]
    log->Unpush(1);
  log->EndOwned();
  return true;
}

// A QP's or an SRQ's journal: a QP on an SRQ records in the SRQ's.
inline RecvLog* RecvsOf(Qp* qp) { return qp->recvs; }
inline RecvLog* RecvsOf(Srq* srq) { return &srq->recvs; }

// PostOneRecv on a QP's or an SRQ's own journal and provider entry.
template <bool kTranslate>
[[gnu::always_inline]] inline bool PostOneRecvOn(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad,
                                                 int* rc) {
  return PostOneRecv<kTranslate>(qp->mrs, RecvsOf(qp), qp->real, qp->real_post_recv, wr, bad, rc);
}
template <bool kTranslate>
[[gnu::always_inline]] inline bool PostOneRecvOn(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad,
                                                 int* rc) {
  return PostOneRecv<kTranslate>(srq->mrs, RecvsOf(srq), srq->real, srq->real_post_srq_recv, wr,
                                 bad, rc);
}

// PostRecvReal's and PostSrqRecvReal's other cases, out of line: the
// common one keeps a small frame.
[[gnu::noinline]] int PostRecvPieces(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  ibv_qp* real = qp->real;
  auto post = [qp, real](ibv_recv_wr* w, ibv_recv_wr** b) {
    return qp->real_post_recv(real, w, b);
  };
  return PostRecvTranslated(qp->mrs, qp->recvs, wr, bad, post);
}
[[gnu::noinline]] int PostSrqRecvPieces(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  ibv_srq* real = srq->real;
  auto post = [srq, real](ibv_recv_wr* w, ibv_recv_wr** b) {
    return srq->real_post_srq_recv(real, w, b);
  };
  return PostRecvTranslated(srq->mrs, &srq->recvs, wr, bad, post);
}

}  // namespace

int PostRecvReal(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  int rc;
  if (PostOneRecvOn<true>(qp, wr, bad, &rc)) [[likely]]
    return rc;
  return PostRecvPieces(qp, wr, bad);
}

int PostSrqRecvReal(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  int rc;
  if (PostOneRecvOn<true>(srq, wr, bad, &rc)) [[likely]]
    return rc;
  return PostSrqRecvPieces(srq, wr, bad);
}

int PostSendReal(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  // An RC or UC QP is drained with a marker; a UD QP's sends are counted.
  if (qp->shadow.qp_base.qp_type != IBV_QPT_UD) return PostSendTranslated(qp, wr, bad);
  CountSignaled(qp, wr, nullptr, +1);
  const int rc = PostChainTranslated(qp, wr, bad);
  if (rc != 0) CountSignaled(qp, *bad, nullptr, -1);
  return rc;
}

int DrainCq(Cq* cq, uint32_t* sends) {
  // What pollers took since the last drain goes first.
  const uint32_t head = cq->pending_head.load();
  if (head > 0) {
    cq->pending.erase(cq->pending.begin(), cq->pending.begin() + head);
    cq->pending_count -= head;
    cq->pending_head.store(0);
  }
  int total = 0;
  ibv_wc batch[32];
  for (;;) {
    const int n = cq->real_poll_cq(cq->real, 32, batch);
    if (n < 0) return n;
    if (n == 0) break;
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = batch[i];
      Qp* qp = VirtualizeWc(cq->qps, &batch[i]);
      if (qp != nullptr) {
        if (wc.wr_id == SendMarkerId(qp)) {
          qp->send_marker_pending = false;
          continue;
        }
        if (wc.wr_id == RecvMarkerId(qp)) {
          qp->recv_marker_seen = true;
          continue;
        }
        // Flushes of a QP the shim moved to the error state are its own:
        // they count its receives still posted (its sends are drained).
        if (qp->flushing && wc.status == IBV_WC_WR_FLUSH_ERR) {
          ++qp->recv_flushes;
          continue;
        }
      }
      if (sends != nullptr && wc.status == IBV_WC_SUCCESS && !(wc.opcode & IBV_WC_RECV)) ++*sends;
      cq->pending.push_back(wc);
      ++total;
    }
  }
  cq->pending_count = static_cast<uint32_t>(cq->pending.size());
  // Held completions are handed out by the translating path.
  if (cq->pending_count > 0) cq->path.SetLongWay();
  return total;
}

void MarkersLate(Cq* cq) {
  cq->markers_late = true;
  cq->marked_base.store(false);
  cq->path.SetLongWay();
}

namespace {

// The slow path of every receive post (a chain, a translation, a pause):
// logged, and translated unless nothing needs it.
int PostRecvAny(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (qp->path.get() == Path::kTranslated) return PostRecvReal(qp, wr, bad);
  ibv_qp* real = qp->real;
  auto post = [qp, real](ibv_recv_wr* w, ibv_recv_wr** b) {
    return qp->real_post_recv(real, w, b);
  };
  return PostRecvLogged(qp->mrs, qp->recvs, wr, bad, post);
}
int PostSrqRecvAny(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (srq->path.get() == Path::kTranslated) return PostSrqRecvReal(srq, wr, bad);
  ibv_srq* real = srq->real;
  auto post = [srq, real](ibv_recv_wr* w, ibv_recv_wr** b) {
    return srq->real_post_srq_recv(real, w, b);
  };
  return PostRecvLogged(srq->mrs, &srq->recvs, wr, bad, post);
}

[[gnu::noinline]] int PostRecvGated(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (qp->pause == nullptr) return PostRecvAny(qp, wr, bad);
  if (!Enter(qp->path)) [[unlikely]]
    return QueueRecvs(qp, wr, bad);
  const int rc = PostRecvAny(qp, wr, bad);
  LeaveFast();
  return rc;
}

[[gnu::noinline]] int PostSrqRecvGated(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (srq->pause == nullptr) return PostSrqRecvAny(srq, wr, bad);
  if (!Enter(srq->path)) [[unlikely]]
    return QueueRecvs(srq, wr, bad);
  const int rc = PostSrqRecvAny(srq, wr, bad);
  LeaveFast();
  return rc;
}

int PostRecv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Qp* qp = AsQp(ibqp);
  int rc;
  if (qp->path.Is(Path::kDirect) && PostOneRecvOn<false>(qp, wr, bad, &rc)) [[likely]]
    return rc;
  // Not migratable: never paused, so translated is all there is to it.
  if (qp->path.Is(Path::kTranslated)) return PostRecvReal(qp, wr, bad);
  return PostRecvGated(qp, wr, bad);
}

// The rest of a migratable process's receive post (a QP's or an SRQ's),
// the mark down: translated inside the mark on a translating queue, else
// the slow path. Out of line, so that the marked path keeps its few
// registers.
template <typename Queue, int (*kReal)(Queue*, ibv_recv_wr*, ibv_recv_wr**),
          int (*kGated)(Queue*, ibv_recv_wr*, ibv_recv_wr**)>
[[gnu::noinline]] int PostRecvNotMarked(Queue* q, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  const Gate gate = EnterGate(q->path);
  if (gate == Gate::kTranslated) [[likely]] {
    const int rc = kReal(q, wr, bad);
    LeaveFast();
    return rc;
  }
  if (gate == Gate::kMarked) LeaveFast();  // a chain, or not one SGE
  return kGated(q, wr, bad);
}

int PostRecvPausable(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Qp* qp = AsQp(ibqp);
  if (EnterMarked(qp->path)) [[likely]] {
    int rc;
    const bool done = PostOneRecvOn<false>(qp, wr, bad, &rc);
    LeaveFast();
    if (done) [[likely]]
      return rc;
  }
  return PostRecvNotMarked<Qp, PostRecvReal, PostRecvGated>(qp, wr, bad);
}

int PostSrqRecv(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Srq* srq = AsSrq(ibsrq);
  int rc;
  if (srq->path.Is(Path::kDirect) && PostOneRecvOn<false>(srq, wr, bad, &rc)) [[likely]]
    return rc;
  if (srq->path.Is(Path::kTranslated)) return PostSrqRecvReal(srq, wr, bad);
  return PostSrqRecvGated(srq, wr, bad);
}

int PostSrqRecvPausable(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Srq* srq = AsSrq(ibsrq);
  if (EnterMarked(srq->path)) [[likely]] {
    int rc;
    const bool done = PostOneRecvOn<false>(srq, wr, bad, &rc);
    LeaveFast();
    if (done) [[likely]]
      return rc;
  }
  return PostRecvNotMarked<Srq, PostSrqRecvReal, PostSrqRecvGated>(srq, wr, bad);
}

// A probed receive on the path its word named (translating with
// kTranslate, else marked): one WR with one SGE by the queue's owner, or
// the queue's first (`claiming`), else the gate.
template <bool kTranslate, typename Queue, int (*kReal)(Queue*, ibv_recv_wr*, ibv_recv_wr**),
          int (*kGated)(Queue*, ibv_recv_wr*, ibv_recv_wr**)>
[[gnu::always_inline]] inline int PostRecvAsOwnerOn(Queue* q, ibv_recv_wr* wr, ibv_recv_wr** bad,
                                                    int (*claiming)(Queue*, ibv_recv_wr*,
                                                                    ibv_recv_wr**, bool)) {
  int rc;
  if (PostOneRecvOn<kTranslate>(q, wr, bad, &rc)) [[likely]]
    return rc;
  if (RecvsOf(q)->unowned()) return claiming(q, wr, bad, kTranslate);
  return PostRecvNotMarked<Queue, kReal, kGated>(q, wr, bad);
}

// The receive entries of a migratable process whose pause probes its
// threads (thread_probe.h): one WR with one SGE is journaled and posted
// without a mark, translated if its queue needs it. The journal takes
// back a WR the provider refuses, so the provider's entry is called, not
// jumped to: a frame of the probed path's section is on the stack until
// the call is over. Anything else (a chain, not exactly one SGE) and a
// pause go through the gate. The queue's fields are read after its path
// word (an acquire): a thread that entered while paused and stalled must
// not call the provider with what it read before a release.
template <typename Queue, int (*kReal)(Queue*, ibv_recv_wr*, ibv_recv_wr**),
          int (*kGated)(Queue*, ibv_recv_wr*, ibv_recv_wr**)>
[[gnu::always_inline]] inline int PostRecvProbedOn(Queue* q, ibv_recv_wr* wr, ibv_recv_wr** bad,
                                                   int (*translated)(Queue*, ibv_recv_wr*,
                                                                     ibv_recv_wr**),
                                                   int (*claiming)(Queue*, ibv_recv_wr*,
                                                                   ibv_recv_wr**, bool)) {
  const uint16_t path = q->path.word();
  if (path == static_cast<uint16_t>(Path::kMarked)) [[likely]]
    return PostRecvAsOwnerOn<false, Queue, kReal, kGated>(q, wr, bad, claiming);
  if (path == static_cast<uint16_t>(Path::kTranslated)) return translated(q, wr, bad);
  return PostRecvNotMarked<Queue, kReal, kGated>(q, wr, bad);
}

// The queue's first receive, on the path the entry found (marked, or
// translating with `translate`): the thread claims the queue and posts as
// its owner, still in the section (the probe counts it inside), so that
// a thread's first receive does not take the gate.
template <typename Queue, int (*kReal)(Queue*, ibv_recv_wr*, ibv_recv_wr**),
          int (*kGated)(Queue*, ibv_recv_wr*, ibv_recv_wr**)>
[[gnu::always_inline]] inline int PostRecvClaimingOn(Queue* q, ibv_recv_wr* wr, ibv_recv_wr** bad,
                                                     bool translate) {
  RecvsOf(q)->Claim();
  int rc;
  if (translate ? PostOneRecvOn<true>(q, wr, bad, &rc) : PostOneRecvOn<false>(q, wr, bad, &rc))
    return rc;
  return PostRecvNotMarked<Queue, kReal, kGated>(q, wr, bad);
}

// PostRecvProbedOn for a context whose queues translate: that path
// compared first and taken here.
template <typename Queue, int (*kReal)(Queue*, ibv_recv_wr*, ibv_recv_wr**),
          int (*kGated)(Queue*, ibv_recv_wr*, ibv_recv_wr**)>
[[gnu::always_inline]] inline int PostRecvProbedTranslatingOn(
    Queue* q, ibv_recv_wr* wr, ibv_recv_wr** bad,
    int (*claiming)(Queue*, ibv_recv_wr*, ibv_recv_wr**, bool)) {
  const uint16_t path = q->path.word();
  if (path == static_cast<uint16_t>(Path::kTranslated)) [[likely]]
    return PostRecvAsOwnerOn<true, Queue, kReal, kGated>(q, wr, bad, claiming);
  if (path == static_cast<uint16_t>(Path::kMarked))
    return PostRecvAsOwnerOn<false, Queue, kReal, kGated>(q, wr, bad, claiming);
  return PostRecvNotMarked<Queue, kReal, kGated>(q, wr, bad);
}

// The entries' out-of-line parts, in the section: a queue's first
// receive, and the translating half of an entry that tests the marked
// path first (out of line, so that the marked path keeps its few
// registers).
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostRecvClaiming(Qp* qp, ibv_recv_wr* wr,
                                                             ibv_recv_wr** bad, bool translate) {
  return PostRecvClaimingOn<Qp, PostRecvReal, PostRecvGated>(qp, wr, bad, translate);
}
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostRecvTranslatedProbed(Qp* qp, ibv_recv_wr* wr,
                                                                     ibv_recv_wr** bad) {
  return PostRecvAsOwnerOn<true, Qp, PostRecvReal, PostRecvGated>(qp, wr, bad, PostRecvClaiming);
}
[[RDMAVIRT_PROBED_PATH]] int PostRecvProbed(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  return PostRecvProbedOn<Qp, PostRecvReal, PostRecvGated>(
      AsQp(ibqp), wr, bad, PostRecvTranslatedProbed, PostRecvClaiming);
}

[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostSrqRecvClaiming(Srq* srq, ibv_recv_wr* wr,
                                                                ibv_recv_wr** bad, bool translate) {
  return PostRecvClaimingOn<Srq, PostSrqRecvReal, PostSrqRecvGated>(srq, wr, bad, translate);
}
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PostSrqRecvTranslatedProbed(Srq* srq, ibv_recv_wr* wr,
                                                                        ibv_recv_wr** bad) {
  return PostRecvAsOwnerOn<true, Srq, PostSrqRecvReal, PostSrqRecvGated>(srq, wr, bad,
                                                                         PostSrqRecvClaiming);
}
[[RDMAVIRT_PROBED_PATH]] int PostSrqRecvProbed(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  return PostRecvProbedOn<Srq, PostSrqRecvReal, PostSrqRecvGated>(
      AsSrq(ibsrq), wr, bad, PostSrqRecvTranslatedProbed, PostSrqRecvClaiming);
}
[[RDMAVIRT_PROBED_PATH]] int PostRecvProbedTranslating(ibv_qp* ibqp, ibv_recv_wr* wr,
                                                       ibv_recv_wr** bad) {
  return PostRecvProbedTranslatingOn<Qp, PostRecvReal, PostRecvGated>(AsQp(ibqp), wr, bad,
                                                                      PostRecvClaiming);
}
[[RDMAVIRT_PROBED_PATH]] int PostSrqRecvProbedTranslating(ibv_srq* ibsrq, ibv_recv_wr* wr,
                                                          ibv_recv_wr** bad) {
  return PostRecvProbedTranslatingOn<Srq, PostSrqRecvReal, PostSrqRecvGated>(AsSrq(ibsrq), wr, bad,
                                                                             PostSrqRecvClaiming);
}

// VirtualizeWc beyond the QPN, out of line: what the drain and a release
// count, an invalidated rkey, a UD sender and its GRH.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] Qp* VirtualizeWcRest(Qp* qp, ibv_wc* wc);

// VirtualizeWc for any completion but the plain one.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] Qp* VirtualizeWcSlow(const QpIndex* qps, ibv_wc* wc) {
  Qp* qp = qps->Find(wc->qp_num);
  if (qp == nullptr) return nullptr;
  wc->qp_num = qp->shadow.qp_base.qp_num;
  if (qp->plain_completions && !(wc->wc_flags & IBV_WC_WITH_INV)) return qp;
  return VirtualizeWcRest(qp, wc);
}

// A completion's qp_num is the local QP's physical number; src_qp (UD) is
// the sender's; a UD receive's GRH holds physical addresses. The common
// case, a QP in its home slot whose completions carry nothing else to
// translate, is one compare (PlainQp: translated, and its QP returned;
// null for any other, untouched).
//
// An invalidated rkey (IBV_WC_WITH_INV) is not looked for there: a
// successful receive carries one only when the peer's SEND_WITH_INV
// invalidated one of this process's rkeys, and only a memory window's
// (type 2) can be invalidated from a peer (rxe and mlx5 refuse it for a
// registered region: the receive completes in error, without flags).
// The shim refuses ibv_alloc_mw (AllocMwUnsupported): if it ever takes
// memory windows, QPs whose PD has one must not be plain.
[[gnu::always_inline]] inline Qp* PlainQp(const std::atomic<Qp*>* home, ibv_wc* wc) {
  const uint32_t pqpn = wc->qp_num;
  Qp* qp = QpIndex::HomeIn(home, pqpn);
  if (qp->plain_qpn != pqpn) [[unlikely]]
    return nullptr;
  wc->qp_num = qp->shadow.qp_base.qp_num;
  return qp;
}
inline Qp* VirtualizeWc(const QpIndex* qps, ibv_wc* wc) {
  if (Qp* qp = PlainQp(qps->home_slots(), wc)) [[likely]]
    return qp;
  return VirtualizeWcSlow(qps, wc);
}

Qp* VirtualizeWcRest(Qp* qp, ibv_wc* wc) {
  if (wc->status != IBV_WC_SUCCESS) return qp;
  // What a drain and a release count on (migration/release.cc): an SRQ's
  // receives, a UD QP's sends.
  if (wc->opcode & IBV_WC_RECV) {
    if (qp->srq != nullptr) qp->srq->recvs_done.fetch_add(1, std::memory_order_relaxed);
  } else if (qp->shadow.qp_base.qp_type == IBV_QPT_UD) {
    qp->sends_done.fetch_add(1, std::memory_order_relaxed);
  }
  if (wc->wc_flags & IBV_WC_WITH_INV)
    wc->invalidated_rkey = qp->mode.VirtualRkey(wc->invalidated_rkey);
  // Only a UD receive names a sender and may carry a GRH; a send's
  // completion must not take a receive's record (their wr_ids may be
  // equal).
  if (qp->shadow.qp_base.qp_type != IBV_QPT_UD || !(wc->opcode & IBV_WC_RECV)) return qp;
  // A sender that moved is known by where it is now (the GRH's source).
  RecvLog::Taken e;
  const bool found = qp->recvs->Consume(wc->wr_id, &e);
  const Shim* shim = qp->ctx->shim;
  const RemoteEndpoint* from = nullptr;
  ibv_gid source;
  const bool has_grh = wc->wc_flags & IBV_WC_GRH;
  if (has_grh && !found)
    LogOnce(
        "a UD receive's buffer was not found in the receive journal: its GRH and sender are "
        "shown as the device wrote them");
  const bool grh = has_grh && found;
  if (grh && ReadGrhSource(e.sge, e.num_sge, &source)) from = shim->RemoteAt(source, wc->src_qp);
  wc->src_qp = from != nullptr ? from->VirtualQpn(wc->src_qp) : qp->mode.VirtualQpn(wc->src_qp);
  if (grh)
    RewriteGrhInSges(e.sge, e.num_sge,
                     [shim, from](const ibv_gid& g) { return shim->VirtualizeGid(g, from); });
  return qp;
}

// Hands out completions a pause moved into the shadow CQ, oldest first.
inline int TakePending(Cq* cq, int n, ibv_wc* wc) {
  uint32_t head = cq->pending_head.load(std::memory_order_acquire);
  if (head >= cq->pending_count) [[likely]]
    return 0;
  uint32_t take;
  do {
    take = cq->pending_count - head;
    if (take > static_cast<uint32_t>(n)) take = static_cast<uint32_t>(n);
    if (take == 0) return 0;
  } while (!cq->pending_head.compare_exchange_weak(head, head + take));
  for (uint32_t i = 0; i < take; ++i) wc[i] = cq->pending[head + i];
  return static_cast<int>(take);
}

// Once the completions a pause held are handed out, a CQ that needs no
// translation leaves the translating path again (not while paused: the
// exchange fails). The control thread may make it translate for good
// meanwhile (a UD QP on it, say): it clears `marked_base` before it sets
// `path`, so a poller that finds it cleared after its exchange puts
// `path` back.
void BackToMarked(Cq* cq) {
  if (!cq->marked_base.load() || cq->pending_head.load() < cq->pending_count) return;
  if (cq->path.EndLongWay(Path::kMarked) && !cq->marked_base.load())
    cq->path.Set(Path::kTranslated);
}

// Translates wc[from, end) and takes out a drain's markers that completed
// after the drain gave up (Cq::markers_late): they are the shim's. The
// count kept.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int VirtualizeDroppingMarkers(const QpIndex* qps,
                                                                      ibv_wc* wc, int from,
                                                                      int end) {
  int kept = from;
  for (int i = from; i < end; ++i) {
    const Qp* qp = VirtualizeWc(qps, &wc[i]);
    if (qp != nullptr && IsMarker(qp, wc[i].wr_id)) continue;
    if (kept != i) wc[kept] = wc[i];
    ++kept;
  }
  return kept;
}

// Polls the real CQ after the held completions, translating; a CQ that
// holds completions from a pause, has markers to drop, or may go back to
// the marked path takes the long way.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PollTranslatedSlow(Cq* cq, int n, ibv_wc* wc) {
  int got = TakePending(cq, n, wc);
  if (got < n) {
    const int more = cq->real_poll_cq(cq->real, n - got, wc + got);
    if (more < 0) return got > 0 ? got : more;
    got = VirtualizeDroppingMarkers(cq->qps, wc, got, got + more);
  }
  if (cq->marked_base.load(std::memory_order_relaxed)) BackToMarked(cq);
  // Nothing left for the long way: no pause can set any of it while this
  // thread polls (it is inside its mark, or its process is not
  // migratable and never paused).
  if (cq->pending_head.load(std::memory_order_acquire) >= cq->pending_count && !cq->markers_late &&
      !cq->marked_base.load(std::memory_order_relaxed))
    cq->path.EndLongWay(Path::kTranslated);
  return got;
}

// A poll that returned several completions: all of them translated.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int VirtualizeAll(const Cq* cq, ibv_wc* wc, int got) {
  for (int i = 0; i < got; ++i) VirtualizeWc(cq->qps, &wc[i]);
  return got;
}

// Polls the real CQ and translates. One completion, the common case, is
// translated here (VirtualizeWc's common case, through the CQ's copy of
// the home slots): only the CQ and `wc` are kept across the call.
[[gnu::always_inline]] inline int PollAndVirtualize(Cq* cq, int n, ibv_wc* wc) {
  const int got = cq->real_poll_cq(cq->real, n, wc);
  if (got != 1) [[unlikely]]
    return got > 1 ? VirtualizeAll(cq, wc, got) : got;
  if (PlainQp(cq->qp_home, wc) != nullptr) [[likely]]
    return 1;
  return VirtualizeAll(cq, wc, 1);
}

// A poll on the translating path whose word was not compared with
// kTranslated's, which excludes the long way (the gated entries).
[[gnu::always_inline]] inline int PollTranslated(Cq* cq, int n, ibv_wc* wc) {
  if (cq->path.long_way()) [[unlikely]]
    return PollTranslatedSlow(cq, n, wc);
  return PollAndVirtualize(cq, n, wc);
}

// The translating path of a process the migrator cannot move (PollCq
// took the long way already if it had to).
[[gnu::noinline]] int PollTranslatedOut(Cq* cq, int n, ibv_wc* wc) {
  return PollAndVirtualize(cq, n, wc);
}

// A poll that found its process paused (below).
[[gnu::noinline]] int PollCqPaused(Cq* cq, int n, ibv_wc* wc);

[[gnu::noinline]] int PollCqGated(Cq* cq, int n, ibv_wc* wc) {
  if (!Enter(cq->path)) [[unlikely]]
    return PollCqPaused(cq, n, wc);
  const int got = PollTranslated(cq, n, wc);
  LeaveFast();
  return got;
}

int PollCqPaused(Cq* cq, int n, ibv_wc* wc) {
  // The application sees no new completion, and its thread may run a
  // migration step (Shim::OnAppThread). If that step was the resume, this
  // poll goes on: an event-driven program polls once per event, and a
  // completion must not wait for the next one.
  cq->ctx->shim->RunPendingStep();
  if (!Enter(cq->path)) return 0;
  const int got = PollTranslated(cq, n, wc);
  LeaveFast();
  return got;
}

int PollCq(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = AsCq(ibcq);
  if (cq->path.Is(Path::kDirect)) [[likely]]
    return cq->real_poll_cq(cq->real, n, wc);
  if (cq->path.long_way()) [[unlikely]]
    return PollTranslatedSlow(cq, n, wc);
  return PollTranslatedOut(cq, n, wc);
}

// The same in offset mode, where every CQ translates: that path compared
// first (its word exactly kTranslated's: no long way).
int PollCqTranslatingFirst(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = AsCq(ibcq);
  if (cq->path.Is(Path::kTranslated)) [[likely]]
    return PollAndVirtualize(cq, n, wc);
  return PollCq(ibcq, n, wc);
}

// As PostSendInMark. The gate compared the word with kTranslated's: no
// long way.
[[gnu::noinline]] int PollCqInMark(Cq* cq, int n, ibv_wc* wc) {
  const int got = PollAndVirtualize(cq, n, wc);
  LeaveFast();
  return got;
}

int PollCqPausable(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = AsCq(ibcq);
  const Gate gate = EnterGate(cq->path);
  if (gate == Gate::kMarked) [[likely]] {
    const int got = cq->real_poll_cq(cq->real, n, wc);
    LeaveFast();
    return got;
  }
  if (gate == Gate::kTranslated) return PollCqInMark(cq, n, wc);
  return PollCqGated(cq, n, wc);
}

// Out of line (the marked path keeps no register), and in the section:
// its frame stays while the completions are translated. Its word was
// kTranslated's: no long way.
[[gnu::noinline, RDMAVIRT_PROBED_PATH]] int PollCqTranslatedProbed(Cq* cq, int n, ibv_wc* wc) {
  return PollAndVirtualize(cq, n, wc);
}
[[RDMAVIRT_PROBED_PATH]] int PollCqProbed(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = AsCq(ibcq);
  const uint16_t path = cq->path.word();
  if (path == static_cast<uint16_t>(Path::kMarked)) [[likely]]
    return cq->real_poll_cq(cq->real, n, wc);
  if (path == static_cast<uint16_t>(Path::kTranslated)) [[likely]]
    return PollCqTranslatedProbed(cq, n, wc);
  return PollCqGated(cq, n, wc);  // paused, or the long way
}
// The same, for a context whose queues translate: that path compared
// first and translated here (the marked path keeps the frame it needs).
[[RDMAVIRT_PROBED_PATH]] int PollCqProbedTranslating(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = AsCq(ibcq);
  const uint16_t path = cq->path.word();
  if (path == static_cast<uint16_t>(Path::kTranslated)) [[likely]]
    return PollAndVirtualize(cq, n, wc);
  if (path == static_cast<uint16_t>(Path::kMarked)) return cq->real_poll_cq(cq->real, n, wc);
  return PollCqGated(cq, n, wc);
}

// Arms the real CQ. A CQ that may be paused also remembers that the
// application waits for an event: during a pause (the real CQ may be
// gone) only that, and the resume arms the real CQ or owes the event
// (Shim::OweEvents). Others pay nothing for it.
int ReqNotifyCq(ibv_cq* ibcq, int solicited_only) {
  Cq* cq = AsCq(ibcq);
  if (cq->pause == nullptr) {
    ibv_cq* real = cq->real;
    return real->context->ops.req_notify_cq(real, solicited_only);
  }
  cq->armed.store(true, std::memory_order_relaxed);
  if (!Enter(cq->path)) return 0;
  ibv_cq* real = cq->real;
  const int rc = real->context->ops.req_notify_cq(real, solicited_only);
  LeaveFast();
  return rc;
}

// ---------------------------------------------------------------- ibv_qp_ex

// Providers read wr_id and wr_flags from their own ibv_qp_ex in every
// builder: copy the application's values there first.
inline ibv_qp_ex* Sync(ibv_qp_ex* q) {
  Qp* qp = AsQp(q);
  ibv_qp_ex* real = qp->real_ex;
  real->wr_id = q->wr_id;
  real->wr_flags = q->wr_flags;
  if (qp->init.sq_sig_all || (q->wr_flags & IBV_SEND_SIGNALED)) ++qp->builder_signaled;
  return real;
}
inline uint32_t Rkey(ibv_qp_ex* q, uint32_t rkey) { return PeerRkey(AsQp(q), rkey); }

// A batch of ibv_wr_* keeps the thread's mark raised from wr_start to
// wr_complete or wr_abort. Builder calls cannot be queued, so during a
// pause wr_start waits for its end: to the application, a pause.
void WrStart(ibv_qp_ex* q) {
  Qp* qp = AsQp(q);
  if (qp->pause != nullptr) {
    while (!EnterBatch(qp->path)) {
      qp->ctx->shim->RunPendingStep();
      usleep(1000);
    }
    qp->in_batch = true;
  }
  qp->builder_signaled = 0;
  qp->real_ex->wr_start(qp->real_ex);
}
void EndBatch(Qp* qp) {
  if (!qp->in_batch) return;
  qp->in_batch = false;
  LeaveBatch();
}
int WrComplete(ibv_qp_ex* q) {
  Qp* qp = AsQp(q);
  // A UD QP's signaled sends are counted for the drain (RC and UC take a marker).
  const uint64_t signaled = qp->shadow.qp_base.qp_type == IBV_QPT_UD ? qp->builder_signaled : 0;
  qp->signaled_posted.fetch_add(signaled, std::memory_order_relaxed);
  const int rc = qp->real_ex->wr_complete(qp->real_ex);
  if (rc != 0) qp->signaled_posted.fetch_sub(signaled, std::memory_order_relaxed);
  EndBatch(qp);
  return rc;
}
void WrAbort(ibv_qp_ex* q) {
  Qp* qp = AsQp(q);
  qp->real_ex->wr_abort(qp->real_ex);
  EndBatch(qp);
}
void WrSend(ibv_qp_ex* q) {
  ibv_qp_ex* real = Sync(q);
  real->wr_send(real);
}
void WrSendImm(ibv_qp_ex* q, __be32 imm) {
  ibv_qp_ex* real = Sync(q);
  real->wr_send_imm(real, imm);
}
void WrSendInv(ibv_qp_ex* q, uint32_t rkey) {
  ibv_qp_ex* real = Sync(q);
  real->wr_send_inv(real, Rkey(q, rkey));
}
void WrRdmaWrite(ibv_qp_ex* q, uint32_t rkey, uint64_t addr) {
  ibv_qp_ex* real = Sync(q);
  real->wr_rdma_write(real, Rkey(q, rkey), addr);
}
void WrRdmaWriteImm(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, __be32 imm) {
  ibv_qp_ex* real = Sync(q);
  real->wr_rdma_write_imm(real, Rkey(q, rkey), addr, imm);
}
void WrRdmaRead(ibv_qp_ex* q, uint32_t rkey, uint64_t addr) {
  ibv_qp_ex* real = Sync(q);
  real->wr_rdma_read(real, Rkey(q, rkey), addr);
}
void WrAtomicCmpSwp(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, uint64_t compare, uint64_t swap) {
  ibv_qp_ex* real = Sync(q);
  real->wr_atomic_cmp_swp(real, Rkey(q, rkey), addr, compare, swap);
}
void WrAtomicFetchAdd(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, uint64_t add) {
  ibv_qp_ex* real = Sync(q);
  real->wr_atomic_fetch_add(real, Rkey(q, rkey), addr, add);
}
void WrAtomicWrite(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, const void* data) {
  ibv_qp_ex* real = Sync(q);
  real->wr_atomic_write(real, Rkey(q, rkey), addr, data);
}
void WrLocalInv(ibv_qp_ex* q, uint32_t rkey) {
  ibv_qp_ex* real = Sync(q);
  real->wr_local_inv(real, Rkey(q, rkey));
}
void WrSetUdAddr(ibv_qp_ex* q, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  ibv_qp_ex* real = AsQp(q)->real_ex;
  const Ah* a = reinterpret_cast<Ah*>(ah);
  const AhRoute* route = UdRoute(a, remote_qpn);
  real->wr_set_ud_addr(real, route != nullptr ? route->real : a->real,
                       UdPeerQpn(AsQp(q), route, remote_qpn), remote_qkey);
}
void WrSetInlineData(ibv_qp_ex* q, void* addr, size_t length) {
  ibv_qp_ex* real = AsQp(q)->real_ex;
  real->wr_set_inline_data(real, addr, length);
}
void WrSetInlineDataList(ibv_qp_ex* q, size_t n, const ibv_data_buf* list) {
  ibv_qp_ex* real = AsQp(q)->real_ex;
  real->wr_set_inline_data_list(real, n, list);
}
void WrSetSge(ibv_qp_ex* q, uint32_t lkey, uint64_t addr, uint32_t length) {
  Qp* qp = AsQp(q);
  qp->real_ex->wr_set_sge(qp->real_ex, qp->mrs.ToPhysical(lkey), addr, length);
}
void WrSetSgeList(ibv_qp_ex* q, size_t n, const ibv_sge* list) {
  Qp* qp = AsQp(q);
  constexpr size_t kMax = 64;  // beyond any HCA's max_send_sge
  ibv_sge copy[kMax];
  const size_t m = n < kMax ? n : kMax;
  for (size_t i = 0; i < m; ++i) {
    copy[i] = list[i];
    copy[i].lkey = qp->mrs.ToPhysical(list[i].lkey);
  }
  // A longer list than any HCA takes goes through as it is; the provider refuses it.
  qp->real_ex->wr_set_sge_list(qp->real_ex, n, n <= kMax ? copy : list);
}

// ---------------------------------------------------------------- ibv_cq_ex

inline void CopyCursor(ibv_cq_ex* shadow, const ibv_cq_ex* real) {
  shadow->wr_id = real->wr_id;
  shadow->status = real->status;
}

// The next completion a pause left in the shadow CQ, as the batch's
// cursor; false when there is none.
inline bool HeldCursor(Cq* cq, ibv_cq_ex* c) {
  if (TakePending(cq, 1, &cq->cursor) != 1) return false;
  cq->cursor_held = true;
  c->wr_id = cq->cursor.wr_id;
  c->status = cq->cursor.status;
  return true;
}

// Steps over a drain's markers that came after the drain gave up.
inline int SkipLateMarkers(Cq* cq, ibv_cq_ex* real, int rc) {
  while (rc == 0 && cq->markers_late) {
    const Qp* qp = cq->qps->Find(real->read_qp_num(real));
    if (qp == nullptr || !IsMarker(qp, real->wr_id)) break;
    rc = real->next_poll(real);
  }
  return rc;
}

// The real CQ's side of a batch.
inline int RealStartPoll(Cq* cq, ibv_cq_ex* c, ibv_poll_cq_attr* attr) {
  cq->cursor_held = false;
  ibv_cq_ex* real = cq->real_ex;
  int rc = real->start_poll(real, attr);
  if (rc == 0) {
    rc = SkipLateMarkers(cq, real, rc);
    if (rc != 0) real->end_poll(real);  // only markers: the batch found nothing
  }
  cq->real_batch = rc == 0;
  if (rc == 0) CopyCursor(c, real);
  return rc;
}

inline void EndBatch(Cq* cq) {
  if (cq->pause != nullptr) LeaveBatch();
}

// A polling batch keeps the thread's mark raised from start_poll to
// end_poll (or to a start_poll that finds nothing). During a pause it
// finds nothing; after one, the completions the pause held come first,
// each once.
int StartPoll(ibv_cq_ex* c, ibv_poll_cq_attr* attr) {
  Cq* cq = AsCq(c);
  if (cq->pause != nullptr && !EnterBatch(cq->path)) {
    cq->ctx->shim->RunPendingStep();
    return ENOENT;
  }
  cq->real_batch = false;
  if (HeldCursor(cq, c)) return 0;
  const int rc = RealStartPoll(cq, c, attr);
  if (rc != 0) EndBatch(cq);
  return rc;
}
int NextPoll(ibv_cq_ex* c) {
  Cq* cq = AsCq(c);
  if (cq->cursor_held) {
    if (HeldCursor(cq, c)) return 0;
    ibv_poll_cq_attr attr{};
    return RealStartPoll(cq, c, &attr);
  }
  ibv_cq_ex* real = cq->real_ex;
  const int rc = SkipLateMarkers(cq, real, real->next_poll(real));
  if (rc == 0) CopyCursor(c, real);
  return rc;
}
void EndPoll(ibv_cq_ex* c) {
  Cq* cq = AsCq(c);
  if (cq->real_batch) cq->real_ex->end_poll(cq->real_ex);
  cq->real_batch = false;
  cq->cursor_held = false;
  EndBatch(cq);
}
// Held completions were virtualized when the pause took them in.
uint32_t ReadQpNum(ibv_cq_ex* c) {
  Cq* cq = AsCq(c);
  if (cq->cursor_held) return cq->cursor.qp_num;
  const uint32_t pqpn = cq->real_ex->read_qp_num(cq->real_ex);
  const Qp* qp = cq->qps->Find(pqpn);
  return qp != nullptr ? qp->shadow.qp_base.qp_num : pqpn;
}
// src_qp is the sender's QPN on UD only (RC reports 0 or garbage).
uint32_t ReadSrcQp(ibv_cq_ex* c) {
  Cq* cq = AsCq(c);
  if (cq->cursor_held) return cq->cursor.src_qp;
  ibv_cq_ex* real = cq->real_ex;
  const uint32_t src = real->read_src_qp(real);
  const Qp* qp = real->read_qp_num ? cq->qps->Find(real->read_qp_num(real)) : nullptr;
  return qp != nullptr && qp->shadow.qp_base.qp_type == IBV_QPT_UD ? qp->mode.VirtualQpn(src) : src;
}

// The other readers carry no identity: from the held completion, or
// forwarded to the real CQ. (ibv_wc has no timestamps, VLAN or flow tag:
// a held completion reads 0 for them.)
#define RDMAVIRT_FORWARD_READ(name, type, held) \
  type name(ibv_cq_ex* c) {                     \
    Cq* cq = AsCq(c);                           \
    if (cq->cursor_held) return held;           \
    ibv_cq_ex* real = cq->real_ex;              \
    return real->name(real);                    \
  }
RDMAVIRT_FORWARD_READ(read_opcode, ibv_wc_opcode, cq->cursor.opcode)
RDMAVIRT_FORWARD_READ(read_vendor_err, uint32_t, cq->cursor.vendor_err)
RDMAVIRT_FORWARD_READ(read_byte_len, uint32_t, cq->cursor.byte_len)
RDMAVIRT_FORWARD_READ(read_imm_data, __be32, cq->cursor.imm_data)
RDMAVIRT_FORWARD_READ(read_wc_flags, unsigned int, cq->cursor.wc_flags)
RDMAVIRT_FORWARD_READ(read_slid, uint32_t, cq->cursor.slid)
RDMAVIRT_FORWARD_READ(read_sl, uint8_t, cq->cursor.sl)
RDMAVIRT_FORWARD_READ(read_dlid_path_bits, uint8_t, cq->cursor.dlid_path_bits)
RDMAVIRT_FORWARD_READ(read_completion_ts, uint64_t, 0)
RDMAVIRT_FORWARD_READ(read_completion_wallclock_ns, uint64_t, 0)
RDMAVIRT_FORWARD_READ(read_cvlan, uint16_t, 0)
RDMAVIRT_FORWARD_READ(read_flow_tag, uint32_t, 0)
#undef RDMAVIRT_FORWARD_READ

}  // namespace

// Constant-initialized: a library's constructor may open a device before
// this one's run.
constinit const PostPollEntries kDirectEntries = {PostSend, PostRecv, PostSrqRecv, PollCq};
constinit const PostPollEntries kPausableEntries = {PostSendPausable, PostRecvPausable,
                                                    PostSrqRecvPausable, PollCqPausable};
constinit const PostPollEntries kProbedEntries = {PostSendProbed, PostRecvProbed, PostSrqRecvProbed,
                                                  PollCqProbed};
constinit const PostPollEntries kProbedTranslatingEntries = {
    PostSendProbedTranslating, PostRecvProbedTranslating, PostSrqRecvProbedTranslating,
    PollCqProbedTranslating};
constinit const PostPollEntries kTranslatingFirstEntries = {PostSendTranslatingFirst, PostRecv,
                                                            PostSrqRecv, PollCqTranslatingFirst};
int (*const kReqNotifyCq)(ibv_cq*, int) = ReqNotifyCq;

#define RDMAVIRT_ENTRY(field, fn) e.field = fn;
constinit const ibv_qp_ex kQpExEntries = [] {
  ibv_qp_ex e{};
  RDMAVIRT_QP_EX_ENTRIES(RDMAVIRT_ENTRY)
  return e;
}();
constinit const ibv_cq_ex kCqExEntries = [] {
  ibv_cq_ex e{};
  RDMAVIRT_CQ_EX_ENTRIES(RDMAVIRT_ENTRY)
  return e;
}();
#undef RDMAVIRT_ENTRY

namespace {

// The table of a QP's single sends on the translating path, by its type
// and its peer (non-null: where a moved peer is now).
const PostOneFn* SendTable(const Qp* qp, const RemoteEndpoint* remote, bool probed) {
  if (qp->shadow.qp_base.qp_type == IBV_QPT_UD)
    return probed ? kPostOneGate.data() : kPostOneDatagram.data();
  return remote != nullptr ? kPostOneConnected<true>.data() : kPostOneConnected<false>.data();
}

// The translating table, and the probed entries' table after it.
void InstallSendTable(Qp* qp, const PostOneFn* table) {
  qp->post_one.store(table, std::memory_order_release);
  PublishSendPath(qp);
}

}  // namespace

void PublishSendPath(Qp* qp) {
  const uint16_t path = qp->path.word();
  // kDirect: a process the migrator cannot move, never paused.
  const bool provider =
      path == static_cast<uint16_t>(Path::kMarked) || path == static_cast<uint16_t>(Path::kDirect);
  const PostOneFn* table = path == static_cast<uint16_t>(Path::kTranslated)
                               ? qp->post_one.load(std::memory_order_relaxed)
                           : provider ? kPostOneProvider.data()
                                      : kPostOneGate.data();
  qp->post_probed.store(table, std::memory_order_release);
}

void SetQpPath(Qp* qp, Path path) {
  qp->path.Set(path);
  PublishSendPath(qp);
}

void SetQpPaused(Qp* qp, bool paused) {
  qp->path.SetPaused(paused);
  PublishSendPath(qp);
}

void SetPeer(Qp* qp, const RemoteEndpoint* remote, bool probed) {
  // A post that sees a peer must find the table that looks it up, which
  // is right without one too: that table before the peer, the other after
  // the peer is cleared.
  if (remote != nullptr) InstallSendTable(qp, SendTable(qp, remote, probed));
  qp->remote.store(remote, std::memory_order_release);
  if (remote == nullptr) InstallSendTable(qp, SendTable(qp, nullptr, probed));
}

void InstallSendPath(Qp* qp, bool probed) {
  InstallSendTable(qp, SendTable(qp, qp->remote.load(std::memory_order_relaxed), probed));
}

}  // namespace rdmavirt::shim
