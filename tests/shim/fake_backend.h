// FakeBackend: an in-memory verbs "device" for the shim's unit tests.
//
// One device ("fake0") with one RoCE port and a two-entry GID table. Its
// objects carry working function pointers (ctx->ops.post_send, the
// ibv_qp_ex builders, the ibv_cq_ex pollers), because the shim's data path
// calls them directly. Work requests are executed at post time by loopback
// between the fake's own QPs: RC/UC SEND(_WITH_IMM/_WITH_INV), RDMA WRITE
// (_WITH_IMM), RDMA READ, both atomics, inline data; UD SEND through an AH,
// with a 40-byte GRH as rxe builds it for RoCEv2.
//
// It behaves like hardware where the shim can get it wrong: keys and QPNs
// it hands out are rxe-like and never coincide with anything the shim
// invents; an unknown lkey completes with IBV_WC_LOC_PROT_ERR and an
// unknown rkey with IBV_WC_REM_ACCESS_ERR; a QP whose address vector names
// a GID or QPN that is not this device's gets no delivery. It records what
// it received (physical keys, QPNs, AH pointers, modify_qp attributes) so
// tests can assert that the shim translated, and counts pointers it never
// handed out ("foreign" objects: a shadow that leaked through the shim).
//
// Fault injection (leveldb's EnvWrapper style): FailNext(op, error) makes
// the next call of `op` fail with `error`, as the real verb would
// (nullptr + errno, or the error returned).
//
// Thread-safe: every entry point, including the data path, takes mu_.
// Record accessors return copies.
#ifndef RDMAVIRT_TESTS_SHIM_FAKE_BACKEND_H_
#define RDMAVIRT_TESTS_SHIM_FAKE_BACKEND_H_

#include <infiniband/verbs.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "shim/core/backend.h"

namespace rdmavirt::shim {

class FakeBackend final : public VerbsBackend {
 public:
  static constexpr uint8_t kPort = 1;
  // rxe hands out MR index << 8 | random byte with indices from 1 and QPNs
  // from 17; these start far above the shim's dense slot numbers, so a
  // virtual lkey that slips through untranslated is never a valid key.
  static constexpr uint32_t kFirstMrIndex = 0x5a3;
  static constexpr uint32_t kFirstQpn = 0x1d1;
  static constexpr uint32_t kMaxSge = 32;
  static constexpr uint32_t kMaxInline = 256;
  static constexpr uint32_t kMaxWr = 1024;
  static constexpr int kMaxCqe = 4096;
  static constexpr uint32_t kMtu = 4096;
  static constexpr int kGidCount = 2;
  static constexpr size_t kGrhBytes = 40;
  // GID index 1 is ::ffff:10.77.0.9 (RoCEv2 over IPv4).
  static constexpr uint8_t kIpv4[4] = {10, 77, 0, 9};
  static ibv_gid Gid(int index);  // 0: fe80::..., 1: ::ffff:10.77.0.9

  // Calls that FailNext can make fail.
  enum class Op {
    kOpenDevice,
    kCloseDevice,
    kQueryGid,
    kAllocPd,
    kDeallocPd,
    kRegMr,
    kReregMr,
    kDeregMr,
    kCreateCompChannel,
    kCreateCq,  // ibv_create_cq and ibv_create_cq_ex
    kDestroyCq,
    kCreateSrq,
    kDestroySrq,
    kCreateQp,  // ibv_create_qp and ibv_create_qp_ex
    kModifyQp,
    kQueryQp,
    kDestroyQp,
    kCreateAh,
    kDestroyAh,
  };

