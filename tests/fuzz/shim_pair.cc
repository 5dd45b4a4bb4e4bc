#include "tests/fuzz/shim_pair.h"

#include <cstring>
#include <string>

#include "tests/fuzz/fuzz_util.h"

namespace rdmavirt::fuzz {
namespace {

constexpr uint8_t kGidIndex = 1;  // FakeBackend's ::ffff:10.77.0.9
constexpr uint32_t kQkey = 0x11111111;
constexpr unsigned int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

}  // namespace

ShimPair::ShimPair() {
  Open(&p_);
  Open(&q_);
  ibv_qp* p_rc = Qp(&p_, IBV_QPT_RC);
  ibv_qp* p_uc = Qp(&p_, IBV_QPT_UC);
  ibv_qp* p_rc2 = Qp(&p_, IBV_QPT_RC);
  p_ud_ = Qp(&p_, IBV_QPT_UD);
  q_rc_ = Qp(&q_, IBV_QPT_RC);
  q_uc_ = Qp(&q_, IBV_QPT_UC);
  q_srq_qp_ = Qp(&q_, IBV_QPT_RC, q_.srq);
  q_ud_ = Qp(&q_, IBV_QPT_UD);
  ToRts(&p_, p_rc, q_rc_->qp_num, q_.gid);
  ToRts(&q_, q_rc_, p_rc->qp_num, p_.gid);
  ToRts(&p_, p_uc, q_uc_->qp_num, q_.gid);
  ToRts(&q_, q_uc_, p_uc->qp_num, p_.gid);
  ToRts(&p_, p_rc2, q_srq_qp_->qp_num, q_.gid);
  ToRts(&q_, q_srq_qp_, p_rc2->qp_num, p_.gid);
  ToRts(&p_, p_ud_, 0, {});
  ToRts(&q_, q_ud_, 0, {});
  ibv_ah_attr ah{};
  ah.is_global = 1;
  ah.grh.dgid = p_.gid;
  ah.grh.sgid_index = kGidIndex;
  ah.grh.hop_limit = 64;
  ah.port_num = shim::FakeBackend::kPort;
  q_ah_ = q_.shim.CreateAh(q_.pd, &ah);
  Check(q_ah_ != nullptr, "setup: create_ah");
  q_.ahs.push_back(q_ah_);
  for (ibv_qp* qp : {p_rc, p_uc, p_ud_, q_rc_, q_uc_, q_ud_})
    for (int i = 0; i < 2; ++i) PostRecv(qp, next_wr_id_++);
  for (int i = 0; i < 2; ++i) PostRecv(q_srq_qp_, next_wr_id_++);
}

ShimPair::~ShimPair() {
  if (!closed_) {
    Destroy(&q_);
    Destroy(&p_);
  }
}

void ShimPair::Open(Side* s) {
  int n = 0;
  ibv_device** list = s->shim.GetDeviceList(&n);
  Check(list != nullptr && n == 1, "setup: get_device_list");
  s->ctx = s->shim.OpenDevice(list[0]);
  s->shim.FreeDeviceList(list);
  Check(s->ctx != nullptr, "setup: open_device");
  s->pd = s->shim.AllocPd(s->ctx);
  Check(s->pd != nullptr, "setup: alloc_pd");
  s->cq = s->shim.CreateCq(s->ctx, 256, nullptr, nullptr, 0);
  Check(s->cq != nullptr, "setup: create_cq");
  s->mr =
      s->shim.RegMr(s->pd, s->buf, sizeof(s->buf), reinterpret_cast<uintptr_t>(s->buf), kAccess);
  Check(s->mr != nullptr, "setup: reg_mr");
  ibv_srq_init_attr srq{};
  srq.attr.max_wr = 64;
  srq.attr.max_sge = 2;
  s->srq = s->shim.CreateSrq(s->pd, &srq);
  Check(s->srq != nullptr, "setup: create_srq");
  Check(s->shim.QueryGid(s->ctx, shim::FakeBackend::kPort, kGidIndex, &s->gid) == 0,
        "setup: query_gid");
}

ibv_qp* ShimPair::Qp(Side* s, ibv_qp_type type, ibv_srq* srq) {
  ibv_qp_init_attr attr{};
  attr.send_cq = s->cq;
  attr.recv_cq = s->cq;
  attr.srq = srq;
  attr.qp_type = type;
  attr.cap.max_send_wr = 64;
  attr.cap.max_recv_wr = 64;
  attr.cap.max_send_sge = 2;
  attr.cap.max_recv_sge = 2;
  attr.cap.max_inline_data = 64;
  ibv_qp* qp = s->shim.CreateQp(s->pd, &attr);
  Check(qp != nullptr, "setup: create_qp");
  s->qps.push_back(qp);
  return qp;
}

void ShimPair::ToRts(Side* s, ibv_qp* qp, uint32_t dest_qpn, const ibv_gid& dgid) {
  const bool ud = qp->qp_type == IBV_QPT_UD;
  const bool rc = qp->qp_type == IBV_QPT_RC;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = shim::FakeBackend::kPort;
  int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (ud) {
    a.qkey = kQkey;
    mask |= IBV_QP_QKEY;
  } else {
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  Check(s->shim.ModifyQp(qp, &a, mask) == 0, "setup: modify_qp to INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  mask = IBV_QP_STATE;
  if (!ud) {
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest_qpn;
    a.rq_psn = 0x1234;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = dgid;
    a.ah_attr.grh.sgid_index = kGidIndex;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.port_num = shim::FakeBackend::kPort;
    mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  }
  if (rc) {
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  }
  Check(s->shim.ModifyQp(qp, &a, mask) == 0, "setup: modify_qp to RTR");
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
  Check(s->shim.ModifyQp(qp, &a, mask) == 0, "setup: modify_qp to RTS");
}

void ShimPair::PostRecv(ibv_qp* qp, uint64_t wr_id) {
  Side& s = qp->context == p_.ctx ? p_ : q_;
  const size_t slot = wr_id % 32;
  ibv_sge sge{reinterpret_cast<uintptr_t>(s.buf + 4096 + 64 * slot), 64, s.mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (qp->srq != nullptr)
    (void)ibv_post_srq_recv(qp->srq, &wr, &bad);
  else
    (void)ibv_post_recv(qp, &wr, &bad);
}

void ShimPair::AppStep(uint8_t op) {
  const uint64_t wr_id = next_wr_id_++;
  switch (op % 6) {
    case 0:
    case 1:
    case 2: {
      ibv_qp* qp = op % 6 == 0 ? q_rc_ : op % 6 == 1 ? q_uc_ : q_ud_;
      ibv_sge sge{reinterpret_cast<uintptr_t>(q_.buf), 32, q_.mr->lkey};
      ibv_send_wr wr{};
      wr.wr_id = wr_id;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = IBV_SEND_SIGNALED | (op & 0x40 ? IBV_SEND_INLINE : 0);
      wr.wr.ud.ah = q_ah_;
      wr.wr.ud.remote_qpn = p_ud_->qp_num;
      wr.wr.ud.remote_qkey = kQkey;
      ibv_send_wr* bad = nullptr;
      (void)ibv_post_send(qp, &wr, &bad);
      break;
    }
    case 3: {
      ibv_sge sge{reinterpret_cast<uintptr_t>(q_.buf + 64), 16, q_.mr->lkey};
      ibv_send_wr wr{};
      wr.wr_id = wr_id;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(p_.buf + 128);
      wr.wr.rdma.rkey = p_.mr->rkey;
      ibv_send_wr* bad = nullptr;
      (void)ibv_post_send(q_rc_, &wr, &bad);
      break;
    }
    case 4:
      PostRecv(op & 0x40 ? q_srq_qp_ : q_rc_, wr_id);
      break;
    case 5: {
      ibv_wc wc[8];
      (void)ibv_poll_cq(op & 0x40 ? p_.cq : q_.cq, 8, wc);
      break;
    }
  }
}

std::string ShimPair::Destroy(Side* s) {
  std::string failed;
  auto check = [&](int rc, const char* verb) {
    if (rc != 0 && failed.empty()) failed = std::string(verb) + ": " + strerror(rc);
  };
  for (auto it = s->ahs.rbegin(); it != s->ahs.rend(); ++it)
    check(s->shim.DestroyAh(*it), "destroy_ah");
  for (auto it = s->qps.rbegin(); it != s->qps.rend(); ++it)
    check(s->shim.DestroyQp(*it), "destroy_qp");
  s->ahs.clear();
  s->qps.clear();
  if (s->srq != nullptr) check(s->shim.DestroySrq(s->srq), "destroy_srq");
  if (s->mr != nullptr) check(s->shim.DeregMr(s->mr), "dereg_mr");
  if (s->cq != nullptr) check(s->shim.DestroyCq(s->cq), "destroy_cq");
  if (s->pd != nullptr) check(s->shim.DeallocPd(s->pd), "dealloc_pd");
  if (s->ctx != nullptr) check(s->shim.CloseDevice(s->ctx), "close_device");
  s->srq = nullptr;
  s->mr = nullptr;
  s->cq = nullptr;
  s->pd = nullptr;
  s->ctx = nullptr;
  return failed;
}

void ShimPair::CloseAndCheck() {
  closed_ = true;
  const std::string q_failed = Destroy(&q_);
  const std::string p_failed = Destroy(&p_);
  Check(q_failed.empty(), "Q's teardown after the control requests: " + q_failed);
  Check(p_failed.empty(), "P's teardown: " + p_failed);
  Check(fake_.live_objects() == 0, "the shim kept real verbs objects after every destroy");
  Check(fake_.foreign_objects() == 0, "the shim handed a shadow object to the device");
  Check(fake_.blocked_destroys() == 0, "a CQ was destroyed with events not acknowledged");
}

}  // namespace rdmavirt::fuzz
