// The shim's journal: each QP's transitions as the application asked for
// them (virtual identities), and the receives still outstanding.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

using JournalTest = ShimTest;

const Qp* Find(const Shim& shim, const ibv_qp* qp) {
  for (const Qp* q : shim.Qps())
    if (&q->shadow.qp_base == qp) return q;
  return nullptr;
}

TEST_F(JournalTest, TransitionsKeepTheVirtualAttributesInOrder) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  const Qp* qa = Find(shim_, a);
  ASSERT_NE(qa, nullptr);
  ASSERT_EQ(qa->transitions.size(), 3u);
  const auto& t = qa->transitions;
  EXPECT_EQ(t[0].attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(t[0].mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  EXPECT_EQ(t[1].attr.qp_state, IBV_QPS_RTR);
  EXPECT_TRUE(t[1].mask & IBV_QP_DEST_QPN);
  EXPECT_EQ(t[1].attr.dest_qp_num, b->qp_num) << "virtual, as the application gave it";
  EXPECT_NE(t[1].attr.dest_qp_num, ShimQp(b)->real->qp_num);
  EXPECT_TRUE(GidEq(t[1].attr.ah_attr.grh.dgid, dev().gid));
  EXPECT_FALSE(GidEq(t[1].attr.ah_attr.grh.dgid, FakeBackend::Gid(1)));
  EXPECT_EQ(t[1].attr.rq_psn, 0x1234u);
  EXPECT_EQ(t[2].attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(t[2].attr.sq_psn, 0x1234u);
  EXPECT_EQ(t[2].attr.retry_cnt, 7);
}

TEST_F(JournalTest, UdTransitionsKeepTheQkey) {
  ibv_qp* qp = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, qp, 0, {}), 0);
  const Qp* q = Find(shim_, qp);
  ASSERT_NE(q, nullptr);
  ASSERT_EQ(q->transitions.size(), 3u);
  EXPECT_EQ(q->transitions[0].attr.qkey, kQkey);
  EXPECT_TRUE(q->transitions[0].mask & IBV_QP_QKEY);
}

TEST_F(JournalTest, FailedTransitionsAreNotJournaled) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;  // RESET -> RTR: the device refuses
  EXPECT_EQ(shim_.ModifyQp(qp, &attr, IBV_QP_STATE), EINVAL);
  fake_.FailNext(FakeBackend::Op::kModifyQp, ETIMEDOUT);
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  EXPECT_EQ(shim_.ModifyQp(qp, &attr,
                           IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
            ETIMEDOUT);
  EXPECT_EQ(qp->state, IBV_QPS_RESET);
  const Qp* q = Find(shim_, qp);
  ASSERT_NE(q, nullptr);
  EXPECT_TRUE(q->transitions.empty());
  ASSERT_EQ(ToRts(shim_, qp, qp->qp_num, dev().gid), 0);
  EXPECT_EQ(q->transitions.size(), 3u);
}

TEST_F(JournalTest, QpsListsEachLiveQpOnce) {
  ibv_qp* a = dev().Qp(IBV_QPT_RC);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  EXPECT_EQ(shim_.Qps().size(), 2u);
  EXPECT_NE(Find(shim_, a), nullptr);
  EXPECT_NE(Find(shim_, b), nullptr);
  ASSERT_EQ(shim_.DestroyQp(a), 0);
  dev().Forget(a);
  EXPECT_EQ(shim_.Qps().size(), 1u);
  EXPECT_EQ(Find(shim_, b)->init.qp_type, IBV_QPT_UD);
}

