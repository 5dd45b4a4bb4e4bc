// NullBackend: a VerbsBackend whose objects do the least a provider could,
// so that benchmarks of the shim's data path measure the shim and nothing
// else.
//
// Its context's post_send and post_recv accept every work request, note the
// wr_id of the first (a provider writes it into its queue) and return 0.
// poll_cq returns exactly one successful completion on every call, for the
// QP last created on that CQ: a receive completion (IBV_WC_RECV, the wr_id
// of the QP's last posted receive) if the CQ is that QP's receive CQ, else
// a send completion (IBV_WC_SEND, the last posted send's wr_id); qp_num is
// the QP's physical number, as a provider reports it. A CQ no QP uses is
// empty. Enough of the control path exists to build the stack the
// benchmarks need: device, context, PD, MR (keys index << 8 | 0x5a), CQ,
// and RC/UC/UD QP without SRQ. Everything else fails with ENOSYS (or
// EOPNOTSUPP where the interface says so), as a device without that verb
// would.
//
// Not a fake for correctness tests (that is tests/shim/fake_backend.h): it
// checks nothing it is given. Not thread-safe: one thread creates, uses and
// destroys its objects.
#ifndef RDMAVIRT_TESTS_BENCH_NULL_BACKEND_H_
#define RDMAVIRT_TESTS_BENCH_NULL_BACKEND_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "shim/core/backend.h"

namespace rdmavirt::bench {

class NullBackend : public shim::VerbsBackend {
 public:
  // The physical numbers the first QP and MR get: QPNs count up from here.
  static constexpr uint32_t kFirstQpn = 0x11;
  static constexpr uint8_t kKeyTag = 0x5a;

  NullBackend();
  NullBackend(const NullBackend&) = delete;
  NullBackend& operator=(const NullBackend&) = delete;
  ~NullBackend() override;

  ibv_device** GetDeviceList(int* num) override;
  void FreeDeviceList(ibv_device** list) override;
  ibv_context* OpenDevice(ibv_device* device) override;
  int CloseDevice(ibv_context* ctx) override;
  int GetAsyncEvent(ibv_context* ctx, ibv_async_event* event) override;
  void AckAsyncEvent(ibv_async_event* event) override;

  int QueryDevice(ibv_context* ctx, ibv_device_attr* attr) override;
  int QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) override;
  int QueryGid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) override;
  int QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                 uint32_t flags, size_t size) override;
  ssize_t QueryGidTable(ibv_context* ctx, ibv_gid_entry* entries, size_t max, uint32_t flags,
                        size_t size) override;
  int QueryPkey(ibv_context* ctx, uint8_t port, int index, __be16* pkey) override;
  int GetPkeyIndex(ibv_context* ctx, uint8_t port, __be16 pkey) override;

  ibv_pd* AllocPd(ibv_context* ctx) override;
  int DeallocPd(ibv_pd* pd) override;
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned int access) override;
  int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access) override;
  int DeregMr(ibv_mr* mr) override;

  ibv_comp_channel* CreateCompChannel(ibv_context* ctx) override;
  int DestroyCompChannel(ibv_comp_channel* channel) override;
  ibv_cq* CreateCq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* channel,
                   int comp_vector) override;
  ibv_cq_ex* CreateCqEx(ibv_context* ctx, ibv_cq_init_attr_ex* attr) override;
  int ResizeCq(ibv_cq* cq, int cqe) override;
  int DestroyCq(ibv_cq* cq) override;
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) override;
  void AckCqEvents(ibv_cq* cq, unsigned int nevents) override;

  ibv_srq* CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr) override;
  int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int mask) override;
  int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr) override;
  int DestroySrq(ibv_srq* srq) override;

  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) override;
  ibv_qp* CreateQpEx(ibv_context* ctx, ibv_qp_init_attr_ex* attr) override;
  ibv_qp_ex* QpToQpEx(ibv_qp* qp) override;
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) override;
  int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init) override;
  int DestroyQp(ibv_qp* qp) override;

  ibv_ah* CreateAh(ibv_pd* pd, ibv_ah_attr* attr) override;
  int InitAhFromWc(ibv_context* ctx, uint8_t port, ibv_wc* wc, ibv_grh* grh,
                   ibv_ah_attr* attr) override;
  int DestroyAh(ibv_ah* ah) override;
  int AttachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) override;
  int DetachMcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) override;

 private:
  struct NullQp {
    ibv_qp qp;  // first: the ibv_qp* handed out is the NullQp's address
    uint64_t last_send_wr_id = 0;
    uint64_t last_recv_wr_id = 0;
  };
  // A CQ remembers the QP whose completions it reports.
  struct NullCq {
    ibv_cq cq;  // first, as in NullQp
    NullQp* qp = nullptr;
    bool recv = false;  // receive completions, else send completions
  };

  // The data path: what the context's ops point at.
  static int PostSendOp(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
  static int PostRecvOp(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
  static int PollCqOp(ibv_cq* cq, int n, ibv_wc* wc);
  static int ReqNotifyCqOp(ibv_cq* cq, int solicited_only);

  // A new zeroed T owned by *list; Release frees the one at p, false if
  // *list has none there.
  template <typename T>
  static T* Keep(std::vector<std::unique_ptr<T>>* list);
  template <typename T>
  static bool Release(std::vector<std::unique_ptr<T>>* list, const void* p);

  ibv_device device_{};
  ibv_device* device_list_[2] = {&device_, nullptr};
  uint32_t next_qpn_ = kFirstQpn;
  uint32_t next_mr_index_ = 1;
  std::vector<std::unique_ptr<ibv_context>> contexts_;
  std::vector<std::unique_ptr<ibv_pd>> pds_;
  std::vector<std::unique_ptr<ibv_mr>> mrs_;
  std::vector<std::unique_ptr<NullCq>> cqs_;
  std::vector<std::unique_ptr<NullQp>> qps_;
};

}  // namespace rdmavirt::bench

#endif  // RDMAVIRT_TESTS_BENCH_NULL_BACKEND_H_
