#include "tests/bench/null_backend.h"

#include <errno.h>

#include <algorithm>
#include <cstring>

namespace rdmavirt::bench {
namespace {

// Verbs that return a pointer or -1 report failure in errno; the others
// return the errno value itself (libibverbs' conventions).
template <typename T>
T* Unsupported(int err = ENOSYS) {
  errno = err;
  return nullptr;
}
int Failed(int err = ENOSYS) {
  errno = err;
  return -1;
}

}  // namespace

NullBackend::NullBackend() {
  device_.node_type = IBV_NODE_CA;
  device_.transport_type = IBV_TRANSPORT_IB;
  std::strncpy(device_.name, "null0", sizeof(device_.name) - 1);
  std::strncpy(device_.dev_name, "uverbs_null0", sizeof(device_.dev_name) - 1);
}

NullBackend::~NullBackend() = default;

template <typename T>
T* NullBackend::Keep(std::vector<std::unique_ptr<T>>* list) {
  list->push_back(std::make_unique<T>());
  return list->back().get();
}

template <typename T>
bool NullBackend::Release(std::vector<std::unique_ptr<T>>* list, const void* p) {
  auto it = std::find_if(list->begin(), list->end(),
                         [p](const std::unique_ptr<T>& e) { return e.get() == p; });
  if (it == list->end()) return false;
  list->erase(it);
  return true;
}

// ---------------------------------------------------------------- data path

int NullBackend::PostSendOp(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr**) {
  reinterpret_cast<NullQp*>(qp)->last_send_wr_id = wr->wr_id;
  return 0;
}

int NullBackend::PostRecvOp(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr**) {
  reinterpret_cast<NullQp*>(qp)->last_recv_wr_id = wr->wr_id;
  return 0;
}

int NullBackend::PollCqOp(ibv_cq* cq, int n, ibv_wc* wc) {
  const NullCq* c = reinterpret_cast<const NullCq*>(cq);
  if (n < 1 || c->qp == nullptr) return 0;
  *wc = ibv_wc{};
  wc->status = IBV_WC_SUCCESS;
  if (c->recv) {
    wc->wr_id = c->qp->last_recv_wr_id;
    wc->opcode = IBV_WC_RECV;
    wc->byte_len = 64;
  } else {
    wc->wr_id = c->qp->last_send_wr_id;
    wc->opcode = IBV_WC_SEND;
  }
  wc->qp_num = c->qp->qp.qp_num;
  return 1;
}

int NullBackend::ReqNotifyCqOp(ibv_cq*, int) { return 0; }

// ---------------------------------------------------------------- devices

ibv_device** NullBackend::GetDeviceList(int* num) {
  if (num != nullptr) *num = 1;
  return device_list_;
}

void NullBackend::FreeDeviceList(ibv_device**) {}

ibv_context* NullBackend::OpenDevice(ibv_device* device) {
  if (device != &device_) return Unsupported<ibv_context>(ENODEV);
  ibv_context* ctx = Keep(&contexts_);
  ctx->device = device;
  ctx->cmd_fd = -1;
  ctx->async_fd = -1;
  ctx->num_comp_vectors = 1;
  ctx->ops.post_send = PostSendOp;
  ctx->ops.post_recv = PostRecvOp;
  ctx->ops.poll_cq = PollCqOp;
  ctx->ops.req_notify_cq = ReqNotifyCqOp;
  return ctx;
}

int NullBackend::CloseDevice(ibv_context* ctx) { return Release(&contexts_, ctx) ? 0 : EINVAL; }

int NullBackend::GetAsyncEvent(ibv_context*, ibv_async_event*) { return Failed(); }
void NullBackend::AckAsyncEvent(ibv_async_event*) {}

// ---------------------------------------------------------------- queries

int NullBackend::QueryDevice(ibv_context*, ibv_device_attr*) { return ENOSYS; }
int NullBackend::QueryPort(ibv_context*, uint8_t, ibv_port_attr*) { return ENOSYS; }
int NullBackend::QueryGid(ibv_context*, uint8_t, int, ibv_gid*) { return Failed(); }
int NullBackend::QueryGidEx(ibv_context*, uint32_t, uint32_t, ibv_gid_entry*, uint32_t, size_t) {
  return ENOSYS;
}
ssize_t NullBackend::QueryGidTable(ibv_context*, ibv_gid_entry*, size_t, uint32_t, size_t) {
  return -ENOSYS;
}
int NullBackend::QueryPkey(ibv_context*, uint8_t, int, __be16*) { return Failed(); }
int NullBackend::GetPkeyIndex(ibv_context*, uint8_t, __be16) { return Failed(); }

// ---------------------------------------------------------------- PD, MR

ibv_pd* NullBackend::AllocPd(ibv_context* ctx) {
  ibv_pd* pd = Keep(&pds_);
  pd->context = ctx;
  pd->handle = static_cast<uint32_t>(pds_.size());
  return pd;
}

int NullBackend::DeallocPd(ibv_pd* pd) { return Release(&pds_, pd) ? 0 : EINVAL; }

ibv_mr* NullBackend::RegMr(ibv_pd* pd, void* addr, size_t length, uint64_t, unsigned int) {
  ibv_mr* mr = Keep(&mrs_);
  mr->context = pd->context;
  mr->pd = pd;
  mr->addr = addr;
  mr->length = length;
  mr->handle = next_mr_index_;
  mr->lkey = next_mr_index_ << 8 | kKeyTag;
  mr->rkey = mr->lkey;
  ++next_mr_index_;
  return mr;
}

int NullBackend::ReregMr(ibv_mr*, int, ibv_pd*, void*, size_t, int) { return ENOSYS; }

int NullBackend::DeregMr(ibv_mr* mr) { return Release(&mrs_, mr) ? 0 : EINVAL; }

// ---------------------------------------------------------------- CQ

ibv_comp_channel* NullBackend::CreateCompChannel(ibv_context*) {
  return Unsupported<ibv_comp_channel>();
}
int NullBackend::DestroyCompChannel(ibv_comp_channel*) { return ENOSYS; }

ibv_cq* NullBackend::CreateCq(ibv_context* ctx, int cqe, void* cq_context,
                              ibv_comp_channel* channel, int) {
  if (channel != nullptr) return Unsupported<ibv_cq>(EINVAL);
  NullCq* c = Keep(&cqs_);
  c->cq.context = ctx;
  c->cq.cq_context = cq_context;
  c->cq.cqe = cqe;
  c->cq.handle = static_cast<uint32_t>(cqs_.size());
  return &c->cq;
}

ibv_cq_ex* NullBackend::CreateCqEx(ibv_context*, ibv_cq_init_attr_ex*) {
  return Unsupported<ibv_cq_ex>(EOPNOTSUPP);
}
int NullBackend::ResizeCq(ibv_cq*, int) { return ENOSYS; }
int NullBackend::DestroyCq(ibv_cq* cq) { return Release(&cqs_, cq) ? 0 : EINVAL; }
int NullBackend::GetCqEvent(ibv_comp_channel*, ibv_cq**, void**) { return Failed(); }
void NullBackend::AckCqEvents(ibv_cq*, unsigned int) {}

// ---------------------------------------------------------------- SRQ

ibv_srq* NullBackend::CreateSrq(ibv_pd*, ibv_srq_init_attr*) { return Unsupported<ibv_srq>(); }
int NullBackend::ModifySrq(ibv_srq*, ibv_srq_attr*, int) { return ENOSYS; }
int NullBackend::QuerySrq(ibv_srq*, ibv_srq_attr*) { return ENOSYS; }
int NullBackend::DestroySrq(ibv_srq*) { return ENOSYS; }

// ---------------------------------------------------------------- QP

ibv_qp* NullBackend::CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  ibv_qp_init_attr_ex ex = shim::ToInitAttrEx(pd, *attr);
  return CreateQpEx(pd->context, &ex);
}