TEST_F(JournalTest, MrsKeepRegistrationParameters) {
  char buf[32];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ASSERT_EQ(shim_.Mrs().size(), 1u);
  const Mr* m = shim_.Mrs()[0];
  EXPECT_EQ(&m->shadow, mr);
  EXPECT_EQ(m->iova, reinterpret_cast<uintptr_t>(buf));
  EXPECT_EQ(m->access, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
}

// A UD receive's GRH is rewritten to virtual addresses from the receive
// journal (RecvLog), so it shows whether the journal still knew the WR.
class UdJournalTest : public ShimTest {
 protected:
  void SetUp() override {
    a_ = dev().Qp(IBV_QPT_UD);
    b_ = dev().Qp(IBV_QPT_UD);
    ASSERT_EQ(ToRts(shim_, a_, 0, {}), 0);
    ASSERT_EQ(ToRts(shim_, b_, 0, {}), 0);
    ah_ = dev().Ah(dev().gid);
    mr_ = dev().Reg(buf_, sizeof(buf_));
  }
  // Sends one datagram from a_ to b_; true if b_'s receive completed.
  bool SendOne() {
    ibv_send_wr wr = UdSend(nullptr, ah_, b_->qp_num);
    ibv_send_wr* bad;
    EXPECT_EQ(ibv_post_send(a_, &wr, &bad), 0);
    const auto wcs = Drain(dev().cq);
    return wcs.size() == 1 && wcs[0].status == IBV_WC_SUCCESS && wcs[0].qp_num == b_->qp_num;
  }
  // The IPv4 source address of the GRH at `grh`, as a GID.
  static ibv_gid Source(const char* grh) {
    ibv_gid g{};
    g.raw[10] = g.raw[11] = 0xff;
    memcpy(g.raw + 12, grh + 32, 4);
    return g;
  }

  ibv_qp* a_ = nullptr;
  ibv_qp* b_ = nullptr;
  ibv_ah* ah_ = nullptr;
  ibv_mr* mr_ = nullptr;
  char buf_[256] = {};
};

TEST_F(UdJournalTest, EveryReceiveOfAChainShowsVirtualAddresses) {
  ibv_sge sges[3];
  ibv_recv_wr wrs[3] = {};
  for (int i = 0; i < 3; ++i) {
    sges[i] = Sge(buf_ + 64 * i, 64, mr_);
    wrs[i].wr_id = 30 + i;
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
    wrs[i].next = i < 2 ? &wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(b_, wrs, &bad), 0);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(SendOne()) << i;
    EXPECT_TRUE(GidEq(Source(buf_ + 64 * i), dev().gid)) << i;
  }
}

// A receive the queue cannot take (too many SGEs) is refused on its own:
// the receives posted before it stay journaled.
TEST_F(UdJournalTest, ARefusedReceiveKeepsEarlierOnesJournaled) {
  ibv_sge sges[6];
  sges[0] = Sge(buf_, 64, mr_);
  for (int i = 1; i < 6; ++i) sges[i] = Sge(buf_ + 64 + 8 * i, 8, mr_);
  ibv_recv_wr wrs[2] = {};
  wrs[0].wr_id = 1;
  wrs[0].sg_list = sges;
  wrs[0].num_sge = 1;
  wrs[0].next = &wrs[1];
  wrs[1].wr_id = 2;
  wrs[1].sg_list = sges + 1;
  wrs[1].num_sge = 5;  // the QP takes 4
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(b_, wrs, &bad), EINVAL);
  ASSERT_EQ(bad, &wrs[1]);
  ASSERT_TRUE(SendOne());
  EXPECT_TRUE(GidEq(Source(buf_), dev().gid));
}

