// The shim's C ABI: every exported libibverbs entry point that takes or
// returns a verbs object, forwarding to the process's Shim. Nothing else
// in the shim is visible outside it (librdmavirt.map). Which exports are
// defined here, and why the others need not be, is shim/exports.cc.
//
// The inline verbs of verbs.h (post/poll, the extended API) never reach
// this file: they dispatch through the shadow objects (data_path.cc).
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stddef.h>

#include "shim/core/log.h"
#include "shim/core/shim.h"
#include "shim/migration/control.h"

// verbs.h turns these names into inline wrappers; the shim defines the
// exported functions behind them.
#undef ibv_reg_mr
#undef ibv_reg_mr_iova
#undef ibv_query_port

using rdmavirt::shim::LogOnce;
using rdmavirt::shim::Shim;

namespace {

// The shim, or nullptr with errno ENOSYS when libibverbs cannot be loaded.
inline Shim* S() {
  Shim* s = Shim::Process();
  if (s == nullptr) errno = ENOSYS;
  return s;
}

}  // namespace

#define RDMAVIRT_API extern "C" __attribute__((visibility("default")))

RDMAVIRT_API ibv_device** ibv_get_device_list(int* num) {
  Shim* s = S();
  if (s == nullptr) {
    if (num != nullptr) *num = 0;
    return nullptr;
  }
  return s->GetDeviceList(num);
}
RDMAVIRT_API void ibv_free_device_list(ibv_device** list) {
  if (Shim* s = S()) s->FreeDeviceList(list);
}
RDMAVIRT_API ibv_context* ibv_open_device(ibv_device* device) {
  Shim* s = S();
  ibv_context* ctx = s ? s->OpenDevice(device) : nullptr;
  if (ctx != nullptr && s->migratable()) StartControl(s);
  return ctx;
}
RDMAVIRT_API int ibv_close_device(ibv_context* ctx) {
  Shim* s = S();
  return s ? s->CloseDevice(ctx) : -1;
}
RDMAVIRT_API int ibv_get_async_event(ibv_context* ctx, ibv_async_event* event) {
  Shim* s = S();
  return s ? s->GetAsyncEvent(ctx, event) : -1;
}
RDMAVIRT_API void ibv_ack_async_event(ibv_async_event* event) {
  if (Shim* s = S()) s->AckAsyncEvent(event);
}
RDMAVIRT_API int ibv_query_device(ibv_context* ctx, ibv_device_attr* attr) {
  Shim* s = S();
  return s ? s->QueryDevice(ctx, attr) : ENOSYS;
}
// The exported ibv_query_port fills the older, shorter struct (programs
// built against current headers use the verbs_context entry instead).
RDMAVIRT_API int ibv_query_port(ibv_context* ctx, uint8_t port,
                                struct _compat_ibv_port_attr* attr) {
  Shim* s = S();
  return s ? s->QueryPort(ctx, port, reinterpret_cast<ibv_port_attr*>(attr),
                          offsetof(ibv_port_attr, port_cap_flags2))
           : ENOSYS;
}
RDMAVIRT_API int ibv_query_gid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) {
  Shim* s = S();
  return s ? s->QueryGid(ctx, port, index, gid) : -1;
}
RDMAVIRT_API int _ibv_query_gid_ex(ibv_context* ctx, uint32_t port, uint32_t index,
                                   ibv_gid_entry* entry, uint32_t flags, size_t size) {
  Shim* s = S();
  return s ? s->QueryGidEx(ctx, port, index, entry, flags, size) : ENOSYS;
}
RDMAVIRT_API ssize_t _ibv_query_gid_table(ibv_context* ctx, ibv_gid_entry* entries, size_t max,
                                          uint32_t flags, size_t size) {
  Shim* s = S();
  return s ? s->QueryGidTable(ctx, entries, max, flags, size) : -ENOSYS;
}
RDMAVIRT_API int ibv_query_pkey(ibv_context* ctx, uint8_t port, int index, __be16* pkey) {
  Shim* s = S();
  return s ? s->QueryPkey(ctx, port, index, pkey) : -1;
}
// A private export (IBVERBS_PRIVATE_NN), called by rdma-core's own tools
// and bindings (pyverbs): `type` points to an enum ibv_gid_type_sysfs.
RDMAVIRT_API int ibv_query_gid_type(ibv_context* ctx, uint8_t port, unsigned int index, int* type) {
  Shim* s = S();
  return s ? s->QueryGidType(ctx, port, index, type) : ENOSYS;
}
RDMAVIRT_API int ibv_resolve_eth_l2_from_gid(ibv_context* ctx, ibv_ah_attr* attr, uint8_t mac[6],
                                             uint16_t* vid) {
  Shim* s = S();
  return s ? s->ResolveEthL2FromGid(ctx, attr, mac, vid) : ENOSYS;
}
RDMAVIRT_API int ibv_get_pkey_index(ibv_context* ctx, uint8_t port, __be16 pkey) {
  Shim* s = S();
  return s ? s->GetPkeyIndex(ctx, port, pkey) : -1;
}

