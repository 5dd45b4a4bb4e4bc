// The release half of a migration: the quiesce (pause, then drain every
// send in flight), and the release (count the receives still posted,
// destroy every hardware resource, mark the registered pages). See
// release.h for what it owns and shim.h for each step's contract.
//
// Every step runs on the control thread, or on an application thread the
// control gate hands it to (control_gate.h), with the shim's mutex held,
// so the application's control verbs wait for it; the application's posts
// and polls do not take that mutex: they meet the steps at each object's
// gate (pause.h).
#include "shim/migration/release.h"

#include <fcntl.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "shim/core/log.h"
#include "shim/datapath/data_path.h"
#include "shim/datapath/thread_probe.h"
#include "shim/migration/dirty_pages.h"
#include "shim/migration/epoll_regs.h"
#include "shim/migration/step_util.h"

namespace rdmavirt::shim {

namespace {

uint64_t NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
}

const char* QpStateName(int state) {
  switch (state) {
    case IBV_QPS_RESET:
      return "RESET";
    case IBV_QPS_INIT:
      return "INIT";
    case IBV_QPS_RTR:
      return "RTR";
    case IBV_QPS_RTS:
      return "RTS";
    case IBV_QPS_SQD:
      return "SQD";
    case IBV_QPS_SQE:
      return "SQE";
    case IBV_QPS_ERR:
      return "ERR";
    default:
      return "unknown";
  }
}

// Receives posted to a queue and not yet completed: the last ones logged.
uint32_t Outstanding(const RecvLog& log, const std::atomic<uint64_t>& done) {
  return static_cast<uint32_t>(log.posted() - done.load(std::memory_order_relaxed));
}

std::vector<QueuedRecv> Copy(const std::vector<const RecvLog::Entry*>& entries) {
  std::vector<QueuedRecv> out;
  out.reserve(entries.size());
  for (const RecvLog::Entry* e : entries)
    out.push_back({e->wr_id, std::vector<ibv_sge>(e->sge, e->sge + e->num_sge)});
  return out;
}

// Takes out the receives still posted to a queue, oldest first, to be
// posted again: counted as done (Repost logs them anew) and no longer
// looked up by the completion path in their old records.
std::vector<QueuedRecv> TakeOutstanding(RecvLog* log, std::atomic<uint64_t>* done) {
  std::vector<QueuedRecv> out = Copy(log->Recent(Outstanding(*log, *done)));
  done->fetch_add(out.size());
  log->ConsumeAll();
  return out;
}

// The file status flags of an fd about to be closed (0 if unknown).
int StatusFlags(int fd) {
  const int flags = fd >= 0 ? fcntl(fd, F_GETFL) : -1;
  return flags < 0 ? 0 : flags;
}

// Moves what every CQ holds into its shadow CQ, adding the successful
// sends to `*sends`.
Status DrainCqs(const std::vector<Cq*>& cqs, uint32_t* sends) {
  for (Cq* cq : cqs) {
    const int rc = DrainCq(cq, sends);
    if (rc < 0) return Error(Code::kInternal, Errno("polling a CQ during the drain", -rc));
  }
  return {};
}

// Whether a drain `toward` a peer (nullptr: every peer) drains `qp`.
bool DrainsToward(const Qp* qp, const ibv_gid* toward) {
  return toward == nullptr || memcmp(qp->remote_gid.raw, toward->raw, 16) == 0;
}

// Polls the QPs' CQs until each QP's last flush is in (its marker receive,
// or as many flushes as its full queue held), 5 s at most.
void AwaitRecvFlushes(const std::vector<Qp*>& qps) {
  const uint64_t deadline = NowUs() + 5000000;
  for (;;) {
    std::vector<Cq*> cqs;
    for (Qp* qp : qps) {
      if (qp->recv_cq != nullptr && std::find(cqs.begin(), cqs.end(), qp->recv_cq) == cqs.end())
        cqs.push_back(qp->recv_cq);
      if (qp->send_cq != nullptr && std::find(cqs.begin(), cqs.end(), qp->send_cq) == cqs.end())
        cqs.push_back(qp->send_cq);
    }
    for (Cq* cq : cqs) DrainCq(cq, nullptr);
    bool all = true;
    for (Qp* qp : qps) {
      if (!qp->recv_marker_seen && qp->recv_flushes_expected != 0 &&
          qp->recv_flushes >= qp->recv_flushes_expected)
        qp->recv_marker_seen = true;
      all &= qp->recv_marker_seen;
    }
    if (all) break;
    if (NowUs() > deadline) {
      LogOnce("flushes of posted receives did not all come within 5 s; counted what came");
      break;
    }
    usleep(200);
  }
}

// Each QP's receives still posted, from its flushes: the last ones logged.
void TakeFlushedRecvs(const std::vector<Qp*>& qps) {
  for (Qp* qp : qps) {
    qp->flushing = false;
    qp->recv_flushes_expected = 0;
    if (qp->srq != nullptr) continue;
    // The receives still posted are the last ones logged.
    qp->outstanding = Copy(qp->own_recvs.Recent(qp->recv_flushes));
    qp->own_recvs.ConsumeAll();
    if (LogMoves()) {
      char line[200];
      snprintf(line, sizeof line, "release: QP 0x%x (%s): %u receives still posted%s",
               qp->shadow.qp_base.qp_num, QpTypeName(qp->shadow.qp_base.qp_type), qp->recv_flushes,
               qp->recv_marker_seen ? "" : ", not all flushes came");
      Log(line);
    }
  }
}

}  // namespace

