// RealBackend: the libibverbs the application would have used. Symbols are
// looked up on libibverbs' own handle (dlvsym), never by name: inside the
// shim a plain call to ibv_create_qp would bind to the shim's own export.
#include <dlfcn.h>
#include <errno.h>
#include <string.h>

#include <new>

#include "shim/abi/libc_dl.h"
#include "shim/core/backend.h"
#include "shim/core/log.h"

namespace rdmavirt::shim {
namespace {

template <typename Fn>
bool Resolve(void* handle, Fn** fn, const char* name, const char* version) {
  // libc's dlvsym: the name dlvsym is the shim's own (dl_interpose.cc).
  *fn = reinterpret_cast<Fn*>(Libc().dlvsym(handle, name, version));
  return *fn != nullptr;
}

class LibibverbsBackend final : public VerbsBackend {
 public:
  bool Load() {
    if (Libc().dlvsym == nullptr) return false;
    void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) return false;
    constexpr const char* v = "IBVERBS_1.1";
    const bool required =
        Resolve(h, &get_device_list_, "ibv_get_device_list", v) &&
        Resolve(h, &free_device_list_, "ibv_free_device_list", v) &&
        Resolve(h, &open_device_, "ibv_open_device", v) &&
        Resolve(h, &close_device_, "ibv_close_device", v) &&
        Resolve(h, &get_async_event_, "ibv_get_async_event", v) &&
        Resolve(h, &ack_async_event_, "ibv_ack_async_event", v) &&
        Resolve(h, &query_device_, "ibv_query_device", v) &&
        Resolve(h, &query_port_, "ibv_query_port", v) &&
        Resolve(h, &query_gid_, "ibv_query_gid", v) &&
        Resolve(h, &query_gid_ex_, "_ibv_query_gid_ex", "IBVERBS_1.11") &&
        Resolve(h, &query_gid_table_, "_ibv_query_gid_table", "IBVERBS_1.11") &&
        Resolve(h, &query_pkey_, "ibv_query_pkey", v) &&
        Resolve(h, &get_pkey_index_, "ibv_get_pkey_index", "IBVERBS_1.5") &&
        Resolve(h, &alloc_pd_, "ibv_alloc_pd", v) &&
        Resolve(h, &dealloc_pd_, "ibv_dealloc_pd", v) &&
        Resolve(h, &reg_mr_iova2_, "ibv_reg_mr_iova2", "IBVERBS_1.8") &&
        Resolve(h, &rereg_mr_, "ibv_rereg_mr", v) && Resolve(h, &dereg_mr_, "ibv_dereg_mr", v) &&
        Resolve(h, &create_comp_channel_, "ibv_create_comp_channel", "IBVERBS_1.0") &&
        Resolve(h, &destroy_comp_channel_, "ibv_destroy_comp_channel", "IBVERBS_1.0") &&
        Resolve(h, &create_cq_, "ibv_create_cq", v) &&
        Resolve(h, &resize_cq_, "ibv_resize_cq", v) &&
        Resolve(h, &destroy_cq_, "ibv_destroy_cq", v) &&
        Resolve(h, &get_cq_event_, "ibv_get_cq_event", v) &&
        Resolve(h, &ack_cq_events_, "ibv_ack_cq_events", v) &&
        Resolve(h, &create_srq_, "ibv_create_srq", v) &&
        Resolve(h, &modify_srq_, "ibv_modify_srq", v) &&
        Resolve(h, &query_srq_, "ibv_query_srq", v) &&
        Resolve(h, &destroy_srq_, "ibv_destroy_srq", v) &&
        Resolve(h, &create_qp_, "ibv_create_qp", v) &&
        Resolve(h, &qp_to_qp_ex_, "ibv_qp_to_qp_ex", "IBVERBS_1.6") &&
        Resolve(h, &modify_qp_, "ibv_modify_qp", v) && Resolve(h, &query_qp_, "ibv_query_qp", v) &&
        Resolve(h, &destroy_qp_, "ibv_destroy_qp", v) &&
        Resolve(h, &create_ah_, "ibv_create_ah", v) &&
        Resolve(h, &init_ah_from_wc_, "ibv_init_ah_from_wc", v) &&
        Resolve(h, &destroy_ah_, "ibv_destroy_ah", v) &&
        Resolve(h, &attach_mcast_, "ibv_attach_mcast", v) &&
        Resolve(h, &detach_mcast_, "ibv_detach_mcast", v) &&
        Resolve(h, &query_ece_, "ibv_query_ece", "IBVERBS_1.10") &&
        Resolve(h, &set_ece_, "ibv_set_ece", "IBVERBS_1.10");
    if (required) LoadOptional(h);
    return required;
  }