RDMAVIRT_API ibv_pd* ibv_alloc_pd(ibv_context* ctx) {
  Shim* s = S();
  return s ? s->AllocPd(ctx) : nullptr;
}
RDMAVIRT_API int ibv_dealloc_pd(ibv_pd* pd) {
  Shim* s = S();
  return s ? s->DeallocPd(pd) : ENOSYS;
}
RDMAVIRT_API ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  Shim* s = S();
  return s ? s->RegMr(pd, addr, length, reinterpret_cast<uintptr_t>(addr),
                      static_cast<unsigned int>(access))
           : nullptr;
}
RDMAVIRT_API ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                                     int access) {
  Shim* s = S();
  return s ? s->RegMr(pd, addr, length, iova, static_cast<unsigned int>(access)) : nullptr;
}
RDMAVIRT_API ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                                      unsigned int access) {
  Shim* s = S();
  return s ? s->RegMr(pd, addr, length, iova, access) : nullptr;
}
RDMAVIRT_API int ibv_rereg_mr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
                              int access) {
  Shim* s = S();
  return s ? s->ReregMr(mr, flags, pd, addr, length, access) : ENOSYS;
}
RDMAVIRT_API int ibv_dereg_mr(ibv_mr* mr) {
  Shim* s = S();
  return s ? s->DeregMr(mr) : ENOSYS;
}
RDMAVIRT_API ibv_mr* ibv_reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  LogOnce("dma-buf memory regions are not supported (ibv_reg_dmabuf_mr: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}

RDMAVIRT_API ibv_comp_channel* ibv_create_comp_channel(ibv_context* ctx) {
  Shim* s = S();
  return s ? s->CreateCompChannel(ctx) : nullptr;
}
RDMAVIRT_API int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  Shim* s = S();
  return s ? s->DestroyCompChannel(channel) : ENOSYS;
}
RDMAVIRT_API ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cq_context,
                                   ibv_comp_channel* channel, int comp_vector) {
  Shim* s = S();
  return s ? s->CreateCq(ctx, cqe, cq_context, channel, comp_vector) : nullptr;
}
RDMAVIRT_API int ibv_resize_cq(ibv_cq* cq, int cqe) {
  Shim* s = S();
  return s ? s->ResizeCq(cq, cqe) : ENOSYS;
}
RDMAVIRT_API int ibv_destroy_cq(ibv_cq* cq) {
  Shim* s = S();
  return s ? s->DestroyCq(cq) : ENOSYS;
}
RDMAVIRT_API int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  Shim* s = S();
  return s ? s->GetCqEvent(channel, cq, cq_context) : -1;
}
RDMAVIRT_API void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  if (Shim* s = S()) s->AckCqEvents(cq, nevents);
}

RDMAVIRT_API ibv_srq* ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* attr) {
  Shim* s = S();
  return s ? s->CreateSrq(pd, attr) : nullptr;
}
RDMAVIRT_API int ibv_modify_srq(ibv_srq* srq, ibv_srq_attr* attr, int mask) {
  Shim* s = S();
  return s ? s->ModifySrq(srq, attr, mask) : ENOSYS;
}
RDMAVIRT_API int ibv_query_srq(ibv_srq* srq, ibv_srq_attr* attr) {
  Shim* s = S();
  return s ? s->QuerySrq(srq, attr) : ENOSYS;
}
RDMAVIRT_API int ibv_destroy_srq(ibv_srq* srq) {
  Shim* s = S();
  return s ? s->DestroySrq(srq) : ENOSYS;
}