// The QPs of one send CQ a drain posts markers on: those still to get
// one, and those whose marker is outstanding.
struct DrainMarkers {
  Cq* cq;
  std::vector<Qp*> waiting;
  std::vector<Qp*> outstanding;
};

namespace {

// The RC and UC QPs whose sends a marker drains, by send CQ in order.
std::vector<DrainMarkers> QpsToMark(const std::vector<Qp*>& qps, const ibv_gid* toward) {
  std::vector<DrainMarkers> markers;
  for (Qp* qp : qps) {
    qp->send_marker_pending = false;
    if (qp->real == nullptr || qp->shadow.qp_base.qp_type == IBV_QPT_UD || qp->drained) continue;
    if (!DrainsToward(qp, toward)) continue;
    // A QP never brought to RTS has sent nothing (and refuses the post);
    // one in the error state completes the marker at once, flushed.
    if (qp->shadow.qp_base.state != IBV_QPS_RTS && qp->shadow.qp_base.state != IBV_QPS_SQD)
      continue;
    auto it = std::find_if(markers.begin(), markers.end(),
                           [qp](const DrainMarkers& m) { return m.cq == qp->send_cq; });
    if (it == markers.end()) {
      markers.push_back({qp->send_cq, {}, {}});
      it = markers.end() - 1;
    }
    it->waiting.push_back(qp);
  }
  return markers;
}

void MarkDrained(const std::vector<Qp*>& qps, const ibv_gid* toward) {
  for (Qp* qp : qps)
    if (qp->shadow.qp_base.qp_type != IBV_QPT_UD && DrainsToward(qp, toward)) qp->drained = true;
}

// A marker that completes after the drain gave up is the shim's: its CQ
// translates from now on, and the translating path drops it.
void LeaveLateMarkers(const std::vector<Qp*>& qps) {
  for (const Qp* qp : qps) {
    if (!qp->send_marker_pending || qp->send_cq == nullptr) continue;
    MarkersLate(qp->send_cq);
  }
}

}  // namespace

void Shim::SetPaused(bool paused) {
  for (const auto& [p, k] : Shadows()) {
    void* o = const_cast<void*>(p);
    if (k == Kind::kQp) SetQpPaused(static_cast<Qp*>(o), paused);
    if (k == Kind::kCq) static_cast<Cq*>(o)->path.SetPaused(paused);
    if (k == Kind::kSrq) static_cast<Srq*>(o)->path.SetPaused(paused);
  }
}

std::vector<const void*> Shim::ProviderEntries() const {
  std::vector<const void*> entries;
  for (const auto& [p, k] : Shadows()) {
    if (k != Kind::kContext) continue;
    const ibv_context* real = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)))->real;
    if (real == nullptr) continue;  // released
    entries.push_back(reinterpret_cast<const void*>(real->ops.post_send));
    entries.push_back(reinterpret_cast<const void*>(real->ops.poll_cq));
  }
  return entries;
}

