// The restore half of a migration: re-create every hardware resource under
// the same virtual identities, re-post the receives the release counted,
// replay the posts queued during the pause (resume), and re-connect QPs
// toward peers that moved. See restore.h for what it owns and shim.h for
// each step's contract.
//
// Every step runs with the shim's mutex held, on an application thread
// once the process was restored by CRIU (control_gate.h says why).
#include "shim/migration/restore.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>

#include "shim/core/log.h"
#include "shim/datapath/context_ops.h"
#include "shim/datapath/data_path.h"
#include "shim/datapath/write_relay.h"
#include "shim/migration/epoll_regs.h"
#include "shim/migration/step_util.h"

namespace rdmavirt::shim {

namespace {

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

}  // namespace

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
    qp->pause->queue_mu().AssertHeld();  // ResumeNow holds pause_'s
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

void Shim::ReopenChannel(Channel* ch) {
  std::lock_guard<std::mutex> lock(ch->mu);
  ch->released = false;
  ch->cv.notify_all();
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

// The sequence of a restore: every hardware resource again, parents
// before children, under the identities and fd numbers the application
// knows, then what the release took out of the queues. A failing step
// leaves what it made to the caller's DestroyReal.
Status Shim::RecreateReal(const std::string& device) {
  ibv_device** list = nullptr;
  ibv_device* dev = nullptr;
  if (Status st = FindDevice(device, &list, &dev); !st.ok()) return st;
  HeldFdNumbers held(EventFds());
  Status st = OpenContexts(dev, &held);
  backend_->FreeDeviceList(list);
  if (!st.ok()) return st;
  if (st = RecreatePds(); !st.ok()) return st;
  if (st = ReregisterMrs(); !st.ok()) return st;
  UnlockRegistered();
  if (st = RecreateChannels(&held); !st.ok()) return st;
  RegisterEventFdsAgain();
  if (st = RecreateCqs(); !st.ok()) return st;
  if (st = RecreateSrqs(); !st.ok()) return st;
  if (st = RecreateQps(); !st.ok()) return st;
  if (st = RecreateAhs(); !st.ok()) return st;
  if (st = RepostOutstanding(); !st.ok()) return st;
  RefreshEndpointGid();
  return {};
}

Status Shim::FindDevice(const std::string& device, ibv_device*** list, ibv_device** dev) {
  int num = 0;
  *list = backend_->GetDeviceList(&num);
  if (*list == nullptr || num == 0) {
    if (*list != nullptr) backend_->FreeDeviceList(*list);
    return Error(Code::kUnavailable, "no RDMA device on this host");
  }
  for (int i = 0; i < num && *dev == nullptr; ++i)
    if (device.empty() || device == (*list)[i]->name) *dev = (*list)[i];
  if (*dev == nullptr) {
    backend_->FreeDeviceList(*list);
    return Error(Code::kNotFound, "no RDMA device named " + device);
  }
  return {};
}

Status Shim::OpenContexts(ibv_device* dev, HeldFdNumbers* held) {
  for (const auto& [p, k] : Shadows()) {
    if (k != Kind::kContext) continue;
    Context* ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
    ctx->real = backend_->OpenDevice(dev);
    if (ctx->real == nullptr)
      return Error(Code::kUnavailable, Errno("opening the RDMA device", errno));
    ibv_context* s = Shadow(ctx);
    s->device = ctx->real->device;
    s->cmd_fd = ctx->real->cmd_fd;
    s->async_fd = held->Keep(ctx->real->async_fd, s->async_fd);
    ctx->real->async_fd = s->async_fd;
    KeepNonBlocking(s->async_fd, ctx->async_fd_flags);
    s->num_comp_vectors = ctx->real->num_comp_vectors;
    RelayWrites(ctx);
  }
  return {};
}

Status Shim::RecreatePds() {
  for (Pd* pd : All<Pd>(Kind::kPd)) {
    pd->real = backend_->AllocPd(pd->ctx->real);
    if (pd->real == nullptr) return Error(Code::kResourceExhausted, Errno("ibv_alloc_pd", errno));
    pd->shadow.handle = pd->real->handle;
  }
  return {};
}

Status Shim::ReregisterMrs() {
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
  return {};
}

// Registered again: the pages are pinned, the release's lock is no longer
// needed.
void Shim::UnlockRegistered() {
  for (const auto& [begin, end] : locked_registered_)
    munlock(reinterpret_cast<void*>(begin), end - begin);
  locked_registered_.clear();
}

Status Shim::RecreateChannels(HeldFdNumbers* held) {
  for (Channel* ch : All<Channel>(Kind::kChannel)) {
    ch->real = backend_->CreateCompChannel(ch->ctx->real);
    if (ch->real == nullptr)
      return Error(Code::kResourceExhausted, Errno("ibv_create_comp_channel", errno));
    ch->shadow.fd = held->Keep(ch->real->fd, ch->shadow.fd);
    ch->real->fd = ch->shadow.fd;
    KeepNonBlocking(ch->shadow.fd, ch->fd_flags);
    ReopenChannel(ch);
  }
  return {};
}

// The fds are back under their numbers; the application's epoll sets
// lost them when the release closed them. A number that could not be
// kept (KeepFdNumber) now names another file: not registered.
void Shim::RegisterEventFdsAgain() {
  const std::vector<int> now = EventFds();
  std::vector<EpollRegistration> again;
  for (const EpollRegistration& r : epoll_regs_)
    if (std::find(now.begin(), now.end(), r.fd) != now.end()) again.push_back(r);
  if (again.size() != epoll_regs_.size() || Reregister(again) != 0)
    LogOnce("restore: an event fd the application had in an epoll set is not in it again");
  epoll_regs_.clear();
}

Status Shim::RecreateCqs() {
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
      MutexLock events(&cq->events_mu);
      cq->events_closed = false;
    }
    // A thread may be waiting for an event on this CQ: arm it (a spurious
    // event is allowed; the application polls after each).
    if (ch != nullptr) cq->real->context->ops.req_notify_cq(cq->real, 0);
  }
  return {};
}