  // One work request as the fake received it (post_send or wr_complete).
  struct SendRecord {
    uint32_t qp_num = 0;  // the posting QP
    uint64_t wr_id = 0;
    ibv_wr_opcode opcode = IBV_WR_SEND;
    unsigned int send_flags = 0;
    std::vector<uint32_t> lkeys;
    uint32_t rkey = 0;             // RDMA and atomics
    uint32_t invalidate_rkey = 0;  // SEND_WITH_INV
    ibv_ah* ah = nullptr;          // UD
    uint32_t remote_qpn = 0;       // UD
    uint32_t remote_qkey = 0;      // UD
  };
  struct RecvRecord {
    uint32_t qp_num = 0;  // 0 when posted to an SRQ
    ibv_srq* srq = nullptr;
    uint64_t wr_id = 0;
    std::vector<uint32_t> lkeys;
  };
  struct ModifyRecord {
    ibv_qp* qp = nullptr;
    uint32_t qp_num = 0;
    ibv_qp_attr attr{};
    int mask = 0;
    int rc = 0;
  };
  struct AhRecord {
    ibv_ah* ah = nullptr;
    ibv_ah_attr attr{};
  };

  FakeBackend();
  ~FakeBackend() override;
  FakeBackend(const FakeBackend&) = delete;
  FakeBackend& operator=(const FakeBackend&) = delete;

  // ---- VerbsBackend
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

  // ---- Switches
  // The next call of `op` fails with `error` (a positive errno value).
  void FailNext(Op op, int error);
  // The next QP created gets this QPN (to force QpIndex collisions).
  void SetNextQpn(uint32_t qpn);
  // The next MRs registered get key indexes (bits 8..23) from this one on
  // (to make a key share another's slot in the shim's MR table).
  void SetNextMrIndex(uint32_t index);
  // Queues an asynchronous event for GetAsyncEvent on `ctx`; its element
  // must be one of this fake's objects.
  void InjectAsyncEvent(ibv_context* ctx, const ibv_async_event& event);
  // UD datagrams reach their receiver this long after the sender's
  // completion (rxe completes a UD send when it hands the packet on; the
  // receiver's responder runs later), on the next poll of any CQ after
  // that. One that finds its receiver not ready (error state, no receive
  // posted) is lost, as on rxe. 0 (the default): at once.
  void set_ud_delivery_delay_ms(int ms);
  // While set, OpenDevice blocks (a verb stuck in the kernel); clearing it
  // lets the blocked calls go on.
  void set_stall_open_device(bool stall);
  // Threads held in OpenDevice by set_stall_open_device now.
  int stalled_opens();
  // Completion channels made from now on have blocking fds: GetCqEvent
  // waits for an event, or for the channel's destroy (then EIO).
  void set_blocking_channels(bool blocking);

  // ---- What the fake received and holds
  std::vector<SendRecord> sends() const;
  // Send WRs refused at post time, as given (ATOMIC_WRITE, say, which
  // this fake does not execute through ibv_post_send, as rxe does not).
  std::vector<SendRecord> refused_sends() const;
  std::vector<RecvRecord> recvs() const;
  std::vector<ModifyRecord> modifies() const;
  std::vector<AhRecord> ahs() const;
  std::vector<ibv_async_event> acked_async_events() const;
  std::vector<std::pair<ibv_cq*, unsigned int>> acked_cq_events() const;
  // The multicast groups a real QP is attached to.
  std::vector<ibv_gid> mcast_groups(const ibv_qp* qp) const;
  // CQ destroys with events read and not acknowledged: libibverbs would
  // have waited for them forever. Zero in a correct shim.
  int blocked_destroys() const;
  // Calls of ctx->ops.post_send (a chain posted in pieces makes several).
  int post_send_calls() const;
  // Calls of ctx->ops.poll_cq, on any CQ.
  int poll_cq_calls() const;
  int create_qp_calls() const;
  // Pointers the fake was given but never made, e.g. a shadow object that
  // the shim forgot to replace with the real one. Zero in a correct shim.
  int foreign_objects() const;
  // Objects created and not yet destroyed, contexts included.
  int live_objects() const;
  ibv_device* device() { return &device_; }
  // This fake's QP with physical number `qpn`, or nullptr.
  ibv_qp* QpByNum(uint32_t qpn) const;
  // The fake's own MR with physical lkey `lkey`, or nullptr.
  ibv_mr* MrByLkey(uint32_t lkey) const;