bool Shim::PostSendMarker(Qp* qp, std::string* why) {
  ibv_send_wr wr{};
  wr.wr_id = SendMarkerId(qp);
  wr.opcode = IBV_WR_RDMA_WRITE;  // zero bytes: no rkey is checked (IBTA C9-88)
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  const int rc = qp->real_post_send(qp->real, &wr, &bad);
  if (rc == 0) {
    qp->send_marker_pending = true;
    return true;
  }
  if (rc == EINVAL) return true;  // not in a state that sends: nothing in flight
  if (rc != ENOMEM && why->empty()) *why = Errno("posting a drain marker", rc);
  return false;
}

Status Shim::Quiesce(uint32_t drain_timeout_ms, uint32_t* drained_sends, const ibv_gid* toward) {
  *drained_sends = 0;
  {
    MutexLock lock(&mu_);
    if (!migratable_)
      return Error(Code::kFailedPrecondition,
                   "the process started without a migrator: its queues take the fast path and "
                   "cannot be paused");
    if (released_) return Error(Code::kFailedPrecondition, "the endpoint is released");
    GuessEndpointGid();
    SetPaused(true);
    std::string why;
    // One deadline for both halves of the pause.
    const auto start = std::chrono::steady_clock::now();
    const auto left_ms = [&] {
      const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - start);
      return static_cast<uint32_t>(
          std::max<int64_t>(0, int64_t{drain_timeout_ms} - int64_t{spent.count()}));
    };
    if (!pause_.Close(drain_timeout_ms, &why) ||
        (probed_ && !WaitOutsideProviders(ProviderEntries(), left_ms(), &why))) {
      if (pause_.closed()) pause_.Open();
      SetPaused(false);
      return Error(Code::kDeadlineExceeded, "pausing the data path: " + why);
    }
    paused_ = true;
  }
  // The drain posts markers: after a CRIU restore only an application
  // thread may (OnAppThread), and they are all paused now.
  // The step owns what it uses (OnAppThread may stop waiting for it).
  std::optional<ibv_gid> peer;
  if (toward != nullptr) peer = *toward;
  auto count = std::make_shared<uint32_t>(0);
  Status st = OnAppThread(
      "drain",
      [this, drain_timeout_ms, peer, count] {
        return DrainNow(drain_timeout_ms, count.get(), peer ? &*peer : nullptr);
      },
      static_cast<int>(drain_timeout_ms));
  if (st.ok()) *drained_sends = *count;
  return st;
}

// Every send posted completes before the pause ends: an RC or UC QP's
// send queue completes in order, so once a marker posted behind the
// application's sends has completed, they have (signaled or not). A UD
// QP waits until its signaled sends are counted done. Completions found
// meanwhile go to the shadow CQs. A peer's quiesce drains only its QPs
// toward the endpoint that moves: the others are paused, not re-made.
//
// A marker's completion takes a CQ entry the application did not size
// its CQ for (it keeps what it has in flight within its CQ's depth): the
// real CQs have `slack` more, and each send CQ has at most slack - 1
// markers outstanding at a time (one if it got less), so that many QPs
// on one CQ drain in a few rounds, not one after the other. What the CQs
// hold already goes to the shadow CQs first.
Status Shim::DrainNow(uint32_t drain_timeout_ms, uint32_t* drained_sends, const ibv_gid* toward) {
  MutexLock lock(&mu_);
  if (!paused_ || released_)
    return Error(Code::kFailedPrecondition, "the drain needs a paused endpoint");
  const std::vector<Cq*> cqs = All<Cq>(Kind::kCq);
  const std::vector<Qp*> qps = All<Qp>(Kind::kQp);
  uint32_t sends = 0;
  if (Status st = DrainCqs(cqs, &sends); !st.ok()) return st;
  std::vector<DrainMarkers> markers = QpsToMark(qps, toward);
  const uint64_t deadline = NowUs() + uint64_t{drain_timeout_ms} * 1000;
  bool unsignaled_tail = false;
  for (;;) {
    std::string why;
    uint64_t in_flight = PostMarkers(&markers, &why);
    if (!why.empty()) return Error(Code::kInternal, why);
    if (Status st = DrainCqs(cqs, &sends); !st.ok()) return st;
    std::string which;
    const bool late = NowUs() > deadline;
    in_flight += SendsInFlight(qps, late, &unsignaled_tail, &which);
    if (in_flight == 0) {
      MarkDrained(qps, toward);
      break;
    }
    if (late) {
      LeaveLateMarkers(qps);
      return Error(Code::kDeadlineExceeded, "sends still in flight after " +
                                                std::to_string(drain_timeout_ms) + " ms (" + which +
                                                ")");
    }
    usleep(200);
  }
  if (unsignaled_tail) {
    // Unsignaled UD sends after the last signaled one leave no completion
    // to wait for: give them a moment to leave.
    usleep(20000);
    for (Cq* cq : cqs) DrainCq(cq, &sends);
  }
  *drained_sends = sends;
  return {};
}

