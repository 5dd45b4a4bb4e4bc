// Helpers for the shim's unit tests: a verbs "application" that runs the
// same steps over either a Shim (what a preloaded program gets) or a bare
// FakeBackend (what it would get without the shim), so tests can compare
// the two. Both have the libibverbs-named methods used here.
//
// Single-threaded, like the tests that use it.
#ifndef RDMAVIRT_TESTS_SHIM_VERBS_TEST_UTIL_H_
#define RDMAVIRT_TESTS_SHIM_VERBS_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "shim/core/objects.h"
#include "shim/core/shim.h"
#include "tests/shim/fake_backend.h"

namespace rdmavirt::shim::testing {

inline constexpr unsigned int kAllAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                           IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
inline constexpr uint32_t kQkey = 0x11111111;
inline constexpr uint8_t kIpv4GidIndex = 1;

// The shim's objects behind the application's pointers (objects.h: each
// shadow starts with the struct the application holds).
inline const Qp* ShimQp(const ibv_qp* q) { return reinterpret_cast<const Qp*>(q); }
inline const Mr* ShimMr(const ibv_mr* m) { return reinterpret_cast<const Mr*>(m); }
inline const Cq* ShimCq(const ibv_cq* c) { return reinterpret_cast<const Cq*>(c); }
inline const Ah* ShimAh(const ibv_ah* a) { return reinterpret_cast<const Ah*>(a); }
inline const Srq* ShimSrq(const ibv_srq* s) { return reinterpret_cast<const Srq*>(s); }

inline bool GidEq(const ibv_gid& a, const ibv_gid& b) { return memcmp(a.raw, b.raw, 16) == 0; }

// Steps a QP to RTS the way perftest does. For RC/UC `dest_qpn` and
// `dgid` are the peer's as this side's verbs report them.
constexpr int kAllRemoteAccess =
    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
template <typename V>
int ToRts(V& v, ibv_qp* qp, uint32_t dest_qpn, const ibv_gid& dgid,
          uint8_t sgid_index = kIpv4GidIndex, int access = kAllRemoteAccess) {
  const bool ud = qp->qp_type == IBV_QPT_UD;
  const bool rc = qp->qp_type == IBV_QPT_RC;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = FakeBackend::kPort;
  int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (ud) {
    a.qkey = kQkey;
    mask |= IBV_QP_QKEY;
  } else {
    a.qp_access_flags = access;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  if (int r = v.ModifyQp(qp, &a, mask)) return r;

  a = {};
  a.qp_state = IBV_QPS_RTR;
  mask = IBV_QP_STATE;
  if (!ud) {
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest_qpn;
    a.rq_psn = 0x1234;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = dgid;
    a.ah_attr.grh.sgid_index = sgid_index;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.port_num = FakeBackend::kPort;
    mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  }
  if (rc) {
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  }
  if (int r = v.ModifyQp(qp, &a, mask)) return r;

  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0x1234;
  mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  if (rc) {
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  }
  return v.ModifyQp(qp, &a, mask);
}

// An open device with a PD and a CQ, and everything created through it,
// destroyed in reverse order when it goes away (checking each call).
template <typename V>
class Device {
 public:
  explicit Device(V& v) : v_(v) {
    int n = 0;
    ibv_device** list = v_.GetDeviceList(&n);
    EXPECT_EQ(n, 1);
    ctx = v_.OpenDevice(list[0]);
    v_.FreeDeviceList(list);
    EXPECT_NE(ctx, nullptr);
    pd = v_.AllocPd(ctx);
    EXPECT_NE(pd, nullptr);
    cq = Cq();
    EXPECT_EQ(v_.QueryGid(ctx, FakeBackend::kPort, kIpv4GidIndex, &gid), 0);
  }
  ~Device() {
    for (auto it = ahs_.rbegin(); it != ahs_.rend(); ++it) EXPECT_EQ(v_.DestroyAh(*it), 0);
    for (auto it = qps_.rbegin(); it != qps_.rend(); ++it) EXPECT_EQ(v_.DestroyQp(*it), 0);
    for (auto it = srqs_.rbegin(); it != srqs_.rend(); ++it) EXPECT_EQ(v_.DestroySrq(*it), 0);
    for (auto it = mrs_.rbegin(); it != mrs_.rend(); ++it) EXPECT_EQ(v_.DeregMr(*it), 0);
    for (auto it = cqs_.rbegin(); it != cqs_.rend(); ++it) EXPECT_EQ(v_.DestroyCq(*it), 0);
    for (auto it = channels_.rbegin(); it != channels_.rend(); ++it)
      EXPECT_EQ(v_.DestroyCompChannel(*it), 0);
    if (pd != nullptr) {
      EXPECT_EQ(v_.DeallocPd(pd), 0);
    }
    if (ctx != nullptr) {
      EXPECT_EQ(v_.CloseDevice(ctx), 0);
    }
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  ibv_mr* Reg(void* addr, size_t len, unsigned int access = kAllAccess) {
    ibv_mr* mr = v_.RegMr(pd, addr, len, reinterpret_cast<uintptr_t>(addr), access);
    EXPECT_NE(mr, nullptr);
    if (mr != nullptr) mrs_.push_back(mr);
    return mr;
  }
  ibv_comp_channel* Channel() {
    ibv_comp_channel* ch = v_.CreateCompChannel(ctx);
    EXPECT_NE(ch, nullptr);
    if (ch != nullptr) channels_.push_back(ch);
    return ch;
  }
  ibv_cq* Cq(ibv_comp_channel* ch = nullptr, void* cq_context = nullptr, int depth = 256) {
    ibv_cq* c = v_.CreateCq(ctx, depth, cq_context, ch, 0);
    EXPECT_NE(c, nullptr);
    if (c != nullptr) cqs_.push_back(c);
    return c;
  }
  ibv_cq_ex* CqEx() {
    ibv_cq_init_attr_ex attr{};
    attr.cqe = 256;
    attr.wc_flags = IBV_WC_STANDARD_FLAGS;
    ibv_cq_ex* c = v_.CreateCqEx(ctx, &attr);
    EXPECT_NE(c, nullptr);
    if (c != nullptr) cqs_.push_back(ibv_cq_ex_to_cq(c));
    return c;
  }
  ibv_srq* Srq() {
    ibv_srq_init_attr attr{};
    attr.attr.max_wr = 64;
    attr.attr.max_sge = 4;
    ibv_srq* s = v_.CreateSrq(pd, &attr);
    EXPECT_NE(s, nullptr);
    if (s != nullptr) srqs_.push_back(s);
    return s;
  }
  ibv_qp* Qp(ibv_qp_type type, uint32_t max_sge = 4, ibv_srq* srq = nullptr,
             ibv_cq* send_cq = nullptr, ibv_cq* recv_cq = nullptr) {
    ibv_qp_init_attr attr{};
    attr.send_cq = send_cq ? send_cq : cq;
    attr.recv_cq = recv_cq ? recv_cq : cq;
    attr.srq = srq;
    attr.qp_type = type;
    attr.cap.max_send_wr = 128;
    attr.cap.max_recv_wr = 128;
    attr.cap.max_send_sge = max_sge;
    attr.cap.max_recv_sge = max_sge;
    attr.cap.max_inline_data = 64;
    ibv_qp* qp = v_.CreateQp(pd, &attr);
    EXPECT_NE(qp, nullptr);
    if (qp != nullptr) qps_.push_back(qp);
    return qp;
  }
  // A QP with the ibv_wr_* API, on `send_cq` (default: the device's CQ).
  ibv_qp* QpEx(ibv_qp_type type, ibv_cq* send_cq = nullptr, ibv_cq* recv_cq = nullptr) {
    ibv_qp_init_attr_ex attr{};
    attr.send_cq = send_cq ? send_cq : cq;
    attr.recv_cq = recv_cq ? recv_cq : cq;
    attr.qp_type = type;
    attr.cap.max_send_wr = 64;
    attr.cap.max_recv_wr = 64;
    attr.cap.max_send_sge = 4;
    attr.cap.max_recv_sge = 4;
    attr.cap.max_inline_data = 64;
    attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    attr.pd = pd;
    attr.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                          IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                          IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
                          IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
    ibv_qp* qp = v_.CreateQpEx(ctx, &attr);
    EXPECT_NE(qp, nullptr);
    if (qp != nullptr) qps_.push_back(qp);
    return qp;
  }
  // Two QPs of `type` connected to each other, both in RTS.
  std::pair<ibv_qp*, ibv_qp*> Pair(ibv_qp_type type, uint32_t max_sge = 4) {
    ibv_qp* a = Qp(type, max_sge);
    ibv_qp* b = Qp(type, max_sge);
    EXPECT_EQ(ToRts(v_, a, b->qp_num, gid), 0);
    EXPECT_EQ(ToRts(v_, b, a->qp_num, gid), 0);
    return {a, b};
  }
  ibv_ah* Ah(const ibv_gid& dgid, uint8_t sgid_index = kIpv4GidIndex) {
    ibv_ah_attr attr{};
    attr.is_global = 1;
    attr.grh.dgid = dgid;
    attr.grh.sgid_index = sgid_index;
    attr.grh.hop_limit = 64;
    attr.port_num = FakeBackend::kPort;
    ibv_ah* ah = v_.CreateAh(pd, &attr);
    EXPECT_NE(ah, nullptr);
    if (ah != nullptr) ahs_.push_back(ah);
    return ah;
  }
  // Takes an object out of the teardown list (the test destroyed it).
  template <typename T>
  void Forget(T* p) {
    std::erase(qps_, reinterpret_cast<ibv_qp*>(p));
    std::erase(mrs_, reinterpret_cast<ibv_mr*>(p));
    std::erase(cqs_, reinterpret_cast<ibv_cq*>(p));
    std::erase(ahs_, reinterpret_cast<ibv_ah*>(p));
    std::erase(srqs_, reinterpret_cast<ibv_srq*>(p));
  }

  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_gid gid{};  // GID index 1, as these verbs report it

 private:
  V& v_;
  std::vector<ibv_mr*> mrs_;
  std::vector<ibv_comp_channel*> channels_;
  std::vector<ibv_cq*> cqs_;
  std::vector<ibv_srq*> srqs_;
  std::vector<ibv_qp*> qps_;
  std::vector<ibv_ah*> ahs_;
};

// Everything `cq` has now, through the inline ibv_poll_cq.
inline std::vector<ibv_wc> Drain(ibv_cq* cq) {
  std::vector<ibv_wc> out;
  ibv_wc wc[16];
  for (int n; (n = ibv_poll_cq(cq, 16, wc)) > 0;) out.insert(out.end(), wc, wc + n);
  return out;
}

inline ibv_sge Sge(const void* addr, uint32_t length, const ibv_mr* mr) {
  return ibv_sge{reinterpret_cast<uintptr_t>(addr), length, mr->lkey};
}

// Posts one receive WR of one SGE (`len` bytes at `buf`).
inline int PostRecvOf(ibv_qp* qp, uint64_t wr_id, char* buf, uint32_t len, const ibv_mr* mr) {
  ibv_sge sge = Sge(buf, len, mr);
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp, &wr, &bad);
}

// A signaled SEND of one SGE.
inline ibv_send_wr SignaledSend(ibv_sge* sge, uint64_t wr_id) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  return wr;
}

// A UD SEND of `sge` (none: an empty datagram) to `qpn` through `ah`.
inline ibv_send_wr UdSend(ibv_sge* sge, ibv_ah* ah, uint32_t qpn) {
  ibv_send_wr wr{};
  wr.sg_list = sge;
  wr.num_sge = sge != nullptr ? 1 : 0;
  wr.opcode = IBV_WR_SEND;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = qpn;
  wr.wr.ud.remote_qkey = kQkey;
  return wr;
}

// A Shim in offset mode (virtual != physical from the first resource on)
// over a FakeBackend, with an open device. TearDown checks that the shim
// gave back every real object and never handed a shadow to the backend.
class ShimTest : public ::testing::Test {
 protected:
  ShimTest() : ShimTest(IdentityMode{.offset = true}) {}
  explicit ShimTest(IdentityMode mode, bool migratable = false, bool probed = false)
      : shim_(&fake_, mode, migratable, probed) {
    dev_ = std::make_unique<Device<Shim>>(shim_);
  }
  void TearDown() override {
    dev_.reset();
    EXPECT_EQ(fake_.live_objects(), 0);
    EXPECT_EQ(fake_.foreign_objects(), 0);
  }
  Device<Shim>& dev() { return *dev_; }