ibv_qp* NullBackend::CreateQpEx(ibv_context* ctx, ibv_qp_init_attr_ex* attr) {
  if (attr->comp_mask != IBV_QP_INIT_ATTR_PD || attr->pd == nullptr) {
    return Unsupported<ibv_qp>(EOPNOTSUPP);  // no ibv_qp_ex, XRC, RSS ...
  }
  if (attr->qp_type != IBV_QPT_RC && attr->qp_type != IBV_QPT_UC && attr->qp_type != IBV_QPT_UD) {
    return Unsupported<ibv_qp>(EOPNOTSUPP);
  }
  if (attr->srq != nullptr) return Unsupported<ibv_qp>(EINVAL);  // no SRQs here
  NullQp* q = Keep(&qps_);
  ibv_qp* qp = &q->qp;
  qp->context = ctx;
  qp->qp_context = attr->qp_context;
  qp->pd = attr->pd;
  qp->send_cq = attr->send_cq;
  qp->recv_cq = attr->recv_cq;
  qp->handle = next_qpn_;
  qp->qp_num = next_qpn_++;
  qp->state = IBV_QPS_RESET;
  qp->qp_type = attr->qp_type;
  // The last QP created on a CQ is the one its completions name.
  // The receive CQ's role wins when both are the same CQ.
  if (attr->send_cq != nullptr) {
    NullCq* c = reinterpret_cast<NullCq*>(attr->send_cq);
    c->qp = q;
    c->recv = false;
  }
  if (attr->recv_cq != nullptr) {
    NullCq* c = reinterpret_cast<NullCq*>(attr->recv_cq);
    c->qp = q;
    c->recv = true;
  }
  return qp;
}

ibv_qp_ex* NullBackend::QpToQpEx(ibv_qp*) { return Unsupported<ibv_qp_ex>(EOPNOTSUPP); }

int NullBackend::ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  if (mask & IBV_QP_STATE) qp->state = attr->qp_state;
  return 0;
}

int NullBackend::QueryQp(ibv_qp*, ibv_qp_attr*, int, ibv_qp_init_attr*) { return ENOSYS; }

int NullBackend::DestroyQp(ibv_qp* qp) {
  for (auto& cq : cqs_) {
    if (cq->qp != nullptr && &cq->qp->qp == qp) cq->qp = nullptr;
  }
  return Release(&qps_, qp) ? 0 : EINVAL;
}

// ---------------------------------------------------------------- AH

ibv_ah* NullBackend::CreateAh(ibv_pd*, ibv_ah_attr*) { return Unsupported<ibv_ah>(); }
int NullBackend::InitAhFromWc(ibv_context*, uint8_t, ibv_wc*, ibv_grh*, ibv_ah_attr*) {
  return ENOSYS;
}
int NullBackend::DestroyAh(ibv_ah*) { return ENOSYS; }
int NullBackend::AttachMcast(ibv_qp*, const ibv_gid*, uint16_t) { return ENOSYS; }
int NullBackend::DetachMcast(ibv_qp*, const ibv_gid*, uint16_t) { return ENOSYS; }

}  // namespace rdmavirt::bench