uint64_t Shim::PostMarkers(std::vector<DrainMarkers>* markers, std::string* why) {
  uint64_t waiting_total = 0;
  for (DrainMarkers& m : *markers) {
    std::vector<Qp*>& out = m.outstanding;
    out.erase(std::remove_if(out.begin(), out.end(),
                             [](const Qp* qp) { return !qp->send_marker_pending; }),
              out.end());
    std::vector<Qp*>& waiting = m.waiting;
    const size_t budget = m.cq != nullptr && m.cq->slack > 2 ? m.cq->slack - 1 : 1;
    size_t posted = 0;
    // A full send queue refuses the marker (ENOMEM): again next round.
    while (out.size() < budget && posted < waiting.size() && PostSendMarker(waiting[posted], why)) {
      if (waiting[posted]->send_marker_pending) out.push_back(waiting[posted]);
      ++posted;
    }
    waiting.erase(waiting.begin(), waiting.begin() + static_cast<ptrdiff_t>(posted));
    waiting_total += waiting.size();
  }
  return waiting_total;
}

uint64_t Shim::SendsInFlight(const std::vector<Qp*>& qps, bool late, bool* unsignaled_tail,
                             std::string* which) {
  uint64_t in_flight = 0;
  *unsignaled_tail = false;
  for (const Qp* qp : qps) {
    uint64_t left = qp->send_marker_pending ? 1 : 0;
    if (qp->shadow.qp_base.qp_type == IBV_QPT_UD) {
      const uint64_t posted = qp->signaled_posted.load();
      const uint64_t done = qp->sends_done.load();
      *unsignaled_tail |= qp->unsignaled_tail.load();
      // A QP in the error state completes nothing more with success:
      // nothing to wait for on it.
      if (posted > done && RealQpState(qp) != IBV_QPS_ERR) left = posted - done;
    }
    if (left == 0) continue;
    in_flight += left;
    if (late) {
      char buf[160];
      snprintf(buf, sizeof(buf), "%sQP 0x%x: %s, state %s", which->empty() ? "" : "; ",
               qp->shadow.qp_base.qp_num,
               qp->send_marker_pending
                   ? "sends in flight"
                   : (std::to_string(left) + " signaled send(s) in flight").c_str(),
               QpStateName(RealQpState(qp)));
      *which += buf;
    }
  }
  return in_flight;
}

void Shim::SettleUnacknowledgedReceives(const std::vector<Qp*>& qps) {
  std::vector<Cq*> cqs;
  for (const Qp* qp : qps) {
    const uint32_t type = qp->shadow.qp_base.qp_type;
    if (qp->real == nullptr || qp->recv_cq == nullptr || (type != IBV_QPT_UD && type != IBV_QPT_UC))
      continue;
    if (std::find(cqs.begin(), cqs.end(), qp->recv_cq) == cqs.end()) cqs.push_back(qp->recv_cq);
  }
  if (cqs.empty()) return;
  constexpr uint64_t kQuietUs = 50000, kSettleUs = 1000000;
  const uint64_t start = NowUs();
  uint64_t last = start;
  while (NowUs() - last < kQuietUs && NowUs() - start < kSettleUs) {
    int got = 0;
    for (Cq* cq : cqs) got += std::max(DrainCq(cq, nullptr), 0);
    if (got > 0) last = NowUs();
    usleep(1000);
  }
}