  FakeBackend fake_;
  Shim shim_;
  std::unique_ptr<Device<Shim>> dev_;
};

// What an endpoint publishes when it moves, as its migrator carries it.
inline RemoteMapping ToMapping(const EndpointView& v) {
  RemoteMapping m;
  m.virtual_gid = v.virtual_gid;
  m.physical_gid = v.physical_gid;
  m.qpns = v.qpns;
  m.rkeys = v.rkeys;
  return m;
}

// Two migratable endpoints, P and Q (two Shims on one fake device), each
// with an open device and a registered buffer. TearDown checks that the
// shims gave back every real object, never handed a shadow to the fake and
// never destroyed a CQ whose events were not all acknowledged.
class TwoEndpointsTest : public ::testing::Test {
 protected:
  // `probed`: the shims' pause probes threads (a process's default)
  // instead of marking each call.
  explicit TwoEndpointsTest(bool probed = false)
      : p_(&fake_, IdentityMode{}, true, probed), q_(&fake_, IdentityMode{}, true, probed) {
    p_.set_app_thread_wait_ms(0);
    q_.set_app_thread_wait_ms(0);
    pdev_ = std::make_unique<Device<Shim>>(p_);
    qdev_ = std::make_unique<Device<Shim>>(q_);
    pmr_ = pdev_->Reg(pbuf_, sizeof(pbuf_));
    qmr_ = qdev_->Reg(qbuf_, sizeof(qbuf_));
  }
  void TearDown() override {
    qdev_.reset();
    pdev_.reset();
    EXPECT_EQ(fake_.live_objects(), 0);
    EXPECT_EQ(fake_.foreign_objects(), 0);
    EXPECT_EQ(fake_.blocked_destroys(), 0) << "a CQ destroyed with events not acknowledged";
  }