  // Exports that older libibverbs lack, or whose version changes with
  // every release (IBVERBS_PRIVATE_NN): looked up by default version, and
  // missing ones fail as the feature would.
  void LoadOptional(void* h) {
    query_gid_type_ =
        reinterpret_cast<decltype(query_gid_type_)>(Libc().dlsym(h, "ibv_query_gid_type"));
    Resolve(h, &query_qp_data_in_order_, "ibv_query_qp_data_in_order", "IBVERBS_1.14");
    Resolve(h, &resolve_eth_l2_, "ibv_resolve_eth_l2_from_gid", "IBVERBS_1.1");
  }

  ibv_device** GetDeviceList(int* num) override { return get_device_list_(num); }
  void FreeDeviceList(ibv_device** list) override { free_device_list_(list); }
  ibv_context* OpenDevice(ibv_device* d) override { return open_device_(d); }
  int CloseDevice(ibv_context* c) override { return close_device_(c); }
  int GetAsyncEvent(ibv_context* c, ibv_async_event* e) override { return get_async_event_(c, e); }
  void AckAsyncEvent(ibv_async_event* e) override { ack_async_event_(e); }
  int QueryDevice(ibv_context* c, ibv_device_attr* a) override { return query_device_(c, a); }
  int QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* a) override {
    // As verbs.h's ibv_query_port: the full struct through the provider,
    // or the exported compat call that fills its older prefix.
    if (auto* vctx = verbs_get_ctx_op(c, query_port))
      return vctx->query_port(c, port, a, sizeof(*a));
    memset(a, 0, sizeof(*a));
    return query_port_(c, port, a);
  }
  int QueryGid(ibv_context* c, uint8_t port, int i, ibv_gid* g) override {
    return query_gid_(c, port, i, g);
  }
  int QueryGidEx(ibv_context* c, uint32_t port, uint32_t i, ibv_gid_entry* e, uint32_t flags,
                 size_t size) override {
    return query_gid_ex_(c, port, i, e, flags, size);
  }
  ssize_t QueryGidTable(ibv_context* c, ibv_gid_entry* e, size_t max, uint32_t flags,
                        size_t size) override {
    return query_gid_table_(c, e, max, flags, size);
  }
  int QueryPkey(ibv_context* c, uint8_t port, int i, __be16* p) override {
    return query_pkey_(c, port, i, p);
  }
  int GetPkeyIndex(ibv_context* c, uint8_t port, __be16 p) override {
    return get_pkey_index_(c, port, p);
  }
  ibv_pd* AllocPd(ibv_context* c) override { return alloc_pd_(c); }
  int DeallocPd(ibv_pd* p) override { return dealloc_pd_(p); }
  ibv_mr* RegMr(ibv_pd* p, void* addr, size_t len, uint64_t iova, unsigned int access) override {
    return reg_mr_iova2_(p, addr, len, iova, access);
  }
  int ReregMr(ibv_mr* m, int flags, ibv_pd* p, void* addr, size_t len, int access) override {
    return rereg_mr_(m, flags, p, addr, len, access);
  }
  int DeregMr(ibv_mr* m) override { return dereg_mr_(m); }
  ibv_comp_channel* CreateCompChannel(ibv_context* c) override { return create_comp_channel_(c); }
  int DestroyCompChannel(ibv_comp_channel* ch) override { return destroy_comp_channel_(ch); }
  ibv_cq* CreateCq(ibv_context* c, int cqe, void* user, ibv_comp_channel* ch, int vec) override {
    return create_cq_(c, cqe, user, ch, vec);
  }
  ibv_cq_ex* CreateCqEx(ibv_context* c, ibv_cq_init_attr_ex* a) override {
    auto* vctx = verbs_get_ctx_op(c, create_cq_ex);
    if (vctx == nullptr) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    return vctx->create_cq_ex(c, a);
  }
  int ResizeCq(ibv_cq* c, int cqe) override { return resize_cq_(c, cqe); }
  int DestroyCq(ibv_cq* c) override { return destroy_cq_(c); }
  int GetCqEvent(ibv_comp_channel* ch, ibv_cq** cq, void** user) override {
    return get_cq_event_(ch, cq, user);
  }
  void AckCqEvents(ibv_cq* c, unsigned int n) override { ack_cq_events_(c, n); }
  ibv_srq* CreateSrq(ibv_pd* p, ibv_srq_init_attr* a) override { return create_srq_(p, a); }
  int ModifySrq(ibv_srq* s, ibv_srq_attr* a, int m) override { return modify_srq_(s, a, m); }
  int QuerySrq(ibv_srq* s, ibv_srq_attr* a) override { return query_srq_(s, a); }
  int DestroySrq(ibv_srq* s) override { return destroy_srq_(s); }
  ibv_qp* CreateQp(ibv_pd* p, ibv_qp_init_attr* a) override { return create_qp_(p, a); }
  ibv_qp* CreateQpEx(ibv_context* c, ibv_qp_init_attr_ex* a) override {
    // As verbs.h's ibv_create_qp_ex, without its fallback to the exported
    // ibv_create_qp by name (that would be the shim's).
    if (a->comp_mask == IBV_QP_INIT_ATTR_PD)
      return create_qp_(a->pd, reinterpret_cast<ibv_qp_init_attr*>(a));
    auto* vctx = verbs_get_ctx_op(c, create_qp_ex);
    if (vctx == nullptr) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    return vctx->create_qp_ex(c, a);
  }
  ibv_qp_ex* QpToQpEx(ibv_qp* q) override { return qp_to_qp_ex_(q); }
  int ModifyQp(ibv_qp* q, ibv_qp_attr* a, int m) override { return modify_qp_(q, a, m); }
  int QueryQp(ibv_qp* q, ibv_qp_attr* a, int m, ibv_qp_init_attr* i) override {
    return query_qp_(q, a, m, i);
  }
  int DestroyQp(ibv_qp* q) override { return destroy_qp_(q); }
  ibv_ah* CreateAh(ibv_pd* p, ibv_ah_attr* a) override { return create_ah_(p, a); }
  int InitAhFromWc(ibv_context* c, uint8_t port, ibv_wc* wc, ibv_grh* grh,
                   ibv_ah_attr* a) override {
    return init_ah_from_wc_(c, port, wc, grh, a);
  }
  int DestroyAh(ibv_ah* a) override { return destroy_ah_(a); }
  int AttachMcast(ibv_qp* q, const ibv_gid* g, uint16_t lid) override {
    return attach_mcast_(q, g, lid);
  }
  int DetachMcast(ibv_qp* q, const ibv_gid* g, uint16_t lid) override {
    return detach_mcast_(q, g, lid);
  }
  int QueryEce(ibv_qp* q, ibv_ece* e) override { return query_ece_(q, e); }
  int SetEce(ibv_qp* q, ibv_ece* e) override { return set_ece_(q, e); }
  int QueryGidType(ibv_context* c, uint8_t port, unsigned int i, int* type) override {
    return query_gid_type_ ? query_gid_type_(c, port, i, type) : EOPNOTSUPP;
  }
  int QueryQpDataInOrder(ibv_qp* q, ibv_wr_opcode op, uint32_t flags) override {
    return query_qp_data_in_order_ ? query_qp_data_in_order_(q, op, flags) : 0;
  }
  int ResolveEthL2FromGid(ibv_context* c, ibv_ah_attr* a, uint8_t* mac, uint16_t* vid) override {
    return resolve_eth_l2_ ? resolve_eth_l2_(c, a, mac, vid) : EOPNOTSUPP;
  }