uint32_t Shim::FlushBound(const Qp* qp) {
  // Flushes of the receives still posted (no more than the queue holds,
  // nor than were ever posted) and the marker receive; an SRQ's receives
  // are not flushed with its QPs. Sends were drained before.
  if (qp->srq != nullptr) return 0;
  return static_cast<uint32_t>(
             std::min<uint64_t>(qp->init.cap.max_recv_wr, qp->own_recvs.posted())) +
         1;
}

void Shim::FailAndCountRecvs(const std::vector<Qp*>& qps) {
  // As many QPs of one receive CQ at a time as their flushes fit in it
  // (emptied first, what it held going to the shadow CQ), beside the
  // receives of its other QPs, which may still complete meanwhile; a QP
  // alone always goes, its flushes and marker fitting a CQ the application
  // sized for that QP's receives, plus CqSlack(). With one CQ for many
  // QPs, one round of flushes then serves all of them, not one per QP.
  for (Cq* cq : All<Cq>(Kind::kCq)) DrainCq(cq, nullptr);
  SettleUnacknowledgedReceives(qps);
  std::vector<std::pair<const Cq*, uint64_t>> room;  // entries free, per receive CQ
  const auto room_of = [](std::vector<std::pair<const Cq*, uint64_t>>* r, const Cq* cq) {
    for (auto& [c, n] : *r)
      if (c == cq) return &n;
    return &r->emplace_back(cq, cq->real != nullptr ? static_cast<uint64_t>(cq->real->cqe) : 0)
                .second;
  };
  for (const Qp* qp : All<Qp>(Kind::kQp)) {
    if (qp->recv_cq == nullptr || std::find(qps.begin(), qps.end(), qp) != qps.end()) continue;
    uint64_t* n = room_of(&room, qp->recv_cq);
    *n -= std::min<uint64_t>(*n, FlushBound(qp));
  }
  std::vector<Qp*> rest = qps;
  while (!rest.empty()) {
    std::vector<Qp*> batch, later;
    std::vector<std::pair<const Cq*, uint64_t>> left = room;
    std::vector<const Cq*> used;
    for (Qp* qp : rest) {
      if (qp->recv_cq != nullptr) {
        uint64_t* n = room_of(&left, qp->recv_cq);
        const uint64_t need = FlushBound(qp);
        const bool first = std::find(used.begin(), used.end(), qp->recv_cq) == used.end();
        if (!first && *n < need) {
          later.push_back(qp);
          continue;
        }
        *n -= std::min(*n, need);
        if (first) used.push_back(qp->recv_cq);
      }
      batch.push_back(qp);
    }
    FailAndCountRecvsOf(batch);
    rest.swap(later);
  }
}

void Shim::FailAndCountRecvsOf(const std::vector<Qp*>& qps) {
  StartRecvFlushes(qps);
  AwaitRecvFlushes(qps);
  TakeFlushedRecvs(qps);
}

void Shim::StartRecvFlushes(const std::vector<Qp*>& qps) {
  // To the error state, so that nothing completes after the count; a
  // QP's receives still posted are flushed, in order, and a marker
  // receive posted behind them (flushed by a second move to the error
  // state) says when the last one is in. A QP that failed by itself
  // before has had its receives flushed to the application.
  for (Qp* qp : qps) {
    qp->recv_flushes = 0;
    qp->recv_marker_seen = true;
    qp->flushing = false;
    if (qp->real == nullptr) continue;
    // Never given a receive: nothing to count (qp_holder's 1024 QPs, a
    // sender's QPs); the QP is destroyed or reset next.
    if (qp->srq == nullptr && qp->own_recvs.posted() == 0) continue;
    if (RealQpState(qp) == IBV_QPS_ERR) continue;
    qp->flushing = true;
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (backend_->ModifyQp(qp->real, &attr, IBV_QP_STATE) != 0) {
      LogOnce("a QP refused the error state; its receives are counted as not posted");
      qp->flushing = false;
      continue;
    }
    if (qp->srq != nullptr) continue;  // an SRQ's receives are counted at completion
    ibv_recv_wr marker{};
    marker.wr_id = RecvMarkerId(qp);
    ibv_recv_wr* bad = nullptr;
    if (qp->real_post_recv(qp->real, &marker, &bad) == 0) {
      qp->recv_marker_seen = false;
      backend_->ModifyQp(qp->real, &attr, IBV_QP_STATE);
    } else {
      // The receive queue is full: every slot of it is flushed.
      qp->recv_marker_seen = false;
      qp->recv_flushes_expected = qp->init.cap.max_recv_wr;
    }
  }
}