  // Both pause, Q first (a peer's quiesce comes before the mover's).
  void Quiesce() {
    uint32_t drained = 0;
    ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
    ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  }
  // P is released and re-created, Q re-points, P resumes.
  void ReleaseRestoreResume() {
    ASSERT_TRUE(p_.Release().ok());
    const Status st = p_.Restore("", {});
    ASSERT_TRUE(st.ok()) << st.message;
    const Status rq = q_.PeerReconnect(ToMapping(p_.Describe()));
    ASSERT_TRUE(rq.ok()) << rq.message;
    ASSERT_TRUE(p_.Resume().ok());
  }

  // `text` (with its NUL) from buf; on UD, through `ah` to QPN `to`.
  int Send(ibv_qp* qp, uint64_t wr_id, char* buf, ibv_mr* mr, const char* text,
           ibv_ah* ah = nullptr, uint32_t to = 0) {
    strcpy(buf, text);
    ibv_sge sge = Sge(buf, static_cast<uint32_t>(strlen(text) + 1), mr);
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = to;
    wr.wr.ud.remote_qkey = kQkey;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp, &wr, &bad);
  }

  FakeBackend fake_;
  Shim p_;
  Shim q_;
  std::unique_ptr<Device<Shim>> pdev_;
  std::unique_ptr<Device<Shim>> qdev_;
  char pbuf_[4096] = {};
  char qbuf_[4096] = {};
  ibv_mr* pmr_ = nullptr;
  ibv_mr* qmr_ = nullptr;
  ibv_qp* pqp_ = nullptr;
  ibv_qp* qqp_ = nullptr;
};

}  // namespace rdmavirt::shim::testing

#endif  // RDMAVIRT_TESTS_SHIM_VERBS_TEST_UTIL_H_