 private:
  decltype(&ibv_get_device_list) get_device_list_;
  decltype(&ibv_free_device_list) free_device_list_;
  decltype(&ibv_open_device) open_device_;
  decltype(&ibv_close_device) close_device_;
  decltype(&ibv_get_async_event) get_async_event_;
  decltype(&ibv_ack_async_event) ack_async_event_;
  decltype(&ibv_query_device) query_device_;
  int (*query_port_)(ibv_context*, uint8_t, ibv_port_attr*);
  decltype(&ibv_query_gid) query_gid_;
  decltype(&_ibv_query_gid_ex) query_gid_ex_;
  decltype(&_ibv_query_gid_table) query_gid_table_;
  decltype(&ibv_query_pkey) query_pkey_;
  decltype(&ibv_get_pkey_index) get_pkey_index_;
  decltype(&ibv_alloc_pd) alloc_pd_;
  decltype(&ibv_dealloc_pd) dealloc_pd_;
  decltype(&ibv_reg_mr_iova2) reg_mr_iova2_;
  decltype(&ibv_rereg_mr) rereg_mr_;
  decltype(&ibv_dereg_mr) dereg_mr_;
  decltype(&ibv_create_comp_channel) create_comp_channel_;
  decltype(&ibv_destroy_comp_channel) destroy_comp_channel_;
  decltype(&ibv_create_cq) create_cq_;
  decltype(&ibv_resize_cq) resize_cq_;
  decltype(&ibv_destroy_cq) destroy_cq_;
  decltype(&ibv_get_cq_event) get_cq_event_;
  decltype(&ibv_ack_cq_events) ack_cq_events_;
  decltype(&ibv_create_srq) create_srq_;
  decltype(&ibv_modify_srq) modify_srq_;
  decltype(&ibv_query_srq) query_srq_;
  decltype(&ibv_destroy_srq) destroy_srq_;
  decltype(&ibv_create_qp) create_qp_;
  decltype(&ibv_qp_to_qp_ex) qp_to_qp_ex_;
  decltype(&ibv_modify_qp) modify_qp_;
  decltype(&ibv_query_qp) query_qp_;
  decltype(&ibv_destroy_qp) destroy_qp_;
  decltype(&ibv_create_ah) create_ah_;
  decltype(&ibv_init_ah_from_wc) init_ah_from_wc_;
  decltype(&ibv_destroy_ah) destroy_ah_;
  decltype(&ibv_attach_mcast) attach_mcast_;
  decltype(&ibv_detach_mcast) detach_mcast_;
  decltype(&ibv_query_ece) query_ece_;
  decltype(&ibv_set_ece) set_ece_;
  int (*query_gid_type_)(ibv_context*, uint8_t, unsigned int, int*) = nullptr;
  decltype(&ibv_query_qp_data_in_order) query_qp_data_in_order_ = nullptr;
  decltype(&ibv_resolve_eth_l2_from_gid) resolve_eth_l2_ = nullptr;
};

}  // namespace

VerbsBackend* RealBackend() {
  static VerbsBackend* backend = []() -> VerbsBackend* {
    auto* b = new (std::nothrow) LibibverbsBackend();
    if (b == nullptr) return nullptr;
    if (!b->Load()) {
      LogOnce("cannot load libibverbs.so.1: every verb fails with ENOSYS");
      delete b;
      return nullptr;
    }
    return b;
  }();
  return backend;
}

}  // namespace rdmavirt::shim
