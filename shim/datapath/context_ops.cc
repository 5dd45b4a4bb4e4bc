// The shim's entries installed in shadow objects (context_ops.h): which
// post/poll entry of data_path.cc each kind of process gets, and the
// context's own ops, which pass into the Shim.
#include "shim/datapath/context_ops.h"

#include <errno.h>

#include <atomic>

#include "shim/core/log.h"
#include "shim/core/shim.h"
#include "shim/datapath/data_path.h"

namespace rdmavirt::shim {
namespace {

// Refused: PlainQp relies on it (no rkey of the process can be
// invalidated by a peer).
ibv_mw* AllocMwUnsupported(ibv_pd*, ibv_mw_type) {
  LogOnce("memory windows are not supported (ibv_alloc_mw: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}

// ---------------------------------------------------------------- context

int QueryPortOp(ibv_context* c, uint8_t port, ibv_port_attr* attr, size_t size) {
  return AsContext(c)->shim->QueryPort(c, port, attr, size);
}
int QueryDeviceExOp(ibv_context* c, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t size) {
  return AsContext(c)->shim->QueryDeviceEx(c, input, attr, size);
}
ibv_cq_ex* CreateCqExOp(ibv_context* c, ibv_cq_init_attr_ex* attr) {
  return AsContext(c)->shim->CreateCqEx(c, attr);
}
ibv_qp* CreateQpExOp(ibv_context* c, ibv_qp_init_attr_ex* attr) {
  return AsContext(c)->shim->CreateQpEx(c, attr);
}
ibv_xrcd* OpenXrcdUnsupported(ibv_context*, ibv_xrcd_init_attr*) {
  LogOnce("XRC is not supported (ibv_open_xrcd: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}
int CloseXrcdUnsupported(ibv_xrcd*) { return EOPNOTSUPP; }
ibv_srq* CreateSrqExUnsupported(ibv_context*, ibv_srq_init_attr_ex*) {
  LogOnce("XRC and tag-matching SRQs are not supported (ibv_create_srq_ex: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}
ibv_qp* OpenQpUnsupported(ibv_context*, ibv_qp_open_attr*) {
  LogOnce("ibv_open_qp (XRC) is not supported");
  errno = EOPNOTSUPP;
  return nullptr;
}

}  // namespace

void InstallContextOps(Context* ctx, bool pausable, bool probed) {
  ibv_context* s = Shadow(ctx);
  const PostPollEntries& e = !pausable ? kDirectEntries
                             : probed  ? kProbedEntries
                                       : kPausableEntries;
  s->ops.post_send = e.post_send;
  s->ops.post_recv = e.post_recv;
  s->ops.post_srq_recv = e.post_srq_recv;
  s->ops.poll_cq = e.poll_cq;
  s->ops.req_notify_cq = kReqNotifyCq;
  s->ops.alloc_mw = AllocMwUnsupported;
  // Extended verbs find these through verbs_get_ctx_op(); ops left null
  // make the inline verbs fail with EOPNOTSUPP, as on a device without them.
  s->abi_compat = __VERBS_ABI_IS_EXTENDED;
  verbs_context& v = ctx->vctx;
  v.sz = sizeof(verbs_context);
  v.query_port = QueryPortOp;
  v.query_device_ex = QueryDeviceExOp;
  v.create_cq_ex = CreateCqExOp;
  v.create_qp_ex = CreateQpExOp;
  v.create_srq_ex = CreateSrqExUnsupported;
  v.open_xrcd = OpenXrcdUnsupported;
  v.close_xrcd = CloseXrcdUnsupported;
  v.open_qp = OpenQpUnsupported;
}

void InstallTranslatingOps(Context* ctx) {
  ibv_context* s = Shadow(ctx);
  // Not migratable: never paused, so one pointer for good.
  if (s->ops.post_send == kDirectEntries.post_send)
    s->ops.post_send = kTranslatingFirstEntries.post_send;
  if (s->ops.poll_cq == kDirectEntries.poll_cq) s->ops.poll_cq = kTranslatingFirstEntries.poll_cq;
  if (s->ops.post_send != kProbedEntries.post_send) return;  // not probed, or swapped already
  // One pointer each, which application threads may be reading: either
  // entry is right on every path, only faster on its own.
  const PostPollEntries& t = kProbedTranslatingEntries;
  std::atomic_ref(s->ops.post_send).store(t.post_send, std::memory_order_relaxed);
  std::atomic_ref(s->ops.post_recv).store(t.post_recv, std::memory_order_relaxed);
  std::atomic_ref(s->ops.post_srq_recv).store(t.post_srq_recv, std::memory_order_relaxed);
  std::atomic_ref(s->ops.poll_cq).store(t.poll_cq, std::memory_order_relaxed);
}

// Only what the provider implements: a null entry stays null, as it is.
#define RDMAVIRT_SET(field, fn) s.field = r->field ? entries.field : nullptr;

void InstallQpExOps(Qp* qp) {
  const ibv_qp_ex* r = qp->real_ex;
  const ibv_qp_ex& entries = kQpExEntries;
  ibv_qp_ex& s = qp->shadow;
  s.comp_mask = r->comp_mask;
  RDMAVIRT_QP_EX_ENTRIES(RDMAVIRT_SET)
}

void InstallCqExOps(Cq* cq) {
  const ibv_cq_ex* r = cq->real_ex;
  const ibv_cq_ex& entries = kCqExEntries;
  ibv_cq_ex& s = cq->shadow;
  s.comp_mask = r->comp_mask;
  RDMAVIRT_CQ_EX_ENTRIES(RDMAVIRT_SET)
}

#undef RDMAVIRT_SET

}  // namespace rdmavirt::shim