void Shim::DestroyReal() {
  // Children before parents, as the verbs require.
  for (Ah* ah : All<Ah>(Kind::kAh)) {
    if (ah->real != nullptr) backend_->DestroyAh(ah->real);
    ah->real = nullptr;
    for (int i = 0; i < ah->nroutes.load(); ++i)
      if (ah->routes[i].real != nullptr) backend_->DestroyAh(ah->routes[i].real);
    ah->nroutes.store(0, std::memory_order_release);
  }
  for (Qp* qp : All<Qp>(Kind::kQp)) {
    if (qp->real == nullptr) continue;
    qp_index_.Remove(qp->physical_qpn, qp);
    // uverbs keeps a QP that is still in a multicast group (EBUSY): before,
    // a moved mckey receiver's QP stayed, its queues mapped, and CRIU
    // refused the dump. The restore attaches the new QP again.
    for (const Qp::Group& g : qp->groups) backend_->DetachMcast(qp->real, &g.gid, g.lid);
    backend_->DestroyQp(qp->real);
    qp->real = nullptr;
    qp->real_ex = nullptr;
    qp->SetPhysicalQpn(0);
  }
  for (Srq* srq : All<Srq>(Kind::kSrq)) {
    if (srq->real != nullptr) backend_->DestroySrq(srq->real);
    srq->real = nullptr;
  }
  for (Cq* cq : All<Cq>(Kind::kCq)) {
    if (cq->real != nullptr) {
      CloseEvents(cq);
      backend_->DestroyCq(cq->real);
    }
    cq->real = nullptr;
    cq->real_ex = nullptr;
  }
  for (Mr* mr : All<Mr>(Kind::kMr)) {
    if (mr->real != nullptr) backend_->DeregMr(mr->real);
    mr->real = nullptr;
  }
  for (Pd* pd : All<Pd>(Kind::kPd)) {
    if (pd->real != nullptr) backend_->DeallocPd(pd->real);
    pd->real = nullptr;
  }
  for (Channel* ch : All<Channel>(Kind::kChannel)) {
    if (ch->real != nullptr) {
      ReleaseChannel(ch);
      ch->fd_flags = StatusFlags(ch->real->fd);
      backend_->DestroyCompChannel(ch->real);
    }
    ch->real = nullptr;
  }
  for (const auto& [p, k] : Shadows()) {
    if (k != Kind::kContext) continue;
    Context* ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
    if (ctx->real != nullptr) {
      ctx->async_fd_flags = StatusFlags(ctx->real->async_fd);
      DropRelay(ctx);
      backend_->CloseDevice(ctx->real);
    }
    ctx->real = nullptr;
  }
}

void Shim::CloseEvents(Cq* cq) {
  MutexLock lock(&cq->events_mu);
  // The destroy that follows waits for these: acknowledged now, and the
  // application's acknowledgements of them absorbed (AckCqEvents).
  if (cq->events_unacked > 0) backend_->AckCqEvents(cq->real, cq->events_unacked);
  cq->events_absorbed += cq->events_unacked;
  cq->events_unacked = 0;
  cq->events_closed = true;
}

void Shim::ReleaseChannel(Channel* ch) {
  std::unique_lock<std::mutex> lock(ch->mu);
  ch->released = true;
  if (ch->wake_fd >= 0) {
    const uint64_t one = 1;
    if (write(ch->wake_fd, &one, sizeof one) < 0)
      LogOnce("waking a completion-event waiter failed");
  }
  // Waiters leave poll(2) on the real fd before it is closed (its number
  // may be reused). One blocked in read(2) (two threads on one channel)
  // is woken by the device's close instead (EIO).
  ch->cv.wait_for(lock, std::chrono::seconds(2), [ch] { return ch->in_use == 0; });
}

