// The shim's side of a migration: pause, drain, release, re-create,
// re-connect, resume. See shim.h for the contract of each step and
// docs/shim.md for how they fit the migrator's sequence.
//
// Every step runs on the control thread with the shim's mutex held, so
// the application's control verbs wait for it; the application's posts and
// polls do not take that mutex: they meet the steps at each object's Gate.
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "shim/data_path.h"
#include "shim/epoll_regs.h"
#include "shim/log.h"
#include "shim/shim.h"
#include "shim/thread_probe.h"
#include "shim/write_relay.h"

namespace rdmavirt::shim {
namespace {

// This thread's control verbs in progress (a provider may call exported
// verbs from inside one), and whether it runs a migration step: either
// passes the control gate.
thread_local int t_control_depth = 0;
thread_local bool t_in_step = false;

// A process restored with post-copy (CRIU's lazy pages) gets the pages it
// has not touched yet through userfaultfd, when it touches them; the
// kernel's pinning of a memory region (ibv_reg_mr) does not wait for them
// and fails with EFAULT. Reading each page once brings it in.
void TouchPages(const void* addr, size_t length) {
  constexpr uintptr_t kPage = 4096;
  const uintptr_t end = reinterpret_cast<uintptr_t>(addr) + length;
  for (uintptr_t p = reinterpret_cast<uintptr_t>(addr) & ~(kPage - 1); p < end; p += kPage)
    (void)*reinterpret_cast<const volatile char*>(p);
}

uint64_t NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
}

const char* QpTypeName(uint32_t type) {
  switch (type) {
    case IBV_QPT_RC:
      return "RC";
    case IBV_QPT_UC:
      return "UC";
    case IBV_QPT_UD:
      return "UD";
    default:
      return "other";
  }
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

std::string Errno(const char* what, int err) {
  std::string s = what;
  s += ": ";
  s += strerror(err);
  return s;
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

// Posts `recvs` through `post` as one chain, logged anew in `log`, whose
// queue is paused: the calling thread writes it as its owner would.
template <typename Post>
int Repost(RecvLog* log, std::vector<QueuedRecv>* recvs, Post post) {
  if (recvs->empty()) return 0;
  RecvLog::Quiesced quiesced(log);
  std::vector<ibv_recv_wr> wrs(recvs->size());
  for (size_t i = 0; i < recvs->size(); ++i) {
    QueuedRecv& r = (*recvs)[i];
    wrs[i] = {};
    wrs[i].wr_id = r.wr_id;
    wrs[i].sg_list = r.sge.data();
    wrs[i].num_sge = static_cast<int>(r.sge.size());
    wrs[i].next = i + 1 < wrs.size() ? &wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  const int rc = post(wrs.data(), &bad);
  if (rc == 0) recvs->clear();
  return rc;
}

// The file status flags of an fd about to be closed (0 if unknown).
int StatusFlags(int fd) {
  const int flags = fd >= 0 ? fcntl(fd, F_GETFL) : -1;
  return flags < 0 ? 0 : flags;
}

// Gives a fresh fd the O_NONBLOCK its predecessor had (`flags`): an
// application that set it polls the fd and expects EAGAIN, never a read
// that waits. (Flags live with the open file, not with the fd's number.)
void KeepNonBlocking(int fd, int flags) {
  if (fd < 0 || (flags & O_NONBLOCK) == 0) return;
  const int now = fcntl(fd, F_GETFL);
  if (now >= 0 && fcntl(fd, F_SETFL, now | O_NONBLOCK) != 0)
    LogOnce("giving a re-created fd the O_NONBLOCK it had failed");
}

// Gives a new fd the number the application knew, if that number is free.
int KeepFdNumber(int fresh, int known) {
  if (fresh < 0 || known < 0 || fresh == known) return fresh;
  if (fcntl(known, F_GETFD) != -1 || errno != EBADF) return fresh;  // taken since
  if (dup3(fresh, known, O_CLOEXEC) < 0) return fresh;
  close(fresh);
  return known;
}

// The fd numbers the application knows, each held by a placeholder (a
// /dev/null fd) from the start of a re-creation until its fd is re-created
// under it: otherwise the device's command fd, the write relay's ring or
// any fd opened on the way could take a number a later fd must get back
// (UCX keeps the numbers, in its epoll set among other places).
class HeldFdNumbers {
 public:
  explicit HeldFdNumbers(const std::vector<int>& numbers) {
    const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0) return;
    bool null_held = false;
    for (int n : numbers) {
      if (n == null_fd) {
        null_held = true;
        held_.push_back(n);
      } else if (n >= 0 && fcntl(n, F_GETFD) == -1 && errno == EBADF &&
                 dup3(null_fd, n, O_CLOEXEC) == n) {
        held_.push_back(n);
      }
    }
    if (!null_held) close(null_fd);
  }
  ~HeldFdNumbers() {
    for (int n : held_) close(n);
  }
  HeldFdNumbers(const HeldFdNumbers&) = delete;
  HeldFdNumbers& operator=(const HeldFdNumbers&) = delete;

  // `fresh` under the number `known`: its placeholder's, or a free one.
  int Keep(int fresh, int known) {
    const auto it = std::find(held_.begin(), held_.end(), known);
    if (fresh < 0 || it == held_.end()) return KeepFdNumber(fresh, known);
    if (dup3(fresh, known, O_CLOEXEC) < 0) return fresh;
    held_.erase(it);
    close(fresh);
    return known;
  }

 private:
  std::vector<int> held_;
};

}  // namespace

template <typename T>
std::vector<T*> Shim::All(Kind kind) const {
  std::vector<T*> out;
  for (const auto& [p, k] : shadows_)
    if (k == kind) out.push_back(static_cast<T*>(const_cast<void*>(p)));
  return out;
}

void Shim::NoteEndpointGid(Context* ctx, uint8_t port, int sgid_index) {
  if (endpoint_gid_known_) return;
  ibv_gid gid;
  if (backend_->QueryGid(ctx->real, port, sgid_index, &gid) != 0) return;
  endpoint_gid_known_ = true;
  endpoint_port_ = port;
  endpoint_sgid_index_ = sgid_index;
  endpoint_physical_gid_ = gid;
  endpoint_virtual_gid_ = mode_.VirtualGid(gid);
}

bool Shim::GuessGid(Context** ctx, int* index, ibv_gid* gid) const {
  // No QP or AH named a source GID (a UD receiver that only answers, say):
  // peers reach a RoCE v2 endpoint at its IPv4-mapped GID, the first one,
  // else at the port's first GID.
  static constexpr uint8_t kV4Prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  for (const auto& [p, k] : shadows_) {
    if (k != Kind::kContext) continue;
    Context* c = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
    if (c->real == nullptr) continue;
    bool found = false;
    for (int i = 0; i < 16; ++i) {
      ibv_gid g;
      if (backend_->QueryGid(c->real, 1, i, &g) != 0) break;
      const bool v4 = memcmp(g.raw, kV4Prefix, 12) == 0;
      if (i == 0 || v4) {
        *index = i;
        *gid = g;
        found = true;
      }
      if (v4) break;
    }
    if (!found) return false;
    *ctx = c;
    return true;
  }
  return false;
}

void Shim::GuessEndpointGid() {
  if (endpoint_gid_known_) return;
  Context* ctx;
  int index;
  ibv_gid gid;
  if (GuessGid(&ctx, &index, &gid)) NoteEndpointGid(ctx, 1, index);
}

void Shim::SetPaused(bool paused) {
  for (const auto& [p, k] : shadows_) {
    void* o = const_cast<void*>(p);
    if (k == Kind::kQp) SetQpPaused(static_cast<Qp*>(o), paused);
    if (k == Kind::kCq) static_cast<Cq*>(o)->path.SetPaused(paused);
    if (k == Kind::kSrq) static_cast<Srq*>(o)->path.SetPaused(paused);
  }
}

std::vector<const void*> Shim::ProviderEntries() const {
  std::vector<const void*> entries;
  for (const auto& [p, k] : shadows_) {
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
    std::lock_guard<std::mutex> lock(mu_);
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

Status Shim::DrainNow(uint32_t drain_timeout_ms, uint32_t* drained_sends, const ibv_gid* toward) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!paused_ || released_)
    return Error(Code::kFailedPrecondition, "the drain needs a paused endpoint");
  const std::vector<Cq*> cqs = All<Cq>(Kind::kCq);
  const std::vector<Qp*> qps = All<Qp>(Kind::kQp);
  std::string why;

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
  uint32_t sends = 0;
  for (Cq* cq : cqs) {
    const int rc = DrainCq(cq, &sends);
    if (rc < 0) return Error(Code::kInternal, Errno("polling a CQ during the drain", -rc));
  }
  std::vector<std::pair<Cq*, std::vector<Qp*>>> to_mark;  // per send CQ, in order
  std::vector<std::vector<Qp*>> marking;                  // each CQ's markers outstanding
  for (Qp* qp : qps) {
    qp->send_marker_pending = false;
    if (qp->real == nullptr || qp->shadow.qp_base.qp_type == IBV_QPT_UD || qp->drained) continue;
    if (toward != nullptr && memcmp(qp->remote_gid.raw, toward->raw, 16) != 0) continue;
    // A QP never brought to RTS has sent nothing (and refuses the post);
    // one in the error state completes the marker at once, flushed.
    if (qp->shadow.qp_base.state != IBV_QPS_RTS && qp->shadow.qp_base.state != IBV_QPS_SQD)
      continue;
    auto it = std::find_if(to_mark.begin(), to_mark.end(),
                           [qp](const auto& e) { return e.first == qp->send_cq; });
    if (it == to_mark.end()) {
      to_mark.push_back({qp->send_cq, {}});
      marking.emplace_back();
      it = to_mark.end() - 1;
    }
    it->second.push_back(qp);
  }
  const uint64_t deadline = NowUs() + uint64_t{drain_timeout_ms} * 1000;
  bool unsignaled_tail = false;
  for (;;) {
    uint64_t in_flight = 0;
    for (size_t i = 0; i < to_mark.size(); ++i) {
      std::vector<Qp*>& out = marking[i];
      out.erase(std::remove_if(out.begin(), out.end(),
                               [](const Qp* qp) { return !qp->send_marker_pending; }),
                out.end());
      std::vector<Qp*>& waiting = to_mark[i].second;
      const Cq* cq = to_mark[i].first;
      const size_t budget = cq != nullptr && cq->slack > 2 ? cq->slack - 1 : 1;
      size_t posted = 0;
      // A full send queue refuses the marker (ENOMEM): again next round.
      while (out.size() < budget && posted < waiting.size() &&
             PostSendMarker(waiting[posted], &why)) {
        if (waiting[posted]->send_marker_pending) out.push_back(waiting[posted]);
        ++posted;
      }
      waiting.erase(waiting.begin(), waiting.begin() + static_cast<ptrdiff_t>(posted));
      in_flight += waiting.size();
    }
    if (!why.empty()) return Error(Code::kInternal, why);
    for (Cq* cq : cqs) {
      const int rc = DrainCq(cq, &sends);
      if (rc < 0) return Error(Code::kInternal, Errno("polling a CQ during the drain", -rc));
    }
    unsignaled_tail = false;
    std::string which;
    const bool late = NowUs() > deadline;
    for (const Qp* qp : qps) {
      uint64_t left = qp->send_marker_pending ? 1 : 0;
      if (qp->shadow.qp_base.qp_type == IBV_QPT_UD) {
        const uint64_t posted = qp->signaled_posted.load();
        const uint64_t done = qp->sends_done.load();
        unsignaled_tail |= qp->unsignaled_tail.load();
        // A QP in the error state completes nothing more with success:
        // nothing to wait for on it.
        if (posted > done && RealQpState(qp) != IBV_QPS_ERR) left = posted - done;
      }
      if (left == 0) continue;
      in_flight += left;
      if (late) {
        char buf[160];
        snprintf(buf, sizeof(buf), "%sQP 0x%x: %s, state %s", which.empty() ? "" : "; ",
                 qp->shadow.qp_base.qp_num,
                 qp->send_marker_pending
                     ? "sends in flight"
                     : (std::to_string(left) + " signaled send(s) in flight").c_str(),
                 QpStateName(RealQpState(qp)));
        which += buf;
      }
    }
    if (in_flight == 0) {
      for (Qp* qp : qps)
        if (qp->shadow.qp_base.qp_type != IBV_QPT_UD &&
            (toward == nullptr || memcmp(qp->remote_gid.raw, toward->raw, 16) == 0))
          qp->drained = true;
      break;
    }
    if (late) {
      // A marker that completes later is the shim's: its CQ translates
      // from now on, and the translating path drops it.
      for (const Qp* qp : qps) {
        if (!qp->send_marker_pending || qp->send_cq == nullptr) continue;
        MarkersLate(qp->send_cq);
      }
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

void Shim::LogResume() {
  // What the application can count on from each QP's receive queue: the
  // receives posted on the real QP, plus those completed and not yet polled.
  for (const Qp* qp : All<Qp>(Kind::kQp)) {
    if (qp->srq != nullptr || qp->own_recvs.posted() == 0 || qp->reposted < 0) continue;
    uint32_t waiting = 0;
    if (const Cq* cq = qp->recv_cq; cq != nullptr) {
      for (uint32_t i = cq->pending_head.load(); i < cq->pending_count; ++i) {
        const ibv_wc& wc = cq->pending[i];
        waiting += wc.qp_num == qp->shadow.qp_base.qp_num && (wc.opcode & IBV_WC_RECV) &&
                   wc.status == IBV_WC_SUCCESS;
      }
    }
    char line[200];
    snprintf(line, sizeof line,
             "resume: QP 0x%x (%s): %" PRId64
             " receives re-posted, %zu posted during the pause, "
             "%u received and not yet polled",
             qp->shadow.qp_base.qp_num, QpTypeName(qp->shadow.qp_base.qp_type), qp->reposted,
             qp->queued_recvs.size(), waiting);
    Log(line);
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
  for (const auto& [p, k] : shadows_) {
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
  std::lock_guard<std::mutex> lock(cq->events_mu);
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

void Shim::ReopenChannel(Channel* ch) {
  std::lock_guard<std::mutex> lock(ch->mu);
  ch->released = false;
  ch->cv.notify_all();
}

void Shim::WakeEventWaiters() {
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    control_cv_.notify_all();
  }
  std::vector<Channel*> channels;
  {
    std::lock_guard<std::mutex> registry(registry_mu_);
    for (const auto& [p, k] : shadows_)
      if (k == Kind::kChannel) channels.push_back(static_cast<Channel*>(const_cast<void*>(p)));
  }
  for (Channel* ch : channels) {
    std::lock_guard<std::mutex> lock(ch->mu);
    const uint64_t one = 1;
    if (ch->wake_fd >= 0 && write(ch->wake_fd, &one, sizeof one) < 0)
      LogOnce("waking a completion-event waiter failed");
    ch->cv.notify_all();
  }
}

std::vector<Cq*> Shim::ArmForResume() {
  std::vector<Cq*> owed;
  for (Cq* cq : All<Cq>(Kind::kCq)) {
    if (cq->channel == nullptr || !cq->armed.load()) continue;
    // What came into the real CQ since the pause (a re-created CQ gets the
    // peer's first sends before the resume) raised no event the waiter
    // will see: into the shadow CQ with the rest.
    if (DrainCq(cq, nullptr) < 0) LogOnce("polling a CQ at resume failed");
    // The application armed the CQ during the pause (only noted then):
    // the real one is armed now.
    cq->real->context->ops.req_notify_cq(cq->real, 0);
    // Completions the pause moved into the shadow CQ raise no real event:
    // the shim owes the waiter one.
    if (cq->pending_head.load() < cq->pending_count) owed.push_back(cq);
  }
  return owed;
}

void Shim::OweEvents(const std::vector<Cq*>& cqs) {
  for (Cq* cq : cqs) {
    Channel* ch = cq->channel;
    std::lock_guard<std::mutex> lock(ch->mu);
    if (std::find(ch->owed.begin(), ch->owed.end(), cq) != ch->owed.end()) continue;
    ch->owed.push_back(cq);
    const uint64_t one = 1;
    if (ch->wake_fd >= 0 && write(ch->wake_fd, &one, sizeof one) < 0)
      LogOnce("waking a completion-event waiter failed");
    ch->cv.notify_all();
  }
}

Status Shim::ReleaseNow(const KnownPages& known, DirtyCount* count, bool lock_registered) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!paused_) return Error(Code::kFailedPrecondition, "release needs a quiesced endpoint");
    if (released_) return {};
  }
  // The application's control verbs in progress return first; later ones
  // wait for the resume.
  if (Status st = CloseControl(); !st.ok()) return st;
  std::lock_guard<std::mutex> lock(mu_);
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

std::vector<std::pair<uintptr_t, uintptr_t>> Shim::WritableRegistered() {
  std::lock_guard<std::mutex> lock(mu_);
  return WritableRegisteredLocked();
}

std::vector<std::pair<uintptr_t, uintptr_t>> Shim::WritableRegisteredLocked() {
  std::vector<std::pair<uintptr_t, uintptr_t>> writable;
  for (const Mr* mr : All<Mr>(Kind::kMr)) {
    if (!(mr->access &
          (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)))
      continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(mr->shadow.addr);
    writable.emplace_back(begin, begin + mr->shadow.length);
  }
  return writable;
}

std::vector<std::pair<uintptr_t, uintptr_t>> LockUnlocked(
    const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  // The mappings the application locked itself ("lo" in their VmFlags)
  // stay as they are, and are not unlocked after.
  std::vector<std::pair<uintptr_t, uintptr_t>> locked;
  if (ranges.empty()) return locked;
  FILE* smaps = fopen("/proc/self/smaps", "re");
  if (smaps == nullptr) {
    LogOnce("release: /proc/self/smaps unreadable; registered memory is not locked for post-copy");
    return locked;
  }
  constexpr uintptr_t kPage = 4096;
  std::vector<std::pair<uintptr_t, uintptr_t>> vmas;  // not locked by the application
  unsigned long lo = 0, hi = 0;
  char line[512];
  while (fgets(line, sizeof line, smaps) != nullptr) {
    unsigned long a = 0, b = 0;
    if (sscanf(line, "%lx-%lx ", &a, &b) == 2) {  // a mapping's first line
      lo = a;
      hi = b;
      continue;
    }
    if (strncmp(line, "VmFlags:", 8) != 0) continue;
    if (strstr(line, " lo") == nullptr) vmas.emplace_back(lo, hi);
  }
  fclose(smaps);
  for (const auto& [begin, end] : ranges) {
    for (const auto& [vlo, vhi] : vmas) {
      const uintptr_t from = std::max<uintptr_t>(begin & ~(kPage - 1), vlo);
      const uintptr_t to = std::min<uintptr_t>((end + kPage - 1) & ~(kPage - 1), vhi);
      if (from >= to) continue;
      // On fault: the pages are there (pinned until the release) and are
      // not touched. A plain mlock populates a writable range by writing
      // to it, which sets every page's soft-dirty bit, and CRIU would then
      // dump what the pre-copy holds unchanged.
      if (mlock2(reinterpret_cast<void*>(from), to - from, MLOCK_ONFAULT) == 0) {
        locked.emplace_back(from, to);
      } else {
        LogOnce(("release: mlock of registered memory: " + std::string(strerror(errno)) +
                 "; it comes with post-copy's lazy pages, and is re-registered more slowly")
                    .c_str());
      }
    }
  }
  return locked;
}

void DirtyPages(const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges, const KnownPages& known,
                DirtyCount* count) {
  // The HCA writes registered memory through the kernel's mapping of the
  // pinned pages, which leaves the process's soft-dirty bits alone: a
  // pre-dump's copy of such a page would be taken for current. One write
  // per page, through the process's own mapping, marks it: an atomic OR
  // with 0, which changes nothing even while an application thread writes
  // the same byte. Only where the mapping is writable now (an application
  // may have made registered memory read-only since): /proc/self/maps.
  if (ranges.empty()) return;
  FILE* maps = fopen("/proc/self/maps", "re");
  if (maps == nullptr) {
    LogOnce("release: /proc/self/maps unreadable; registered pages are not marked for the dump");
    return;
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  char line[512];
  while (fgets(line, sizeof line, maps) != nullptr) {
    unsigned long lo = 0, hi = 0;
    char perms[5] = {};
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || perms[1] != 'w') continue;
    for (const auto& [begin, end] : ranges) {
      // A byte of the range on each of its pages: the first one's is the
      // range's start, the others' their first.
      const uintptr_t to = std::min<uintptr_t>(end, hi);
      for (uintptr_t p = std::max<uintptr_t>(begin, lo); p < to; p = (p & ~(page - 1)) + page) {
        const uintptr_t whole = p & ~(page - 1);
        if (known.Unchanged(whole, reinterpret_cast<const void*>(whole), page)) {
          if (count != nullptr) ++count->unchanged;
          continue;
        }
        __atomic_fetch_or(reinterpret_cast<uint8_t*>(p), uint8_t{0}, __ATOMIC_RELAXED);
        if (count != nullptr) ++count->marked;
      }
    }
  }
  fclose(maps);
}

int Shim::RealQpState(const Qp* qp) {
  if (qp->real == nullptr) return -1;
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (backend_->QueryQp(qp->real, &attr, IBV_QP_STATE, &init) != 0) return -1;
  return attr.qp_state;
}

int Shim::ReplayTransitions(Qp* qp) {
  for (const QpTransition& t : qp->transitions) {
    ibv_qp_attr attr = t.attr;
    const RemoteEndpoint* remote = qp->remote.load(std::memory_order_acquire);
    if ((t.mask & IBV_QP_AV) && attr.ah_attr.is_global)
      remote = FindRemoteLocked(attr.ah_attr.grh.dgid,
                                (t.mask & IBV_QP_DEST_QPN) ? t.attr.dest_qp_num : qp->remote_qpn);
    PhysicalizeQpAttr(&attr, t.mask, remote);
    const int rc = backend_->ModifyQp(qp->real, &attr, t.mask);
    if (rc != 0) return rc;
  }
  return 0;
}

Status Shim::RecreateReal(const std::string& device) {
  int num = 0;
  ibv_device** list = backend_->GetDeviceList(&num);
  if (list == nullptr || num == 0) {
    if (list != nullptr) backend_->FreeDeviceList(list);
    return Error(Code::kUnavailable, "no RDMA device on this host");
  }
  ibv_device* dev = nullptr;
  for (int i = 0; i < num && dev == nullptr; ++i)
    if (device.empty() || device == list[i]->name) dev = list[i];
  if (dev == nullptr) {
    backend_->FreeDeviceList(list);
    return Error(Code::kNotFound, "no RDMA device named " + device);
  }
  HeldFdNumbers held(EventFds());
  Status st;
  for (const auto& [p, k] : shadows_) {
    if (k != Kind::kContext) continue;
    Context* ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
    ctx->real = backend_->OpenDevice(dev);
    if (ctx->real == nullptr) {
      st = Error(Code::kUnavailable, Errno("opening the RDMA device", errno));
      break;
    }
    ibv_context* s = Shadow(ctx);
    s->device = ctx->real->device;
    s->cmd_fd = ctx->real->cmd_fd;
    s->async_fd = held.Keep(ctx->real->async_fd, s->async_fd);
    ctx->real->async_fd = s->async_fd;
    KeepNonBlocking(s->async_fd, ctx->async_fd_flags);
    s->num_comp_vectors = ctx->real->num_comp_vectors;
    RelayWrites(ctx);
  }
  backend_->FreeDeviceList(list);
  if (!st.ok()) return st;

  for (Pd* pd : All<Pd>(Kind::kPd)) {
    pd->real = backend_->AllocPd(pd->ctx->real);
    if (pd->real == nullptr) return Error(Code::kResourceExhausted, Errno("ibv_alloc_pd", errno));
    pd->shadow.handle = pd->real->handle;
  }
  for (Mr* mr : All<Mr>(Kind::kMr)) {
    // Same address, same length: the memory came back where it was.
    mr->real =
        backend_->RegMr(mr->pd->real, mr->shadow.addr, mr->shadow.length, mr->iova, mr->access);
    if (mr->real == nullptr && errno == EFAULT) {
      TouchPages(mr->shadow.addr, mr->shadow.length);
      mr->real =
          backend_->RegMr(mr->pd->real, mr->shadow.addr, mr->shadow.length, mr->iova, mr->access);
    }
    if (mr->real == nullptr)
      return Error(Code::kResourceExhausted, Errno("re-registering a memory region", errno));
    mrs_.Set(mr->slot, mr->shadow.lkey, mr->real->lkey);
    if (mr->real->lkey != mr->shadow.lkey) KeysDiverged();
  }
  // Registered again: the pages are pinned, the release's lock is no
  // longer needed.
  for (const auto& [begin, end] : locked_registered_)
    munlock(reinterpret_cast<void*>(begin), end - begin);
  locked_registered_.clear();
  for (Channel* ch : All<Channel>(Kind::kChannel)) {
    ch->real = backend_->CreateCompChannel(ch->ctx->real);
    if (ch->real == nullptr)
      return Error(Code::kResourceExhausted, Errno("ibv_create_comp_channel", errno));
    ch->shadow.fd = held.Keep(ch->real->fd, ch->shadow.fd);
    ch->real->fd = ch->shadow.fd;
    KeepNonBlocking(ch->shadow.fd, ch->fd_flags);
    ReopenChannel(ch);
  }
  // The fds are back under their numbers; the application's epoll sets
  // lost them when the release closed them. A number that could not be
  // kept (KeepFdNumber) now names another file: not registered.
  const std::vector<int> now = EventFds();
  std::vector<EpollRegistration> again;
  for (const EpollRegistration& r : epoll_regs_)
    if (std::find(now.begin(), now.end(), r.fd) != now.end()) again.push_back(r);
  if (again.size() != epoll_regs_.size() || Reregister(again) != 0)
    LogOnce("restore: an event fd the application had in an epoll set is not in it again");
  epoll_regs_.clear();
  for (Cq* cq : All<Cq>(Kind::kCq)) {
    ibv_comp_channel* ch = cq->channel != nullptr ? cq->channel->real : nullptr;
    // With the slack it had, or less if this device's CQs are shallower.
    if (cq->extended) {
      ibv_cq_init_attr_ex attr{};
      attr.channel = ch;
      attr.comp_vector = static_cast<uint32_t>(cq->comp_vector);
      attr.wc_flags = cq->wc_flags;
      cq->real_ex = WithSlack(
          cq->cqe, cq->slack,
          [&](int n) {
            attr.cqe = static_cast<uint32_t>(n);
            return backend_->CreateCqEx(cq->ctx->real, &attr);
          },
          &cq->slack);
      cq->real = cq->real_ex != nullptr ? ibv_cq_ex_to_cq(cq->real_ex) : nullptr;
    } else {
      cq->real = WithSlack(
          cq->cqe, cq->slack,
          [&](int n) { return backend_->CreateCq(cq->ctx->real, n, nullptr, ch, cq->comp_vector); },
          &cq->slack);
    }
    if (cq->real == nullptr) return Error(Code::kResourceExhausted, Errno("ibv_create_cq", errno));
    cq->real->cq_context = cq;
    cq->real_poll_cq = cq->real->context->ops.poll_cq;
    cq->shadow.handle = cq->real->handle;
    {
      std::lock_guard<std::mutex> events(cq->events_mu);
      cq->events_closed = false;
    }
    // A thread may be waiting for an event on this CQ: arm it (a spurious
    // event is allowed; the application polls after each).
    if (ch != nullptr) cq->real->context->ops.req_notify_cq(cq->real, 0);
  }
  for (Srq* srq : All<Srq>(Kind::kSrq)) {
    ibv_srq_init_attr attr = srq->init;
    attr.srq_context = nullptr;
    srq->real = backend_->CreateSrq(srq->pd->real, &attr);
    if (srq->real == nullptr)
      return Error(Code::kResourceExhausted, Errno("ibv_create_srq", errno));
    srq->real->srq_context = srq;
    srq->real_post_srq_recv = srq->real->context->ops.post_srq_recv;
    srq->shadow.handle = srq->real->handle;
  }
  for (Qp* qp : All<Qp>(Kind::kQp)) {
    ibv_qp_init_attr_ex attr = qp->init;
    attr.pd = qp->pd->real;
    attr.send_cq = qp->send_cq ? qp->send_cq->real : nullptr;
    attr.recv_cq = qp->recv_cq ? qp->recv_cq->real : nullptr;
    attr.srq = qp->srq ? qp->srq->real : nullptr;
    attr.qp_context = nullptr;
    qp->real = backend_->CreateQpEx(qp->ctx->real, &attr);
    if (qp->real == nullptr) return Error(Code::kResourceExhausted, Errno("ibv_create_qp", errno));
    qp->real->qp_context = qp;
    qp->SetPhysicalQpn(qp->real->qp_num);
    qp->real_post_send = qp->real->context->ops.post_send;
    qp->real_post_recv = qp->real->context->ops.post_recv;
    if (qp->init.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) {
      qp->real_ex = backend_->QpToQpEx(qp->real);
      if (qp->real_ex != nullptr) InstallQpExOps(qp);
    }
    qp->shadow.qp_base.handle = qp->real->handle;
    if (!qp_index_.Insert(qp->physical_qpn, qp))
      return Error(Code::kResourceExhausted, "QP index full");
    if (const int rc = ReplayTransitions(qp); rc != 0)
      return Error(Code::kInternal, Errno("replaying a QP's transitions", rc));
    qp->shadow.qp_base.state = qp->real->state;
    for (const Qp::Group& g : qp->groups) {
      if (const int rc = backend_->AttachMcast(qp->real, &g.gid, g.lid); rc != 0)
        return Error(Code::kInternal, Errno("attaching a QP to its multicast group again", rc));
    }
  }
  for (Ah* ah : All<Ah>(Kind::kAh)) {
    ah->real = CreateHomeAhLocked(ah->pd, ah->attr);
    if (ah->real == nullptr) return Error(Code::kResourceExhausted, Errno("ibv_create_ah", errno));
    ah->shadow.handle = ah->real->handle;
    if (const int rc = RouteAhToAllLocked(ah); rc != 0)
      return Error(Code::kResourceExhausted, Errno("an address handle toward a moved peer", rc));
  }
  // The receives that were posted when the endpoint was released.
  for (Srq* srq : All<Srq>(Kind::kSrq)) {
    const int rc = Repost(&srq->recvs, &srq->outstanding, [srq](ibv_recv_wr* w, ibv_recv_wr** b) {
      return PostSrqRecvReal(srq, w, b);
    });
    if (rc != 0) return Error(Code::kInternal, Errno("re-posting SRQ receives", rc));
  }
  for (Qp* qp : All<Qp>(Kind::kQp)) {
    qp->reposted = static_cast<int64_t>(qp->outstanding.size());
    const int rc = Repost(qp->recvs, &qp->outstanding,
                          [qp](ibv_recv_wr* w, ibv_recv_wr** b) { return PostRecvReal(qp, w, b); });
    if (rc != 0) return Error(Code::kInternal, Errno("re-posting receives", rc));
  }
  if (endpoint_gid_known_) {
    Context* ctx = nullptr;
    for (const auto& [p, k] : shadows_)
      if (k == Kind::kContext) ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
    if (ctx != nullptr)
      backend_->QueryGid(ctx->real, endpoint_port_, endpoint_sgid_index_, &endpoint_physical_gid_);
  }
  return {};
}

Status Shim::RestoreNow(const std::string& device, const std::vector<RemoteMapping>& peers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!released_) return Error(Code::kFailedPrecondition, "restore needs a released endpoint");
  for (const RemoteMapping& m : peers) {
    std::unique_ptr<RemoteEndpoint> e = RemoteEndpoint::Build(m);
    if (e == nullptr) return Error(Code::kResourceExhausted, "out of memory for a peer's mapping");
    PublishRemoteLocked(std::move(e));
  }
  Status st = RecreateReal(device);
  if (!st.ok()) {
    // Nothing half-made stays: the endpoint is released as before, and a
    // later Restore (elsewhere, or here again) starts from the journal.
    DestroyReal();
    return st;
  }
  released_ = false;
  moved_ = true;
  // Completions carry the new QPNs: every CQ translates from now on.
  for (Cq* cq : All<Cq>(Kind::kCq)) CqTranslates(cq);
  for (Qp* qp : All<Qp>(Kind::kQp)) SetQpPath(qp, QpPath(*qp));
  for (const auto& [p, k] : shadows_)
    if (k == Kind::kContext)
      InstallTranslatingOps(AsContext(static_cast<ibv_context*>(const_cast<void*>(p))));
  gid_moved_.store(
      memcmp(endpoint_physical_gid_.raw, mode_.PhysicalGid(endpoint_virtual_gid_).raw, 16) != 0);
  return {};
}

Status Shim::ResumeNow() {
  std::lock_guard<std::mutex> lock(mu_);
  if (released_) return Error(Code::kFailedPrecondition, "the endpoint is released: restore first");
  if (!paused_) return {};
  Status st;
  // Under the queues' mutex until the gate opens: a post that found the
  // gate closed is replayed before any later one goes through.
  std::lock_guard<std::mutex> queues(pause_.queue_mu());
  if (LogMoves()) LogResume();
  for (Srq* srq : All<Srq>(Kind::kSrq)) {
    const int rc = Repost(&srq->recvs, &srq->queued_recvs, [srq](ibv_recv_wr* w, ibv_recv_wr** b) {
      return PostSrqRecvReal(srq, w, b);
    });
    if (rc != 0 && st.ok()) st = Error(Code::kInternal, Errno("posting queued SRQ receives", rc));
  }
  // Every queue's receives before any send: the application posted a
  // receive during the pause before a send to it (of another of its QPs,
  // or a peer's that waits for this one's), and a send replayed first
  // would find no receive (RNR) where it found one without the pause.
  const std::vector<Qp*> qps = All<Qp>(Kind::kQp);
  for (Qp* qp : qps) {
    const int rc = Repost(qp->recvs, &qp->queued_recvs,
                          [qp](ibv_recv_wr* w, ibv_recv_wr** b) { return PostRecvReal(qp, w, b); });
    if (rc != 0 && st.ok()) st = Error(Code::kInternal, Errno("posting queued receives", rc));
  }
  for (Qp* qp : qps) {
    for (QueuedSend& s : qp->queued_sends) {
      ibv_sge inline_sge;
      s.wr.next = nullptr;
      if (!s.inline_data.empty()) {
        inline_sge = {reinterpret_cast<uintptr_t>(s.inline_data.data()),
                      static_cast<uint32_t>(s.inline_data.size()), 0};
        s.wr.sg_list = &inline_sge;
        s.wr.num_sge = 1;
      } else {
        s.wr.sg_list = s.sge.data();
      }
      ibv_send_wr* bad = nullptr;
      const int rc = PostSendReal(qp, &s.wr, &bad);
      if (rc != 0 && st.ok()) st = Error(Code::kInternal, Errno("posting queued sends", rc));
    }
    qp->queued_sends.clear();
  }
  // The events owed go out once the data path is open: a waiter woken
  // earlier would poll a paused CQ, find nothing, and wait again.
  const std::vector<Cq*> owed = ArmForResume();
  for (Qp* qp : All<Qp>(Kind::kQp)) {
    qp->drained = false;
    qp->reposted = -1;
  }
  SetPaused(false);
  pause_.Open();
  paused_ = false;
  RestartItimers();
  OpenControl();
  OweEvents(owed);
  if (!st.ok()) LogOnce(st.message.c_str());
  return st;
}

Status Shim::Reconnect(Qp* qp) {
  // Reset (its receives still posted were counted from their flushes) and
  // brought up again toward the peer's new address with the transitions
  // the application made.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RESET;
  int rc = backend_->ModifyQp(qp->real, &attr, IBV_QP_STATE);
  if (rc != 0) return Error(Code::kInternal, Errno("resetting a QP", rc));
  rc = ReplayTransitions(qp);
  if (rc != 0) return Error(Code::kInternal, Errno("re-connecting a QP", rc));
  qp->reposted = static_cast<int64_t>(qp->outstanding.size());
  rc = Repost(qp->recvs, &qp->outstanding,
              [qp](ibv_recv_wr* w, ibv_recv_wr** b) { return PostRecvReal(qp, w, b); });
  if (rc != 0) return Error(Code::kInternal, Errno("re-posting receives", rc));
  return {};
}

Status Shim::PeerReconnectNow(const std::vector<RemoteMapping>& mappings, bool keep_paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return Error(Code::kFailedPrecondition, "the endpoint is released");
    if (!paused_) return Error(Code::kFailedPrecondition, "peer reconnect needs a paused endpoint");
    // Datagrams the peer sent from its old QPs may have come in since the
    // pause: into the shadow CQs now, their source translated through the
    // mapping of when they were sent. (A re-created QP can get the number
    // another QP of the peer had, at the same GID.)
    for (Cq* cq : All<Cq>(Kind::kCq)) {
      const int rc = DrainCq(cq, nullptr);
      if (rc < 0) return Error(Code::kInternal, Errno("polling a CQ before a peer reconnect", -rc));
    }
    // All published before any QP is brought up: a QP of one connected
    // to another (or to itself, as UCX makes them) resolves both ends
    // through where they are now.
    std::vector<const RemoteEndpoint*> published;
    for (const RemoteMapping& mapping : mappings) {
      std::unique_ptr<RemoteEndpoint> e = RemoteEndpoint::Build(mapping);
      if (e == nullptr)
        return Error(Code::kResourceExhausted, "out of memory for a peer's mapping");
      published.push_back(PublishRemoteLocked(std::move(e)));
    }
    std::vector<Qp*> toward;
    for (Qp* qp : All<Qp>(Kind::kQp)) {
      const uint32_t type = qp->shadow.qp_base.qp_type;
      const RemoteEndpoint* at = qp->remote.load();
      if ((type == IBV_QPT_RC || type == IBV_QPT_UC) &&
          std::find(published.begin(), published.end(), at) != published.end())
        toward.push_back(qp);
    }
    // To the error state together, their receives still posted counted
    // from their flushes; then each brought up again.
    FailAndCountRecvs(toward);
    for (Qp* qp : toward)
      if (Status st = Reconnect(qp); !st.ok()) return st;
    for (const RemoteEndpoint* r : published)
      for (Ah* ah : All<Ah>(Kind::kAh)) {
        if (const int rc = RouteAhLocked(ah, r); rc != 0)
          return Error(Code::kResourceExhausted,
                       Errno("an address handle toward the moved peer", rc));
      }
  }
  if (keep_paused) return {};
  return ResumeNow();
}

std::vector<int> Shim::EventFds() {
  std::vector<int> fds;
  for (const auto& [p, k] : shadows_)
    if (k == Kind::kContext)
      fds.push_back(Shadow(AsContext(static_cast<ibv_context*>(const_cast<void*>(p))))->async_fd);
  for (Channel* ch : All<Channel>(Kind::kChannel)) fds.push_back(ch->shadow.fd);
  return fds;
}

void Shim::RelayWrites(Context* ctx) {
  if (ctx->real->cmd_fd < 0) return;  // not a kernel device (a test's fake)
  std::string why;
  std::unique_ptr<WriteRelay> relay = WriteRelay::Create(ctx->real->cmd_fd, &why);
  if (relay == nullptr) {
    LogOnce(("restore: no write relay (" + why +
             "); threads other than the one that re-opened the device may not post on "
             "providers that ring their doorbell with write()")
                .c_str());
  } else if (!PublishRelay(relay.get())) {
    LogOnce("restore: more devices open than write relays; some threads may not post");
  } else {
    ctx->relay = relay.release();
  }
}

void Shim::DropRelay(Context* ctx) {
  if (ctx->relay == nullptr) return;
  WithdrawRelay(ctx->relay);
  delete ctx->relay;
  ctx->relay = nullptr;
}

// ib_uverbs refuses write() commands from a thread whose credentials are
// not the very ones the device file was opened with (ib_safe_file_access:
// "changed security contexts after opening file descriptor"). Threads
// share one credential object until CRIU restores them, each with its own.
// So once a process has been restored, the device is reopened, and every
// later step run, on an application thread: the next one to post or poll
// while paused picks the step up (data_path.cc), and its own posts then
// pass (providers such as rxe ring the doorbell with write()). If no
// application thread comes within app_thread_wait_ms_ (one blocked in
// ibv_get_cq_event, say) the control thread runs the step itself. A step
// taken up and never finished (a verb blocked in the kernel) is waited for
// within a bound, then said; no step starts while it runs.
Status Shim::OnAppThread(const char* name, std::function<Status()> step, int budget_ms) {
  if (!app_thread_steps_.load()) return RunStep(step);
  if (!step_.done.load(std::memory_order_acquire))
    return Error(Code::kUnavailable,
                 std::string("the shim's ") + step_.name +
                     " step is still running on an application thread; no other step starts "
                     "before it ends");
  step_.run = std::move(step);
  step_.name = name;
  step_.done.store(false);
  task_.store(&step_);
  WakeEventWaiters();
  for (int waited = 0; waited < app_thread_wait_ms_; ++waited) {
    if (step_.done.load(std::memory_order_acquire)) return step_.result;
    usleep(1000);
  }
  PendingStep* expected = &step_;
  if (task_.compare_exchange_strong(expected, nullptr)) {
    Status st = RunStep(step_.run);
    step_.done.store(true, std::memory_order_release);
    return st;
  }
  // An application thread is running it.
  const int limit = budget_ms + step_timeout_ms_;
  for (int waited = 0; waited < limit; ++waited) {
    if (step_.done.load(std::memory_order_acquire)) return step_.result;
    usleep(1000);
  }
  return Error(Code::kDeadlineExceeded,
               std::string("the ") + name + " step has run on an application thread for " +
                   std::to_string(limit) +
                   " ms without finishing (a verb blocked in the kernel?); the endpoint stays "
                   "as that step leaves it, and no other step starts before it ends");
}

void Shim::RunPendingStep() {
  PendingStep* p = task_.exchange(nullptr);
  if (p == nullptr) return;
  p->result = RunStep(p->run);
  steps_on_app_threads_.fetch_add(1);
  p->done.store(true, std::memory_order_release);
}

Shim::ControlScope::ControlScope(Shim* shim, bool applies, bool when_released) : shim_(shim) {
  if (!applies) return;
  entered_ = true;
  if (t_control_depth++ > 0 || t_in_step) return;
  std::unique_lock<std::mutex> lock(shim_->control_mu_);
  while (shim_->control_closed_ && !(when_released && shim_->control_idle_)) {
    if (shim_->step_pending()) {
      lock.unlock();
      shim_->RunPendingStep();
      lock.lock();
      continue;
    }
    shim_->control_waiters_.fetch_add(1);
    shim_->control_cv_.wait(lock, [this, when_released] {
      return !shim_->control_closed_ || (when_released && shim_->control_idle_) ||
             shim_->step_pending();
    });
    shim_->control_waiters_.fetch_sub(1);
  }
  ++shim_->control_inside_;
  counted_ = true;
}

Shim::ControlScope::~ControlScope() {
  if (!entered_) return;
  --t_control_depth;
  if (!counted_) return;
  std::lock_guard<std::mutex> lock(shim_->control_mu_);
  if (--shim_->control_inside_ == 0) shim_->control_cv_.notify_all();
}

Status Shim::CloseControl() {
  std::unique_lock<std::mutex> lock(control_mu_);
  control_closed_ = true;
  if (control_cv_.wait_for(lock, std::chrono::milliseconds(control_wait_ms_),
                           [this] { return control_inside_ == 0; }))
    return {};
  control_closed_ = false;
  control_cv_.notify_all();
  return Error(Code::kDeadlineExceeded,
               "an application thread's verbs call (other than a post or a poll) did not return "
               "within " +
                   std::to_string(control_wait_ms_) +
                   " ms; the endpoint was not released (it stays paused until resumed)");
}

void Shim::OpenControl() {
  std::lock_guard<std::mutex> lock(control_mu_);
  control_closed_ = false;
  control_idle_ = false;
  control_cv_.notify_all();
}

Status Shim::RunStep(const std::function<Status()>& step) {
  const bool outer = t_in_step;
  t_in_step = true;
  Status st = ControlBusy();
  if (st.ok()) st = step();
  ControlIdle();
  t_in_step = outer;
  return st;
}

Status Shim::ControlBusy() {
  std::unique_lock<std::mutex> lock(control_mu_);
  if (!control_closed_) return {};
  control_idle_ = false;
  if (control_cv_.wait_for(lock, std::chrono::milliseconds(control_wait_ms_),
                           [this] { return control_inside_ == 0; }))
    return {};
  control_idle_ = true;
  control_cv_.notify_all();
  return Error(Code::kDeadlineExceeded,
               "an application thread's destroy, deregistration or close did not return within " +
                   std::to_string(control_wait_ms_) + " ms; the step did not run");
}

void Shim::ControlIdle() {
  std::lock_guard<std::mutex> lock(control_mu_);
  control_idle_ = control_closed_;
  control_cv_.notify_all();
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
Status Shim::Restore(const std::string& device, const std::vector<RemoteMapping>& peers) {
  return OnAppThread("restore", [this, device, peers] { return RestoreNow(device, peers); });
}
Status Shim::Resume() {
  return OnAppThread("resume", [this] { return ResumeNow(); });
}
Status Shim::PeerReconnect(const std::vector<RemoteMapping>& mappings, bool keep_paused) {
  if (mappings.empty()) return Error(Code::kInvalidArgument, "peer reconnect without a mapping");
  return OnAppThread("peer reconnect", [this, mappings, keep_paused] {
    return PeerReconnectNow(mappings, keep_paused);
  });
}

EndpointView Shim::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  EndpointView v;
  v.paused = paused_;
  v.released = released_;
  v.has_gid = endpoint_gid_known_;
  v.virtual_gid = endpoint_virtual_gid_;
  v.physical_gid = endpoint_physical_gid_;
  // A process that named no GID yet is shown at the one its pause will
  // guess (nothing recorded: a later QP or AH may still name its own), so
  // that a move can tell its peers' hosts which endpoint it pauses them for.
  Context* ctx;
  int index;
  if (!v.has_gid && GuessGid(&ctx, &index, &v.physical_gid)) {
    v.has_gid = true;
    v.virtual_gid = mode_.VirtualGid(v.physical_gid);
  }
  for (const auto& [p, k] : shadows_) {
    switch (k) {
      case Kind::kContext: {
        ++v.devices;
        const Context* ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
        if (ctx->real != nullptr && ctx->real->device != nullptr)
          v.device = ctx->real->device->name;
        break;
      }
      case Kind::kPd:
        ++v.pds;
        break;
      case Kind::kMr: {
        const Mr* mr = static_cast<const Mr*>(p);
        ++v.mrs;
        v.registered_bytes += mr->shadow.length;
        if (mr->real != nullptr) v.rkeys.emplace_back(mr->shadow.rkey, mr->real->rkey);
        break;
      }
      case Kind::kCq: {
        const Cq* cq = static_cast<const Cq*>(p);
        ++v.cqs;
        v.pending_completions += cq->pending_count - cq->pending_head.load();
        break;
      }
      case Kind::kSrq:
        ++v.srqs;
        break;
      case Kind::kQp: {
        const Qp* qp = static_cast<const Qp*>(p);
        ++v.qps;
        QpView q;
        q.virtual_qpn = qp->shadow.qp_base.qp_num;
        q.physical_qpn = qp->physical_qpn;
        q.qp_type = qp->shadow.qp_base.qp_type;
        q.state = qp->shadow.qp_base.state;
        for (const QpTransition& t : qp->transitions) {
          if (t.mask & IBV_QP_DEST_QPN) q.remote_virtual_qpn = t.attr.dest_qp_num;
          if ((t.mask & IBV_QP_AV) && t.attr.ah_attr.is_global) q.connected = true;
        }
        if (q.connected) {
          q.remote_virtual_gid = qp->remote_gid;
          const RemoteEndpoint* r = qp->remote.load();
          q.remote_physical_gid = r ? r->physical_gid() : mode_.PhysicalGid(qp->remote_gid);
        }
        q.outstanding_recvs = static_cast<uint32_t>(qp->outstanding.size());
        q.queued_sends = static_cast<uint32_t>(qp->queued_sends.size());
        if (qp->real != nullptr) v.qpns.emplace_back(q.virtual_qpn, qp->physical_qpn);
        v.qp_list.push_back(q);
        break;
      }
      case Kind::kAh: {
        const Ah* ah = static_cast<const Ah*>(p);
        ++v.ahs;
        if (!ah->attr.is_global) break;
        const RemoteEndpoint* r = FindRemoteLocked(ah->attr.grh.dgid);
        const ibv_gid g = r ? r->physical_gid() : mode_.PhysicalGid(ah->attr.grh.dgid);
        auto same = [&g](const ibv_gid& o) { return memcmp(o.raw, g.raw, 16) == 0; };
        if (std::none_of(v.ud_peer_physical_gids.begin(), v.ud_peer_physical_gids.end(), same))
          v.ud_peer_physical_gids.push_back(g);
        break;
      }
      case Kind::kChannel:
        break;
    }
  }
  return v;
}

}  // namespace rdmavirt::shim