 private:
  struct ContextObj;
  struct PdObj;
  struct MrObj;
  struct ChannelObj;
  struct CqObj;
  struct SrqObj;
  struct QpObj;
  struct AhObj;
  struct Wr;
  struct RecvWr;
  struct Ops;  // the function pointers in the fake's objects
  friend struct Ops;

  template <typename T>
  using Owned = std::map<const void*, std::unique_ptr<T>>;

  bool TakeFault(Op op, int* error);  // requires mu_
  // For calls that return an object: an injected fault, else EINVAL when
  // `valid` is false; sets errno and returns true when the call must fail.
  bool Refused(Op op, bool valid);  // requires mu_
  template <typename T>
  T* Lookup(const Owned<T>& objects, const void* p) const;          // requires mu_
  uint32_t NewKey();                                                // requires mu_
  MrObj* FindMr(const PdObj* pd, uint32_t key, bool remote) const;  // requires mu_
  QpObj* FindQpByNum(uint32_t qpn) const;                           // requires mu_
  bool IsOurGid(const ibv_gid& gid) const;
  ibv_qp* CreateQpLocked(ibv_context* ctx, ibv_qp_init_attr_ex* attr);
  int Validate(QpObj* qp, const Wr& wr) const;  // requires mu_
  void Execute(QpObj* qp, const Wr& wr);        // requires mu_
  ibv_wc_status Deliver(QpObj* qp, const Wr& wr, const std::string& payload,
                        uint32_t* byte_len);                   // requires mu_
  void Complete(CqObj* cq, const ibv_wc& wc, bool solicited);  // requires mu_
  void FlushRecvs(QpObj* qp);                                  // requires mu_
  struct Datagram {
    std::chrono::steady_clock::time_point due;
    uint32_t src_qp = 0, dest_qp = 0, qkey = 0, imm = 0;
    bool with_imm = false, solicited = false;
    std::string message;  // GRH and payload
  };
  void ReceiveDatagram(const Datagram& g);                                       // requires mu_
  void DeliverDueDatagrams();                                                    // requires mu_
  ibv_wc_status Scatter(QpObj* d, const RecvWr& r, const std::string& message);  // requires mu_

  mutable std::mutex mu_;
  ibv_device device_{};
  std::mt19937 rng_{0x52444d41};  // fixed seed: reproducible keys
  uint32_t next_mr_index_ = kFirstMrIndex;
  uint32_t next_qpn_ = kFirstQpn;
  uint32_t forced_qpn_ = 0;
  uint32_t next_handle_ = 1;
  std::map<Op, int> faults_;
  int ud_delay_ms_ = 0;
  std::deque<Datagram> held_;  // in order of their due time
  std::mutex stall_mu_;        // not mu_: a stalled call must not block the others
  std::condition_variable stall_cv_;
  bool stall_open_device_ = false;
  int stalled_opens_ = 0;  // guarded by stall_mu_
  Owned<ContextObj> contexts_;
  Owned<PdObj> pds_;
  Owned<MrObj> mrs_;
  Owned<ChannelObj> channels_;
  Owned<CqObj> cqs_;
  Owned<SrqObj> srqs_;
  Owned<QpObj> qps_;
  Owned<AhObj> ahs_;
  std::vector<SendRecord> sends_;
  std::vector<SendRecord> refused_sends_;
  std::vector<RecvRecord> recvs_;
  std::vector<ModifyRecord> modifies_;
  std::vector<AhRecord> ah_records_;
  std::vector<ibv_async_event> acked_async_;
  std::vector<std::pair<ibv_cq*, unsigned int>> acked_cq_events_;
  std::vector<std::unique_ptr<ChannelObj>> closed_channels_;
  bool blocking_channels_ = false;
  int blocked_destroys_ = 0;
  int post_send_calls_ = 0;
  int poll_cq_calls_ = 0;
  int create_qp_calls_ = 0;
  mutable int foreign_ = 0;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_TESTS_SHIM_FAKE_BACKEND_H_
