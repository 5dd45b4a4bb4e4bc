// VerbsBackend: the control-path verbs the shim calls underneath its shadow
// objects. RealBackend (real_backend.cc) reaches the next libibverbs in the
// link chain; unit tests use FakeBackend (tests/shim/fake_backend.h).
//
// The data path is deliberately not here: post/poll go straight through the
// function pointers of the objects a backend returns (ctx->ops.post_send,
// qp_ex->wr_*, cq_ex->start_poll), so the shim adds no virtual call on it and
// works the same over any backend.
//
// Every method has the contract of the libibverbs function of the same name
// (return values and errno). Thread-safe as libibverbs is.
#ifndef RDMAVIRT_SHIM_CORE_BACKEND_H_
#define RDMAVIRT_SHIM_CORE_BACKEND_H_

#include <errno.h>
#include <infiniband/verbs.h>

namespace rdmavirt::shim {

class VerbsBackend {
 public:
  virtual ~VerbsBackend() = default;

  virtual ibv_device** GetDeviceList(int* num) = 0;
  virtual void FreeDeviceList(ibv_device** list) = 0;
  virtual ibv_context* OpenDevice(ibv_device* device) = 0;
  virtual int CloseDevice(ibv_context* ctx) = 0;
  virtual int GetAsyncEvent(ibv_context* ctx, ibv_async_event* event) = 0;
  virtual void AckAsyncEvent(ibv_async_event* event) = 0;

  virtual int QueryDevice(ibv_context* ctx, ibv_device_attr* attr) = 0;
  virtual int QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) = 0;
  virtual int QueryGid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) = 0;
  virtual int QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                         uint32_t flags, size_t size) = 0;
  virtual ssize_t QueryGidTable(ibv_context* ctx, ibv_gid_entry* entries, size_t max,
                                uint32_t flags, size_t size) = 0;
  virtual int QueryPkey(ibv_context* ctx, uint8_t port, int index, __be16* pkey) = 0;
  virtual int GetPkeyIndex(ibv_context* ctx, uint8_t port, __be16 pkey) = 0;

  virtual ibv_pd* AllocPd(ibv_context* ctx) = 0;
  virtual int DeallocPd(ibv_pd* pd) = 0;
  virtual ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                        unsigned int access) = 0;
  virtual int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access) = 0;
  virtual int DeregMr(ibv_mr* mr) = 0;

  virtual ibv_comp_channel* CreateCompChannel(ibv_context* ctx) = 0;
  virtual int DestroyCompChannel(ibv_comp_channel* channel) = 0;
  virtual ibv_cq* CreateCq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* channel,
                           int comp_vector) = 0;
  // nullptr with errno EOPNOTSUPP when the device has no extended CQs.
  virtual ibv_cq_ex* CreateCqEx(ibv_context* ctx, ibv_cq_init_attr_ex* attr) = 0;
  virtual int ResizeCq(ibv_cq* cq, int cqe) = 0;
  virtual int DestroyCq(ibv_cq* cq) = 0;
  virtual int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) = 0;
  virtual void AckCqEvents(ibv_cq* cq, unsigned int nevents) = 0;

  virtual ibv_srq* CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr) = 0;
  virtual int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int mask) = 0;
  virtual int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr) = 0;
  virtual int DestroySrq(ibv_srq* srq) = 0;

  virtual ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) = 0;
  // nullptr with errno EOPNOTSUPP when the device has no extended QPs.
  virtual ibv_qp* CreateQpEx(ibv_context* ctx, ibv_qp_init_attr_ex* attr) = 0;
  virtual ibv_qp_ex* QpToQpEx(ibv_qp* qp) = 0;
  virtual int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) = 0;
  virtual int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init) = 0;
  virtual int DestroyQp(ibv_qp* qp) = 0;

  virtual ibv_ah* CreateAh(ibv_pd* pd, ibv_ah_attr* attr) = 0;
  virtual int InitAhFromWc(ibv_context* ctx, uint8_t port, ibv_wc* wc, ibv_grh* grh,
                           ibv_ah_attr* attr) = 0;
  virtual int DestroyAh(ibv_ah* ah) = 0;
  virtual int AttachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) = 0;
  virtual int DetachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) = 0;
  // Enhanced connection establishment (librdmacm probes it on connect).
  virtual int QueryEce(ibv_qp*, ibv_ece*) { return EOPNOTSUPP; }
  virtual int SetEce(ibv_qp*, ibv_ece*) { return EOPNOTSUPP; }
  // Less common exports (shim/exports.cc); a libibverbs without them
  // fails as a device that lacks the feature would.
  // ibv_query_gid_type (a private export; `type` is enum ibv_gid_type_sysfs).
  virtual int QueryGidType(ibv_context*, uint8_t, unsigned int, int*) { return EOPNOTSUPP; }
  // ibv_query_qp_data_in_order: 0 (no guarantee) when unknown.
  virtual int QueryQpDataInOrder(ibv_qp*, ibv_wr_opcode, uint32_t) { return 0; }
  virtual int ResolveEthL2FromGid(ibv_context*, ibv_ah_attr*, uint8_t*, uint16_t*) {
    return EOPNOTSUPP;
  }
};

// ibv_create_qp's attributes in the form of ibv_create_qp_ex's, for the
// shim and for backends that build one on the other.
inline ibv_qp_init_attr_ex ToInitAttrEx(ibv_pd* pd, const ibv_qp_init_attr& attr) {
  ibv_qp_init_attr_ex ex{};
  ex.qp_context = attr.qp_context;
  ex.send_cq = attr.send_cq;
  ex.recv_cq = attr.recv_cq;
  ex.srq = attr.srq;
  ex.cap = attr.cap;
  ex.qp_type = attr.qp_type;
  ex.sq_sig_all = attr.sq_sig_all;
  ex.comp_mask = IBV_QP_INIT_ATTR_PD;
  ex.pd = pd;
  return ex;
}

// The libibverbs that the shim interposes on (the next definition of each
// symbol after the shim's own). nullptr if libibverbs cannot be found.
VerbsBackend* RealBackend();

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_BACKEND_H_