Status Shim::ReleaseNow(const KnownPages& known, DirtyCount* count, bool lock_registered) {
  {
    MutexLock lock(&mu_);
    if (!paused_) return Error(Code::kFailedPrecondition, "release needs a quiesced endpoint");
    if (released_) return {};
  }
  // The application's control verbs in progress return first; later ones
  // wait for the resume.
  if (Status st = CloseControl(); !st.ok()) return st;
  MutexLock lock(&mu_);
  // Every QP to the error state, its receives still posted counted from
  // their flushes; then what else arrived since the drain.
  FailAndCountRecvs(All<Qp>(Kind::kQp));
  for (Cq* cq : All<Cq>(Kind::kCq)) DrainCq(cq, nullptr);
  for (Srq* srq : All<Srq>(Kind::kSrq))
    srq->outstanding = TakeOutstanding(&srq->recvs, &srq->recvs_done);
  // The pages the HCA may have written, for a dump that tracks memory.
  const std::vector<std::pair<uintptr_t, uintptr_t>> writable = WritableRegisteredLocked();
  epoll_regs_ = FindEpollRegistrations(EventFds());
  DestroyReal();
  DirtyPages(writable, known, count);
  if (lock_registered) {
    std::vector<std::pair<uintptr_t, uintptr_t>> all;
    for (const Mr* mr : All<Mr>(Kind::kMr)) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(mr->shadow.addr);
      all.emplace_back(begin, begin + mr->shadow.length);
    }
    locked_registered_ = LockUnlocked(all);
  }
  StopItimers();
  released_ = true;
  // Whatever brings the endpoint back (a CRIU restore, most likely) must
  // reopen the device on an application thread; see OnAppThread.
  app_thread_steps_.store(true);
  return {};
}

// CRIU before 4.1 (Debian 12 has 3.17) dumps the process's interval
// timers but arms one again at the restore only if it repeats
// (criu/pie/restorer.c tests it_interval): a one-shot alarm(2) or
// setitimer(2) armed when the process was dumped never fires after its
// restore. A program that ends a timed phase with SIGALRM (perftest's
// duration mode) then runs on for ever on the destination. So the
// release stops the three timers, keeping what was left of each, and the
// resume arms them again: they stand still while the process does not run,
// as CRIU means them to, whichever CRIU dumps it, and a timer cannot fire
// between the release and the dump to be armed again after. One the
// application armed itself in the meantime (its threads run while it is
// paused) is left as it set it.
namespace {

// stopped_itimers_'s order.
constexpr int kItimers[3] = {ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF};

bool Armed(const itimerval& t) { return t.it_value.tv_sec != 0 || t.it_value.tv_usec != 0; }

}  // namespace

void Shim::StopItimers() {
  const itimerval off{};
  for (int i = 0; i < 3; ++i)
    if (setitimer(kItimers[i], &off, &stopped_itimers_[i]) != 0) stopped_itimers_[i] = {};
}

void Shim::RestartItimers() {
  for (int i = 0; i < 3; ++i) {
    const itimerval left = stopped_itimers_[i];
    stopped_itimers_[i] = {};
    itimerval now{};
    if (!Armed(left) || getitimer(kItimers[i], &now) != 0) continue;
    if (!Armed(now)) setitimer(kItimers[i], &left, nullptr);  // else armed meanwhile
  }
}

int Shim::RealQpState(const Qp* qp) {
  if (qp->real == nullptr) return -1;
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (backend_->QueryQp(qp->real, &attr, IBV_QP_STATE, &init) != 0) return -1;
  return attr.qp_state;
}

std::vector<int> Shim::EventFds() {
  std::vector<int> fds;
  for (const auto& [p, k] : Shadows())
    if (k == Kind::kContext)
      fds.push_back(Shadow(AsContext(static_cast<ibv_context*>(const_cast<void*>(p))))->async_fd);
  for (Channel* ch : All<Channel>(Kind::kChannel)) fds.push_back(ch->shadow.fd);
  return fds;
}

Status Shim::Release(const KnownPages& known, DirtyCount* count, bool lock_registered) {
  // The step may still run on an application thread after a timeout here:
  // it owns what it uses.
  auto pages = std::make_shared<const KnownPages>(known);
  auto counted = std::make_shared<DirtyCount>();
  const Status st = OnAppThread("release", [this, pages, counted, lock_registered] {
    return ReleaseNow(*pages, counted.get(), lock_registered);
  });
  if (st.ok() && count != nullptr) *count = *counted;
  return st;
}

}  // namespace rdmavirt::shim