RDMAVIRT_API ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  Shim* s = S();
  return s ? s->CreateQp(pd, attr) : nullptr;
}
RDMAVIRT_API ibv_qp_ex* ibv_qp_to_qp_ex(ibv_qp* qp) {
  Shim* s = S();
  return s ? s->QpToQpEx(qp) : nullptr;
}
RDMAVIRT_API int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  Shim* s = S();
  return s ? s->ModifyQp(qp, attr, mask) : ENOSYS;
}
RDMAVIRT_API int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init) {
  Shim* s = S();
  return s ? s->QueryQp(qp, attr, mask, init) : ENOSYS;
}
RDMAVIRT_API int ibv_destroy_qp(ibv_qp* qp) {
  Shim* s = S();
  return s ? s->DestroyQp(qp) : ENOSYS;
}
RDMAVIRT_API int ibv_query_qp_data_in_order(ibv_qp* qp, ibv_wr_opcode op, uint32_t flags) {
  Shim* s = S();
  return s ? s->QueryQpDataInOrder(qp, op, flags) : 0;
}
RDMAVIRT_API int ibv_query_ece(ibv_qp* qp, ibv_ece* ece) {
  Shim* s = S();
  return s ? s->QueryEce(qp, ece) : ENOSYS;
}
RDMAVIRT_API int ibv_set_ece(ibv_qp* qp, ibv_ece* ece) {
  Shim* s = S();
  return s ? s->SetEce(qp, ece) : ENOSYS;
}

RDMAVIRT_API ibv_ah* ibv_create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
  Shim* s = S();
  return s ? s->CreateAh(pd, attr) : nullptr;
}
RDMAVIRT_API int ibv_init_ah_from_wc(ibv_context* ctx, uint8_t port, ibv_wc* wc, ibv_grh* grh,
                                     ibv_ah_attr* attr) {
  Shim* s = S();
  return s ? s->InitAhFromWc(ctx, port, wc, grh, attr) : ENOSYS;
}
RDMAVIRT_API ibv_ah* ibv_create_ah_from_wc(ibv_pd* pd, ibv_wc* wc, ibv_grh* grh, uint8_t port) {
  Shim* s = S();
  return s ? s->CreateAhFromWc(pd, wc, grh, port) : nullptr;
}
RDMAVIRT_API int ibv_destroy_ah(ibv_ah* ah) {
  Shim* s = S();
  return s ? s->DestroyAh(ah) : ENOSYS;
}
RDMAVIRT_API int ibv_attach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) {
  Shim* s = S();
  return s ? s->AttachMcast(qp, gid, lid) : ENOSYS;
}
RDMAVIRT_API int ibv_detach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) {
  Shim* s = S();
  return s ? s->DetachMcast(qp, gid, lid) : ENOSYS;
}

// Sharing verbs objects between processes cannot survive a move.
RDMAVIRT_API ibv_context* ibv_import_device(int) {
  LogOnce("importing verbs objects is not supported (ibv_import_*: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}
RDMAVIRT_API ibv_pd* ibv_import_pd(ibv_context*, uint32_t) {
  LogOnce("importing verbs objects is not supported (ibv_import_*: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}
RDMAVIRT_API ibv_mr* ibv_import_mr(ibv_pd*, uint32_t) {
  LogOnce("importing verbs objects is not supported (ibv_import_*: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}
RDMAVIRT_API ibv_dm* ibv_import_dm(ibv_context*, uint32_t) {
  LogOnce("importing verbs objects is not supported (ibv_import_*: EOPNOTSUPP)");
  errno = EOPNOTSUPP;
  return nullptr;
}
// Nothing is imported under the shim, so an object passed here is one the
// shim made (libibverbs would free it as if imported): it stays.
RDMAVIRT_API void ibv_unimport_pd(ibv_pd*) {
  LogOnce("ibv_unimport_* of an object that was not imported: ignored");
  errno = EOPNOTSUPP;
}
RDMAVIRT_API void ibv_unimport_mr(ibv_mr*) {
  LogOnce("ibv_unimport_* of an object that was not imported: ignored");
  errno = EOPNOTSUPP;
}
RDMAVIRT_API void ibv_unimport_dm(ibv_dm*) {
  LogOnce("ibv_unimport_* of an object that was not imported: ignored");
  errno = EOPNOTSUPP;
}