// A UD QP's send completion takes nothing from its receive journal: with
// the same wr_id on a send and a receive (rdma-core's pyverbs tests use 0
// for all), the send's completion, polled first, used to take the
// receive's record, and the datagram then kept its physical GRH.
TEST_F(UdJournalTest, ASendCompletionWithTheReceivesWrIdLeavesItsRecord) {
  ASSERT_EQ(PostRecvOf(b_, 7, buf_, 64, mr_), 0);
  ASSERT_EQ(PostRecvOf(a_, 7, buf_ + 128, 64, mr_), 0);  // a_'s datagram lands apart
  // b_ sends first (signaled, wr_id 7), then a_ sends to b_.
  ibv_send_wr from_b = UdSend(nullptr, ah_, a_->qp_num);
  from_b.wr_id = 7;
  from_b.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(b_, &from_b, &bad), 0);
  ibv_send_wr from_a = UdSend(nullptr, ah_, b_->qp_num);
  ASSERT_EQ(ibv_post_send(a_, &from_a, &bad), 0);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 3u);
  std::vector<ibv_wc_opcode> of_b;  // b_'s completions, in polling order
  for (const ibv_wc& wc : wcs) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
    if (wc.qp_num == b_->qp_num) of_b.push_back(wc.opcode);
  }
  const std::vector<ibv_wc_opcode> send_then_recv = {IBV_WC_SEND, IBV_WC_RECV};
  ASSERT_EQ(of_b, send_then_recv) << "b_'s send completion is polled before its receive";
  EXPECT_TRUE(GidEq(Source(buf_), dev().gid)) << "b_'s datagram shows the virtual source";
}

// Two UD QPs share an SRQ and complete on CQs of their own: a datagram
// polled from the second CQ first, then one from the first, each shows
// virtual addresses in the buffer it landed in.
TEST_F(JournalTest, UdReceivesOfOneSrqPolledOutOfPostingOrderAreEachRewritten) {
  ibv_srq* srq = dev().Srq();
  ibv_cq* first_cq = dev().Cq();
  ibv_cq* second_cq = dev().Cq();
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b1 = dev().Qp(IBV_QPT_UD, 4, srq, nullptr, first_cq);
  ibv_qp* b2 = dev().Qp(IBV_QPT_UD, 4, srq, nullptr, second_cq);
  for (ibv_qp* qp : {a, b1, b2}) ASSERT_EQ(ToRts(shim_, qp, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char buf[2][FakeBackend::kGrhBytes + 16] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  for (uint64_t i = 0; i < 2; ++i) {
    ibv_sge sge = Sge(buf[i], sizeof(buf[i]), mr);
    ibv_recv_wr wr{};
    wr.wr_id = 40 + i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad;
    ASSERT_EQ(ibv_post_srq_recv(srq, &wr, &bad), 0);
  }
  for (ibv_qp* to : {b1, b2}) {  // buf[0] to b1, buf[1] to b2
    ibv_send_wr wr = UdSend(nullptr, ah, to->qp_num);
    ibv_send_wr* bad;
    ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  }
  const auto second = Drain(second_cq);
  const auto first = Drain(first_cq);
  ASSERT_EQ(second.size(), 1u);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(second[0].wr_id, 41u);
  EXPECT_EQ(first[0].wr_id, 40u);
  for (int i = 0; i < 2; ++i) {
    const auto* ip = reinterpret_cast<const uint8_t*>(buf[i]) + 20;
    EXPECT_EQ(memcmp(ip + 12, dev().gid.raw + 12, 4), 0) << "source, buffer " << i;
  }
}

// A GRH scattered over several small SGEs is rewritten where it lies,
// never outside the receive buffers.
TEST_F(JournalTest, UdGrhRewriteStaysInsideTheReceiveBuffers) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  auto head = std::make_unique<char[]>(16);  // GRH bytes 0..15
  auto tail = std::make_unique<char[]>(64);  // the rest of the GRH, then data
  ibv_mr* hmr = dev().Reg(head.get(), 16);
  ibv_mr* tmr = dev().Reg(tail.get(), 64);
  ibv_sge sges[2] = {Sge(head.get(), 16, hmr), Sge(tail.get(), 64, tmr)};
  ibv_recv_wr rwr{};
  rwr.sg_list = sges;
  rwr.num_sge = 2;
  ibv_recv_wr* rbad;
  ASSERT_EQ(ibv_post_recv(b, &rwr, &rbad), 0);
  ibv_send_wr wr = UdSend(nullptr, ah, b->qp_num);
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  // The IPv4 header (GRH bytes 20..39) is at tail[4..23]: virtual source.
  EXPECT_EQ(memcmp(tail.get() + 4 + 12, dev().gid.raw + 12, 4), 0);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