Status Shim::RecreateSrqs() {
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
  return {};
}

// Each QP made again, brought back to its state by the transitions the
// application made, and attached to its multicast groups.
Status Shim::RecreateQps() {
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
    qp->repointed_at = nullptr;
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
  return {};
}

Status Shim::RecreateAhs() {
  for (Ah* ah : All<Ah>(Kind::kAh)) {
    ah->real = CreateHomeAhLocked(ah->pd, ah->attr);
    if (ah->real == nullptr) return Error(Code::kResourceExhausted, Errno("ibv_create_ah", errno));
    ah->shadow.handle = ah->real->handle;
    if (const int rc = RouteAhToAllLocked(ah); rc != 0)
      return Error(Code::kResourceExhausted, Errno("an address handle toward a moved peer", rc));
  }
  return {};
}

// The receives that were posted when the endpoint was released.
Status Shim::RepostOutstanding() {
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
  return {};
}

// The endpoint's physical GID on the device it is on now.
void Shim::RefreshEndpointGid() {
  if (!endpoint_gid_known_) return;
  Context* ctx = nullptr;
  for (const auto& [p, k] : Shadows())
    if (k == Kind::kContext) ctx = AsContext(static_cast<ibv_context*>(const_cast<void*>(p)));
  if (ctx != nullptr)
    backend_->QueryGid(ctx->real, endpoint_port_, endpoint_sgid_index_, &endpoint_physical_gid_);
}

Status Shim::RestoreNow(const std::string& device, const std::vector<RemoteMapping>& peers) {
  MutexLock lock(&mu_);
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
  for (const auto& [p, k] : Shadows())
    if (k == Kind::kContext)
      InstallTranslatingOps(AsContext(static_cast<ibv_context*>(const_cast<void*>(p))));
  gid_moved_.store(
      memcmp(endpoint_physical_gid_.raw, mode_.PhysicalGid(endpoint_virtual_gid_).raw, 16) != 0);
  return {};
}

// The posts queued during the pause, in order: every queue's receives
// before any send. The first failure, after trying them all.
Status Shim::ReplayQueuedPosts() {
  Status st;
  for (Srq* srq : All<Srq>(Kind::kSrq)) {
    srq->pause->queue_mu().AssertHeld();  // it is pause_'s, which the caller holds
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
    qp->pause->queue_mu().AssertHeld();  // it is pause_'s, which the caller holds
    const int rc = Repost(qp->recvs, &qp->queued_recvs,
                          [qp](ibv_recv_wr* w, ibv_recv_wr** b) { return PostRecvReal(qp, w, b); });
    if (rc != 0 && st.ok()) st = Error(Code::kInternal, Errno("posting queued receives", rc));
  }
  for (Qp* qp : qps) {
    qp->pause->queue_mu().AssertHeld();  // it is pause_'s, which the caller holds
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
  return st;
}

Status Shim::ResumeNow() {
  MutexLock lock(&mu_);
  if (released_) return Error(Code::kFailedPrecondition, "the endpoint is released: restore first");
  if (!paused_) return {};
  // Under the queues' mutex until the gate opens: a post that found the
  // gate closed is replayed before any later one goes through.
  MutexLock queues(&pause_.queue_mu());
  if (LogMoves()) LogResume();
  Status st = ReplayQueuedPosts();
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
  qp->repointed_at = qp->remote.load(std::memory_order_relaxed);
  return {};
}

Status Shim::PeerReconnectNow(const std::vector<RemoteMapping>& mappings, bool keep_paused) {
  {
    MutexLock lock(&mu_);
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
      if ((type != IBV_QPT_RC && type != IBV_QPT_UC) ||
          std::find(published.begin(), published.end(), at) == published.end())
        continue;
      // Brought up toward that very QP by an earlier re-point: it is
      // connected to it already (Qp::repointed_at).
      if (qp->repointed_at != nullptr && qp->repointed_at->SamePlaceFor(*at, qp->remote_qpn)) {
        qp->repointed_at = at;
        continue;
      }
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

}  // namespace rdmavirt::shim
