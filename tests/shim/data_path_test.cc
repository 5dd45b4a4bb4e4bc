// The shim's data path over FakeBackend, through the inline verbs an
// application calls on shadow objects: what the device is given (physical
// keys, QPNs, AHs), what the application gets back (virtual QPNs and
// GIDs), and that its work requests are untouched afterwards.
#include "shim/datapath/data_path.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

// A chain of send WRs the test owns, with a byte snapshot to prove the
// shim put everything back.
class SendChain {
 public:
  // `sges[i]` SGEs for WR i, each `len` bytes of `buf` (registered as `mr`).
  SendChain(const std::vector<int>& sges, char* buf, uint32_t len, const ibv_mr* mr)
      : wrs_(sges.size()), lists_(sges.size()) {
    size_t off = 0;
    for (size_t i = 0; i < sges.size(); ++i) {
      for (int j = 0; j < sges[i]; ++j, off += len) lists_[i].push_back(Sge(buf + off, len, mr));
      wrs_[i].wr_id = 1000 + i;
      wrs_[i].sg_list = lists_[i].data();
      wrs_[i].num_sge = sges[i];
      wrs_[i].opcode = IBV_WR_SEND;
      wrs_[i].next = i + 1 < sges.size() ? &wrs_[i + 1] : nullptr;
    }
  }
  ibv_send_wr* head() { return wrs_.data(); }
  ibv_send_wr& wr(size_t i) { return wrs_[i]; }
  size_t size() const { return wrs_.size(); }
  void Snapshot() {
    wr_bytes_.assign(reinterpret_cast<const char*>(wrs_.data()),
                     reinterpret_cast<const char*>(wrs_.data() + wrs_.size()));
    sge_bytes_.clear();
    for (const auto& l : lists_)
      sge_bytes_.emplace_back(reinterpret_cast<const char*>(l.data()),
                              reinterpret_cast<const char*>(l.data() + l.size()));
  }
  bool Unchanged() const {
    if (memcmp(wr_bytes_.data(), wrs_.data(), wr_bytes_.size()) != 0) return false;
    for (size_t i = 0; i < lists_.size(); ++i)
      if (!lists_[i].empty() &&
          memcmp(sge_bytes_[i].data(), lists_[i].data(), sge_bytes_[i].size()) != 0)
        return false;
    return true;
  }

 private:
  std::vector<ibv_send_wr> wrs_;
  std::vector<std::vector<ibv_sge>> lists_;
  std::string wr_bytes_;
  std::vector<std::string> sge_bytes_;
};

ibv_recv_wr RecvWr(ibv_sge* sge, int n, uint64_t wr_id) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sge;
  wr.num_sge = n;
  return wr;
}

int PostRecv(ibv_qp* qp, void* buf, uint32_t len, const ibv_mr* mr, uint64_t wr_id) {
  ibv_sge sge = Sge(buf, len, mr);
  ibv_recv_wr wr = RecvWr(&sge, 1, wr_id);
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp, &wr, &bad);
}

// A WR of `opcode` (any number, stored as a C program may: C++ may not
// make the enum hold one outside its range) with one SGE, toward `buf` at
// `mr`'s rkey where RDMA ops keep it.
ibv_send_wr RdmaWr(uint32_t opcode, ibv_sge* sge, const char* buf, const ibv_mr* mr) {
  ibv_send_wr wr{};
  static_assert(sizeof(wr.opcode) == sizeof(opcode));
  std::memcpy(&wr.opcode, &opcode, sizeof(opcode));
  wr.sg_list = sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(buf);
  wr.wr.rdma.rkey = mr->rkey;
  return wr;
}

bool Ipv4ChecksumOk(const uint8_t* ip) {
  uint32_t sum = 0;
  for (int i = 0; i < 20; i += 2) sum += ip[i] << 8 | ip[i + 1];
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  return sum == 0xffff;
}

using DataPathTest = ShimTest;

TEST_F(DataPathTest, RcSendTranslatesLkeysAndCompletesWithVirtualQpns) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  char src[32] = "through the shim";
  char dst[32] = {};
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(PostRecv(b, dst, sizeof(dst), dmr, 7), 0);
  ibv_sge sge = Sge(src, 17, smr);
  ibv_send_wr wr = SignaledSend(&sge, 9);
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);

  EXPECT_EQ(sge.lkey, smr->lkey) << "the application's SGE is restored";
  ASSERT_FALSE(fake_.sends().empty());
  EXPECT_EQ(fake_.sends().back().lkeys, std::vector<uint32_t>{ShimMr(smr)->real->lkey});
  EXPECT_EQ(fake_.sends().back().qp_num, ShimQp(a)->real->qp_num);
  EXPECT_EQ(fake_.recvs().back().lkeys, std::vector<uint32_t>{ShimMr(dmr)->real->lkey});

  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wcs[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(wcs[0].wr_id, 7u);
  EXPECT_EQ(wcs[0].qp_num, b->qp_num);
  EXPECT_EQ(wcs[0].byte_len, 17u);
  EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wcs[1].opcode, IBV_WC_SEND);
  EXPECT_EQ(wcs[1].wr_id, 9u);
  EXPECT_EQ(wcs[1].qp_num, a->qp_num);
  EXPECT_STREQ(dst, "through the shim");
}

TEST_F(DataPathTest, RdmaAndAtomicsTranslateRkeys) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  (void)b;
  struct alignas(8) Region {
    char data[32];
    uint64_t counter;
  } local{}, remote{};
  ibv_mr* lmr = dev().Reg(&local, sizeof(local));
  ibv_mr* rmr = dev().Reg(&remote, sizeof(remote));
  const uint32_t physical_rkey = ShimMr(rmr)->real->rkey;
  ASSERT_NE(rmr->rkey, physical_rkey);
  char imm_buf[4];
  ibv_mr* imm_mr = dev().Reg(imm_buf, sizeof(imm_buf));
  ASSERT_EQ(PostRecv(b, imm_buf, sizeof(imm_buf), imm_mr, 77), 0);

  strcpy(local.data, "written");
  remote.counter = 40;
  ibv_sge data_sge = Sge(local.data, 8, lmr);
  ibv_sge counter_sge = Sge(&local.counter, 8, lmr);
  ibv_send_wr wrs[4] = {};
  wrs[0].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wrs[0].imm_data = htobe32(5);
  wrs[0].sg_list = &data_sge;
  wrs[0].num_sge = 1;
  wrs[0].wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(remote.data);
  wrs[0].wr.rdma.rkey = rmr->rkey;
  wrs[1].opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  wrs[1].sg_list = &counter_sge;
  wrs[1].num_sge = 1;
  wrs[1].wr.atomic.remote_addr = reinterpret_cast<uintptr_t>(&remote.counter);
  wrs[1].wr.atomic.rkey = rmr->rkey;
  wrs[1].wr.atomic.compare_add = 2;
  wrs[2].opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
  wrs[2].sg_list = &counter_sge;
  wrs[2].num_sge = 1;
  wrs[2].wr.atomic.remote_addr = reinterpret_cast<uintptr_t>(&remote.counter);
  wrs[2].wr.atomic.rkey = rmr->rkey;
  wrs[2].wr.atomic.compare_add = 42;
  wrs[2].wr.atomic.swap = 7;
  wrs[3].opcode = IBV_WR_RDMA_READ;
  wrs[3].sg_list = &data_sge;
  wrs[3].num_sge = 1;
  wrs[3].wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(remote.data) + 1;
  wrs[3].wr.rdma.rkey = rmr->rkey;
  for (int i = 0; i < 4; ++i) {
    wrs[i].wr_id = 500 + i;
    wrs[i].send_flags = IBV_SEND_SIGNALED;
    wrs[i].next = i < 3 ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr before[4];
  memcpy(before, wrs, sizeof(wrs));
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, wrs, &bad), 0);
  EXPECT_EQ(memcmp(before, wrs, sizeof(wrs)), 0);

  const auto sends = fake_.sends();
  ASSERT_GE(sends.size(), 4u);
  for (size_t i = sends.size() - 4; i < sends.size(); ++i) {
    EXPECT_EQ(sends[i].rkey, physical_rkey) << "WR " << sends[i].wr_id;
    EXPECT_EQ(sends[i].lkeys, std::vector<uint32_t>{ShimMr(lmr)->real->lkey});
  }
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 5u);
  EXPECT_EQ(wcs[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(wcs[0].qp_num, b->qp_num);
  EXPECT_EQ(wcs[0].imm_data, htobe32(5));
  const ibv_wc_opcode want[] = {IBV_WC_RDMA_WRITE, IBV_WC_FETCH_ADD, IBV_WC_COMP_SWAP,
                                IBV_WC_RDMA_READ};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(wcs[1 + i].status, IBV_WC_SUCCESS) << i;
    EXPECT_EQ(wcs[1 + i].opcode, want[i]);
    EXPECT_EQ(wcs[1 + i].qp_num, a->qp_num);
    EXPECT_EQ(wcs[1 + i].wr_id, 500u + i);
  }
  EXPECT_STREQ(remote.data, "written");
  EXPECT_EQ(remote.counter, 7u);  // 40 + 2 = 42, then swapped for 7
  EXPECT_EQ(local.counter, 42u);  // what the compare-and-swap found
  EXPECT_STREQ(local.data, "ritten");
}

TEST_F(DataPathTest, InlineSendDeliversWithoutUsingTheLkey) {
  auto [a, b] = dev().Pair(IBV_QPT_UC);
  char dst[16] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(PostRecv(b, dst, sizeof(dst), dmr, 1), 0);
  char msg[] = "inline";
  ibv_sge sge{reinterpret_cast<uintptr_t>(msg), sizeof(msg), 0};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(sge.lkey, 0u);
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_STREQ(dst, "inline");
}

TEST_F(DataPathTest, UdTranslatesAhAndQpnAndShowsVirtualAddresses) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char src[8] = "ping";
  char dst[FakeBackend::kGrhBytes + 16] = {};
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(PostRecv(b, dst, sizeof(dst), dmr, 3), 0);
  ibv_sge sge = Sge(src, 5, smr);
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.imm_data = htobe32(0x77);
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = b->qp_num;
  wr.wr.ud.remote_qkey = kQkey;
  const ibv_send_wr before = wr;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(memcmp(&before, &wr, sizeof(wr)), 0);

  const auto sent = fake_.sends().back();
  EXPECT_EQ(sent.ah, ShimAh(ah)->real);
  EXPECT_EQ(sent.remote_qpn, ShimQp(b)->real->qp_num);
  EXPECT_EQ(sent.remote_qkey, kQkey);

  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u) << "delivered (the device only accepts physical addresses)";
  const ibv_wc wc = wcs[0];
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.qp_num, b->qp_num);
  EXPECT_EQ(wc.src_qp, a->qp_num);
  EXPECT_EQ(wc.imm_data, htobe32(0x77));
  EXPECT_TRUE(wc.wc_flags & IBV_WC_GRH);
  EXPECT_STREQ(dst + FakeBackend::kGrhBytes, "ping");

  // The GRH's IPv4 header shows virtual addresses, with a valid checksum.
  const auto* ip = reinterpret_cast<const uint8_t*>(dst) + 20;
  EXPECT_EQ(ip[0], 0x45);
  EXPECT_TRUE(Ipv4ChecksumOk(ip));
  EXPECT_EQ(memcmp(ip + 12, dev().gid.raw + 12, 4), 0) << "source";
  EXPECT_EQ(memcmp(ip + 16, dev().gid.raw + 12, 4), 0) << "destination";

  // Replying through an AH made from the completion reaches the sender.
  ibv_ah* reply =
      shim_.CreateAhFromWc(dev().pd, const_cast<ibv_wc*>(&wc), reinterpret_cast<ibv_grh*>(dst), 1);
  ASSERT_NE(reply, nullptr);
  EXPECT_TRUE(GidEq(fake_.ahs().back().attr.grh.dgid, FakeBackend::Gid(1)));
  EXPECT_EQ(fake_.ahs().back().attr.grh.sgid_index, 1);
  EXPECT_TRUE(GidEq(ShimAh(reply)->attr.grh.dgid, dev().gid));
  char back[FakeBackend::kGrhBytes + 16] = {};
  ibv_mr* bmr = dev().Reg(back, sizeof(back));
  ASSERT_EQ(PostRecv(a, back, sizeof(back), bmr, 4), 0);
  wr.wr.ud.ah = reply;
  wr.wr.ud.remote_qpn = wc.src_qp;
  ASSERT_EQ(ibv_post_send(b, &wr, &bad), 0);
  wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].qp_num, a->qp_num);
  EXPECT_EQ(wcs[0].src_qp, b->qp_num);
  EXPECT_STREQ(back + FakeBackend::kGrhBytes, "ping");
  EXPECT_EQ(shim_.DestroyAh(reply), 0);
}

TEST_F(DataPathTest, InitAhFromWcGivesVirtualDestination) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char buf[FakeBackend::kGrhBytes + 8] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ASSERT_EQ(PostRecv(a, buf, sizeof(buf), mr, 1), 0);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = a->qp_num;  // to itself
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  ibv_ah_attr attr{};
  ASSERT_EQ(shim_.InitAhFromWc(dev().ctx, 1, &wcs[0], reinterpret_cast<ibv_grh*>(buf), &attr), 0);
  EXPECT_TRUE(attr.is_global);
  EXPECT_TRUE(GidEq(attr.grh.dgid, dev().gid));
  EXPECT_EQ(attr.grh.sgid_index, kIpv4GidIndex);
}

TEST_F(DataPathTest, ChainOfManyWrsIsUntouchedAfterPost) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  char buf[64] = {};
  char dst[64] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  for (int i = 0; i < 8; ++i) ASSERT_EQ(PostRecv(b, dst + 8 * i, 8, dmr, i), 0);
  SendChain chain({1, 2, 0, 3, 1, 4, 2, 1}, buf, 2, mr);
  chain.wr(2).opcode = IBV_WR_SEND_WITH_IMM;
  chain.wr(7).send_flags = IBV_SEND_SIGNALED;
  chain.Snapshot();
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, chain.head(), &bad), 0);
  EXPECT_TRUE(chain.Unchanged());
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 9u);
  for (const ibv_wc& wc : wcs) EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
}

TEST_F(DataPathTest, ChainBeyondPatchCapacityIsPostedInPiecesAndUntouched) {
  constexpr uint32_t kSge = 16;
  constexpr int kWrs = 5;  // 80 SGEs: more than the shim patches in one call
  ibv_qp* a = dev().Qp(IBV_QPT_RC, kSge);
  ibv_qp* b = dev().Qp(IBV_QPT_RC, kSge);
  ASSERT_EQ(ToRts(shim_, a, b->qp_num, dev().gid), 0);
  ASSERT_EQ(ToRts(shim_, b, a->qp_num, dev().gid), 0);
  std::vector<char> src(kSge * kWrs);
  std::iota(src.begin(), src.end(), 1);
  std::vector<char> dst(src.size());
  ibv_mr* smr = dev().Reg(src.data(), src.size());
  ibv_mr* dmr = dev().Reg(dst.data(), dst.size());
  for (int i = 0; i < kWrs; ++i) ASSERT_EQ(PostRecv(b, &dst[i * kSge], kSge, dmr, i), 0);
  SendChain chain(std::vector<int>(kWrs, kSge), src.data(), 1, smr);
  chain.Snapshot();
  const int calls = fake_.post_send_calls();
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, chain.head(), &bad), 0);
  EXPECT_GT(fake_.post_send_calls() - calls, 1) << "posted in pieces";
  EXPECT_TRUE(chain.Unchanged());
  // Every SGE reached the device translated, in order.
  const auto sends = fake_.sends();
  ASSERT_GE(sends.size(), static_cast<size_t>(kWrs));
  for (size_t i = sends.size() - kWrs; i < sends.size(); ++i) {
    EXPECT_EQ(sends[i].lkeys, std::vector<uint32_t>(kSge, ShimMr(smr)->real->lkey));
  }
  EXPECT_EQ(dst, src);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), static_cast<size_t>(kWrs));
  for (int i = 0; i < kWrs; ++i) EXPECT_EQ(wcs[i].wr_id, static_cast<uint64_t>(i));
}

TEST_F(DataPathTest, BadWrPointsIntoTheApplicationsChainAcrossPieces) {
  constexpr uint32_t kSge = 16;
  ibv_qp* a = dev().Qp(IBV_QPT_RC, kSge);
  ibv_qp* b = dev().Qp(IBV_QPT_RC, kSge);
  ASSERT_EQ(ToRts(shim_, a, b->qp_num, dev().gid), 0);
  ASSERT_EQ(ToRts(shim_, b, a->qp_num, dev().gid), 0);
  std::vector<char> src(kSge * 7);
  std::vector<char> dst(src.size());
  ibv_mr* smr = dev().Reg(src.data(), src.size());
  ibv_mr* dmr = dev().Reg(dst.data(), dst.size());
  for (int i = 0; i < 6; ++i) ASSERT_EQ(PostRecv(b, &dst[i * kSge], kSge, dmr, i), 0);
  // WR 4 (in the second piece) has more SGEs than the QP takes.
  SendChain chain({16, 16, 16, 16, 17, 16}, src.data(), 1, smr);
  chain.Snapshot();
  const size_t sent_before = fake_.sends().size();
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(a, chain.head(), &bad), EINVAL);
  EXPECT_EQ(bad, &chain.wr(4));
  EXPECT_TRUE(chain.Unchanged());
  EXPECT_EQ(fake_.sends().size() - sent_before, 4u) << "the WRs before bad_wr were posted";
}

TEST_F(DataPathTest, BadWrInTheFirstPiece) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  (void)b;
  char buf[16];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  SendChain chain({1, 5, 1}, buf, 1, mr);  // the QP takes 4 SGEs
  chain.Snapshot();
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(a, chain.head(), &bad), EINVAL);
  EXPECT_EQ(bad, &chain.wr(1));
  EXPECT_TRUE(chain.Unchanged());
}

TEST_F(DataPathTest, UdChainOfSixteenWrs) {
  // Each UD WR takes one of the shim's pointer patches (the AH).
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char buf[16] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  SendChain chain(std::vector<int>(16, 1), buf, 1, mr);
  for (size_t i = 0; i < chain.size(); ++i) {
    chain.wr(i).wr.ud.ah = ah;
    chain.wr(i).wr.ud.remote_qpn = b->qp_num;
    chain.wr(i).wr.ud.remote_qkey = kQkey;
    chain.wr(i).send_flags = IBV_SEND_SIGNALED;
  }
  chain.Snapshot();
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, chain.head(), &bad), 0);
  EXPECT_TRUE(chain.Unchanged());
  EXPECT_EQ(Drain(dev().cq).size(), 16u);
  for (const auto& s : fake_.sends()) EXPECT_EQ(s.ah, ShimAh(ah)->real);
}

// A UD chain longer than the shim's pointer patches (one AH each) is posted
// in pieces, with a patch kept for cutting the chain: no write past them.
TEST_F(DataPathTest, UdChainBeyondPointerPatchCapacity) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char buf[32] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  SendChain chain(std::vector<int>(20, 1), buf, 1, mr);
  for (size_t i = 0; i < chain.size(); ++i) {
    chain.wr(i).wr.ud.ah = ah;
    chain.wr(i).wr.ud.remote_qpn = b->qp_num;
    chain.wr(i).wr.ud.remote_qkey = kQkey;
    chain.wr(i).send_flags = IBV_SEND_SIGNALED;
  }
  chain.Snapshot();
  const int calls = fake_.post_send_calls();
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, chain.head(), &bad), 0);
  EXPECT_EQ(fake_.post_send_calls() - calls, 2);
  EXPECT_TRUE(chain.Unchanged());
  EXPECT_EQ(Drain(dev().cq).size(), 20u);
}

// SEND_WITH_INV carries an rkey: ibv_post_send translates it as ibv_wr_send_inv
// does.
TEST_F(DataPathTest, SendWithInvalidateTranslatesTheRkey) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  char buf[8] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ASSERT_EQ(PostRecv(b, buf, sizeof(buf), mr, 1), 0);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND_WITH_INV;
  wr.invalidate_rkey = mr->rkey;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(fake_.sends().back().invalidate_rkey, ShimMr(mr)->real->rkey);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
}

// ATOMIC_WRITE carries its rkey where RDMA WRITE does (wr.rdma.rkey, as
// ibv_wr_atomic_write takes it): the provider is given the physical one,
// and the application's WR is put back whether the provider takes it or
// refuses it (this fake refuses it, as rxe's ibv_post_send does).
TEST_F(DataPathTest, AtomicWriteTranslatesTheRkeyAndIsPutBackWhenRefused) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  char buf[8] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ASSERT_NE(mr->rkey, ShimMr(mr)->real->rkey) << "offset mode: virtual keys";
  ibv_sge sge = Sge(buf, sizeof(buf), mr);
  ibv_send_wr wr = RdmaWr(IBV_WR_ATOMIC_WRITE, &sge, buf, mr);
  const ibv_send_wr before = wr;
  const ibv_sge sge_before = sge;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(a, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
  ASSERT_EQ(fake_.refused_sends().size(), 1u);
  EXPECT_EQ(fake_.refused_sends().back().rkey, ShimMr(mr)->real->rkey);
  EXPECT_EQ(fake_.refused_sends().back().lkeys, std::vector<uint32_t>{ShimMr(mr)->real->lkey});
  EXPECT_EQ(memcmp(&wr, &before, sizeof(wr)), 0);
  EXPECT_EQ(memcmp(&sge, &sge_before, sizeof(sge)), 0);
  // The same at the head of a chain (the chain's path, not the one-WR one).
  ibv_send_wr second = wr;
  wr.next = &second;
  const ibv_send_wr chain_before = wr;
  EXPECT_EQ(ibv_post_send(a, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
  ASSERT_EQ(fake_.refused_sends().size(), 2u);
  EXPECT_EQ(fake_.refused_sends().back().rkey, ShimMr(mr)->real->rkey);
  EXPECT_EQ(memcmp(&wr, &chain_before, sizeof(wr)), 0);
  EXPECT_EQ(memcmp(&second, &before, sizeof(second)), 0);
  EXPECT_EQ(memcmp(&sge, &sge_before, sizeof(sge)), 0);
}

// Opcodes no provider takes: past the ones with an rkey, and past 255
// (the one-WR path finds its translation by the opcode's low byte, here
// RDMA WRITE's). Refused as without the shim, the WR put back.
TEST_F(DataPathTest, AnUnknownOpcodeIsRefusedAndPutBack) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  char buf[8] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  for (const uint32_t op : {0x20u, 0x100u | IBV_WR_RDMA_WRITE, 0xffu}) {
    SCOPED_TRACE(op);
    ibv_sge sge = Sge(buf, sizeof(buf), mr);
    ibv_send_wr wr = RdmaWr(op, &sge, buf, mr);
    const ibv_send_wr before = wr;
    const ibv_sge sge_before = sge;
    const size_t refused = fake_.refused_sends().size();
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(a, &wr, &bad), EINVAL);
    EXPECT_EQ(bad, &wr);
    EXPECT_EQ(fake_.refused_sends().size(), refused + 1);
    EXPECT_EQ(memcmp(&wr, &before, sizeof(wr)), 0);
    EXPECT_EQ(memcmp(&sge, &sge_before, sizeof(sge)), 0);
  }
  EXPECT_TRUE(fake_.sends().empty());
  EXPECT_TRUE(Drain(dev().cq).empty());
}

TEST_F(DataPathTest, RecvChainsAreTranslatedAndUntouched) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  ASSERT_EQ(ToRts(shim_, qp, qp->qp_num, dev().gid), 0);
  char buf[64];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ibv_sge sges[3][2];
  ibv_recv_wr wrs[3];
  for (int i = 0; i < 3; ++i) {
    sges[i][0] = Sge(buf + 16 * i, 8, mr);
    sges[i][1] = Sge(buf + 16 * i + 8, 8, mr);
    wrs[i] = RecvWr(sges[i], 2, i);
    wrs[i].next = i < 2 ? &wrs[i + 1] : nullptr;
  }
  ibv_sge sge_before[3][2];
  ibv_recv_wr wr_before[3];
  memcpy(sge_before, sges, sizeof(sges));
  memcpy(wr_before, wrs, sizeof(wrs));
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(qp, wrs, &bad), 0);
  EXPECT_EQ(memcmp(sge_before, sges, sizeof(sges)), 0);
  EXPECT_EQ(memcmp(wr_before, wrs, sizeof(wrs)), 0);
  const auto recvs = fake_.recvs();
  ASSERT_EQ(recvs.size(), 3u);
  for (const auto& r : recvs) {
    EXPECT_EQ(r.lkeys, (std::vector<uint32_t>{ShimMr(mr)->real->lkey, ShimMr(mr)->real->lkey}));
    EXPECT_EQ(r.qp_num, ShimQp(qp)->real->qp_num);
  }
}

// One receive with one SGE takes the translating path's short way: the
// device gets the physical lkey, the application keeps its own, and a
// receive the device refuses is not journaled.
TEST_F(DataPathTest, OneReceiveIsTranslatedPutBackAndForgottenWhenRefused) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);  // RESET: the device refuses receives
  char buf[16];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ibv_sge sge = Sge(buf, sizeof(buf), mr);
  ibv_recv_wr wr = RecvWr(&sge, 1, 5);
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(qp, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
  EXPECT_EQ(sge.lkey, mr->lkey);
  EXPECT_EQ(ShimQp(qp)->recvs->posted(), 0u);

  ASSERT_EQ(ToRts(shim_, qp, qp->qp_num, dev().gid), 0);
  ASSERT_NE(mr->lkey, ShimMr(mr)->real->lkey);
  EXPECT_EQ(ibv_post_recv(qp, &wr, &bad), 0);
  EXPECT_EQ(sge.lkey, mr->lkey);
  ASSERT_FALSE(fake_.recvs().empty());
  EXPECT_EQ(fake_.recvs().back().lkeys, std::vector<uint32_t>{ShimMr(mr)->real->lkey});
  EXPECT_EQ(ShimQp(qp)->recvs->posted(), 1u);
}

TEST_F(DataPathTest, RecvBadWrPointsIntoTheApplicationsChain) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  ASSERT_EQ(ToRts(shim_, qp, qp->qp_num, dev().gid), 0);
  char buf[64];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ibv_sge sges[8];
  for (int i = 0; i < 8; ++i) sges[i] = Sge(buf + 8 * i, 8, mr);
  ibv_recv_wr wrs[3] = {RecvWr(sges, 1, 0), RecvWr(sges + 1, 5, 1), RecvWr(sges + 6, 1, 2)};
  wrs[0].next = &wrs[1];
  wrs[1].next = &wrs[2];
  ibv_recv_wr before[3];
  memcpy(before, wrs, sizeof(wrs));
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(qp, wrs, &bad), EINVAL);
  EXPECT_EQ(bad, &wrs[1]);
  EXPECT_EQ(memcmp(before, wrs, sizeof(wrs)), 0);
  EXPECT_EQ(sges[0].lkey, mr->lkey);
}

TEST_F(DataPathTest, SrqReceivesCompleteWithVirtualQpn) {
  ibv_srq* srq = dev().Srq();
  ibv_qp* a = dev().Qp(IBV_QPT_RC);
  ibv_qp* b = dev().Qp(IBV_QPT_RC, 4, srq);
  ASSERT_EQ(ToRts(shim_, a, b->qp_num, dev().gid), 0);
  ASSERT_EQ(ToRts(shim_, b, a->qp_num, dev().gid), 0);
  char src[8] = "srq";
  char dst[8] = {};
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ibv_sge rsge = Sge(dst, sizeof(dst), dmr);
  ibv_recv_wr rwr = RecvWr(&rsge, 1, 11);
  ibv_recv_wr* rbad = nullptr;
  ASSERT_EQ(ibv_post_srq_recv(srq, &rwr, &rbad), 0);
  EXPECT_EQ(rsge.lkey, dmr->lkey);
  EXPECT_EQ(fake_.recvs().back().srq, ShimSrq(srq)->real);
  EXPECT_EQ(fake_.recvs().back().lkeys, std::vector<uint32_t>{ShimMr(dmr)->real->lkey});
  ibv_sge sge = Sge(src, 4, smr);
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].wr_id, 11u);
  EXPECT_EQ(wcs[0].qp_num, b->qp_num);
  EXPECT_STREQ(dst, "srq");
}

// ---------------------------------------------------------------- transparency

// The same program, run over `v`: what its completions say about an
// unknown lkey and an unknown rkey.
template <typename V>
std::vector<ibv_wc> BadKeyCompletions(V& v, uint32_t* seen_lkey) {
  Device<V> d(v);
  std::vector<ibv_wc> out;
  char buf[16] = {};
  ibv_mr* mr = d.Reg(buf, sizeof(buf));
  for (const bool bad_lkey : {true, false}) {
    auto [a, b] = d.Pair(IBV_QPT_RC);
    (void)b;
    ibv_sge sge = Sge(buf, 8, mr);
    if (bad_lkey) sge.lkey = 0x00c0ffee;  // nobody's key, virtual or physical
    ibv_send_wr wr{};
    wr.wr_id = bad_lkey ? 1 : 2;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(buf + 8);
    wr.wr.rdma.rkey = bad_lkey ? mr->rkey : 0x00beef00;
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(a, &wr, &bad), 0);
    if (bad_lkey) {
      *seen_lkey = sge.lkey;
    }
    for (const ibv_wc& wc : Drain(d.cq)) out.push_back(wc);
  }
  return out;
}

TEST_F(DataPathTest, UnknownKeysFailAsTheyWouldWithoutTheShim) {
  uint32_t app_lkey = 0;
  const auto with = BadKeyCompletions(shim_, &app_lkey);
  FakeBackend bare;
  uint32_t bare_lkey = 0;
  const auto without = BadKeyCompletions(bare, &bare_lkey);
  ASSERT_EQ(with.size(), without.size());
  ASSERT_EQ(with.size(), 2u);
  EXPECT_EQ(with[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(with[1].status, IBV_WC_REM_ACCESS_ERR);
  for (size_t i = 0; i < with.size(); ++i) {
    EXPECT_EQ(with[i].status, without[i].status) << i;
    EXPECT_EQ(with[i].opcode, without[i].opcode) << i;
    EXPECT_EQ(with[i].wr_id, without[i].wr_id) << i;
    EXPECT_EQ(with[i].vendor_err, without[i].vendor_err) << i;
  }
  // The unknown lkey reached the device as the application wrote it.
  bool seen = false;
  for (const auto& s : fake_.sends())
    if (s.lkeys == std::vector<uint32_t>{0x00c0ffee}) seen = true;
  EXPECT_TRUE(seen);
  EXPECT_EQ(app_lkey, 0x00c0ffeeu);
  EXPECT_EQ(bare.live_objects(), 0);
}

TEST_F(DataPathTest, PostingInTheWrongStateFailsAsWithoutTheShim) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);  // still RESET
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(qp, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
  ibv_recv_wr rwr{};
  ibv_recv_wr* rbad = nullptr;
  EXPECT_EQ(ibv_post_recv(qp, &rwr, &rbad), EINVAL);
  EXPECT_EQ(rbad, &rwr);
}

// ---------------------------------------------------------------- extended API

TEST_F(DataPathTest, QpExBuildersTranslateKeys) {
  ibv_qp* a = dev().QpEx(IBV_QPT_RC);
  ibv_qp* b = dev().QpEx(IBV_QPT_RC);
  ASSERT_EQ(ToRts(shim_, a, b->qp_num, dev().gid), 0);
  ASSERT_EQ(ToRts(shim_, b, a->qp_num, dev().gid), 0);
  struct alignas(8) {
    char data[16];
    uint64_t counter;
  } local{}, remote{};
  ibv_mr* lmr = dev().Reg(&local, sizeof(local));
  ibv_mr* rmr = dev().Reg(&remote, sizeof(remote));
  char rbuf[16] = {};
  ibv_mr* rbmr = dev().Reg(rbuf, sizeof(rbuf));
  ASSERT_EQ(PostRecv(b, rbuf, sizeof(rbuf), rbmr, 90), 0);
  strcpy(local.data, "qpx");
  remote.counter = 1;

  ibv_qp_ex* qpx = shim_.QpToQpEx(a);
  ASSERT_NE(qpx, nullptr);
  ibv_wr_start(qpx);
  qpx->wr_id = 1;
  qpx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write(qpx, rmr->rkey, reinterpret_cast<uintptr_t>(remote.data));
  ibv_wr_set_sge(qpx, lmr->lkey, reinterpret_cast<uintptr_t>(local.data), 4);
  qpx->wr_id = 2;
  ibv_wr_atomic_fetch_add(qpx, rmr->rkey, reinterpret_cast<uintptr_t>(&remote.counter), 10);
  ibv_wr_set_sge(qpx, lmr->lkey, reinterpret_cast<uintptr_t>(&local.counter), 8);
  qpx->wr_id = 3;
  ibv_wr_send_imm(qpx, htobe32(3));
  const ibv_sge list[2] = {Sge(local.data, 2, lmr), Sge(local.data + 2, 2, lmr)};
  ibv_wr_set_sge_list(qpx, 2, list);
  qpx->wr_id = 4;
  ibv_wr_rdma_read(qpx, rmr->rkey, reinterpret_cast<uintptr_t>(remote.data));
  ibv_wr_set_sge(qpx, lmr->lkey, reinterpret_cast<uintptr_t>(local.data + 8), 3);
  ASSERT_EQ(ibv_wr_complete(qpx), 0);

  const uint32_t plkey = ShimMr(lmr)->real->lkey;
  const uint32_t prkey = ShimMr(rmr)->real->rkey;
  const auto sends = fake_.sends();
  ASSERT_EQ(sends.size(), 4u);
  EXPECT_EQ(sends[0].rkey, prkey);
  EXPECT_EQ(sends[0].lkeys, std::vector<uint32_t>{plkey});
  EXPECT_EQ(sends[1].rkey, prkey);
  EXPECT_EQ(sends[2].lkeys, (std::vector<uint32_t>{plkey, plkey}));
  EXPECT_EQ(sends[3].rkey, prkey);
  EXPECT_EQ(list[0].lkey, lmr->lkey) << "the application's list is not modified";
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(sends[i].wr_id, i + 1);

  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 5u);
  for (const ibv_wc& wc : wcs) EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wcs[2].opcode, IBV_WC_RECV);
  EXPECT_EQ(wcs[2].qp_num, b->qp_num);
  EXPECT_EQ(remote.counter, 11u);
  EXPECT_EQ(local.counter, 1u);
  EXPECT_EQ(memcmp(remote.data, "qpx", 3), 0);
  EXPECT_STREQ(rbuf, "qpx");
  EXPECT_EQ(memcmp(local.data + 8, "qpx", 3), 0);
}

TEST_F(DataPathTest, QpExUdAddressIsTranslated) {
  ibv_qp* a = dev().QpEx(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char dst[FakeBackend::kGrhBytes + 8] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(PostRecv(b, dst, sizeof(dst), dmr, 5), 0);
  ibv_qp_ex* qpx = shim_.QpToQpEx(a);
  ASSERT_NE(qpx, nullptr);
  char msg[] = "inl";
  ibv_wr_start(qpx);
  qpx->wr_id = 8;
  qpx->wr_flags = 0;
  ibv_wr_send(qpx);
  ibv_wr_set_ud_addr(qpx, ah, b->qp_num, kQkey);
  ibv_wr_set_inline_data(qpx, msg, sizeof(msg));
  ASSERT_EQ(ibv_wr_complete(qpx), 0);
  const auto sent = fake_.sends().back();
  EXPECT_EQ(sent.ah, ShimAh(ah)->real);
  EXPECT_EQ(sent.remote_qpn, ShimQp(b)->real->qp_num);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].src_qp, a->qp_num);
  EXPECT_STREQ(dst + FakeBackend::kGrhBytes, "inl");
}

TEST_F(DataPathTest, CqExReadsVirtualQpNumbers) {
  ibv_cq_ex* cqx = dev().CqEx();
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  ibv_qp* a = dev().Qp(IBV_QPT_UD, 1, nullptr, cq, cq);
  ibv_qp* b = dev().Qp(IBV_QPT_UD, 1, nullptr, cq, cq);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char dst[FakeBackend::kGrhBytes + 8] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(PostRecv(b, dst, sizeof(dst), dmr, 21), 0);
  ibv_send_wr wr{};
  wr.wr_id = 20;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = b->qp_num;
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);

  ibv_poll_cq_attr attr{};
  ASSERT_EQ(ibv_start_poll(cqx, &attr), 0);
  EXPECT_EQ(cqx->wr_id, 21u);
  EXPECT_EQ(cqx->status, IBV_WC_SUCCESS);
  EXPECT_EQ(ibv_wc_read_opcode(cqx), IBV_WC_RECV);
  EXPECT_EQ(ibv_wc_read_qp_num(cqx), b->qp_num);
  EXPECT_EQ(ibv_wc_read_src_qp(cqx), a->qp_num);
  EXPECT_EQ(ibv_wc_read_byte_len(cqx), FakeBackend::kGrhBytes);
  EXPECT_TRUE(ibv_wc_read_wc_flags(cqx) & IBV_WC_GRH);
  ASSERT_EQ(ibv_next_poll(cqx), 0);
  EXPECT_EQ(cqx->wr_id, 20u);
  EXPECT_EQ(ibv_wc_read_opcode(cqx), IBV_WC_SEND);
  EXPECT_EQ(ibv_wc_read_qp_num(cqx), a->qp_num);
  EXPECT_EQ(ibv_next_poll(cqx), ENOENT);
  ibv_end_poll(cqx);
  EXPECT_EQ(ibv_start_poll(cqx, &attr), ENOENT);
}

TEST_F(DataPathTest, CollidingPhysicalQpnsStillCompleteWithTheirOwnVirtualQpn) {
  // Same low QpIndex::kBits: the second goes to the overflow list.
  fake_.SetNextQpn(0x00123);
  ibv_qp* a = dev().Qp(IBV_QPT_RC);
  fake_.SetNextQpn(0x00123 | 1u << QpIndex::kBits);
  ibv_qp* b = dev().Qp(IBV_QPT_RC);
  ASSERT_EQ(ShimQp(a)->real->qp_num & ((1u << QpIndex::kBits) - 1),
            ShimQp(b)->real->qp_num & ((1u << QpIndex::kBits) - 1));
  ASSERT_EQ(ToRts(shim_, a, b->qp_num, dev().gid), 0);
  ASSERT_EQ(ToRts(shim_, b, a->qp_num, dev().gid), 0);
  char buf[8] = {};
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ASSERT_EQ(PostRecv(a, buf, 4, mr, 1), 0);
  ASSERT_EQ(PostRecv(b, buf + 4, 4, mr, 2), 0);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  ASSERT_EQ(ibv_post_send(b, &wr, &bad), 0);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].wr_id, 2u);
  EXPECT_EQ(wcs[0].qp_num, b->qp_num);
  EXPECT_EQ(wcs[1].wr_id, 1u);
  EXPECT_EQ(wcs[1].qp_num, a->qp_num);
}

// A migratable process's UD sends are counted for the drain (the pause
// waits for as many signaled completions as were posted), whichever path
// its posts take: one WR with one SGE (the probed path's table), a chain,
// with the marks or the probe, in default mode (a UD QP translates its AH
// from the start) and in offset mode.
TEST(MigratableDataPathTest, EveryStackCountsAUdQpsSignaledSends) {
  for (const bool probed : {false, true}) {
    for (const bool offset : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "probed " << probed << ", offset " << offset);
      FakeBackend fake;
      Shim shim(&fake, IdentityMode{.offset = offset}, /*migratable=*/true, probed);
      {
        Device<Shim> dev(shim);
        ibv_qp* a = dev.Qp(IBV_QPT_UD);
        ibv_qp* b = dev.Qp(IBV_QPT_UD);
        ASSERT_EQ(ToRts(shim, a, 0, {}), 0);
        ASSERT_EQ(ToRts(shim, b, 0, {}), 0);
        ibv_ah* ah = dev.Ah(dev.gid);
        char src[8] = "ping";
        ibv_mr* mr = dev.Reg(src, sizeof(src));
        ibv_sge sge = Sge(src, 5, mr);
        ibv_send_wr one = UdSend(&sge, ah, b->qp_num);
        one.send_flags = IBV_SEND_SIGNALED;
        ibv_send_wr* bad = nullptr;
        ASSERT_EQ(ibv_post_send(a, &one, &bad), 0);
        ASSERT_EQ(ibv_post_send(a, &one, &bad), 0);
        ibv_send_wr chain[2] = {one, UdSend(&sge, ah, b->qp_num)};  // the second unsignaled
        chain[0].next = &chain[1];
        ASSERT_EQ(ibv_post_send(a, chain, &bad), 0);
        EXPECT_EQ(fake.sends().size(), 4u);
        EXPECT_EQ(ShimQp(a)->signaled_posted.load(), 3u) << "signaled sends counted";
        EXPECT_TRUE(ShimQp(a)->unsignaled_tail.load()) << "the last one was unsignaled";
        Drain(dev.cq);
      }
      EXPECT_EQ(fake.live_objects(), 0);
    }
  }
}

// A migratable process in default mode posts on the marked path while its
// keys are the hardware's. An MR whose key takes a slot another MR holds
// gets a virtual lkey of the shim's, and every QP translates from then on
// (Shim::KeysDiverged), while the application runs: the probed entry,
// which finds a single WR's function through a table its QP's path chose
// (Qp::post_probed), must reach the translating one at the next post.
TEST(MigratableDataPathTest, QpsTranslateTheSendAfterAnMrMadeTheKeysDiverge) {
  for (const bool probed : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "probed " << probed);
    FakeBackend fake;
    Shim shim(&fake, IdentityMode{}, /*migratable=*/true, probed);
    {
      Device<Shim> dev(shim);
      auto [a, b] = dev.Pair(IBV_QPT_RC);
      char first[8] = "first";
      ibv_mr* mr1 = dev.Reg(first, sizeof(first));
      ASSERT_EQ(mr1->lkey, ShimMr(mr1)->real->lkey) << "the hardware's key, its slot free";
      ASSERT_EQ(ShimQp(a)->path.get(), Path::kMarked);
      char got[2][8] = {};
      ibv_mr* dst = dev.Reg(got, sizeof(got));
      ASSERT_EQ(ShimQp(a)->path.get(), Path::kMarked);
      for (int i = 0; i < 2; ++i) ASSERT_EQ(PostRecvOf(b, 10 + i, got[i], 8, dst), 0);
      ibv_sge sge = Sge(first, sizeof(first), mr1);
      ibv_send_wr wr = SignaledSend(&sge, 1);
      ibv_send_wr* bad = nullptr;
      ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);

      fake.SetNextMrIndex(ShimMr(mr1)->real->lkey >> 8);
      char second[8] = "second";
      ibv_mr* mr2 = dev.Reg(second, sizeof(second));
      ASSERT_NE(mr2->lkey, ShimMr(mr2)->real->lkey) << "a key of the shim's: the slot was taken";
      ASSERT_EQ(ShimQp(a)->path.get(), Path::kTranslated);
      sge = Sge(second, sizeof(second), mr2);
      wr.wr_id = 2;
      ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
      EXPECT_EQ(fake.sends().back().lkeys, std::vector<uint32_t>{ShimMr(mr2)->real->lkey});
      EXPECT_EQ(sge.lkey, mr2->lkey) << "the application's SGE is put back";
      std::vector<ibv_wc> wcs = Drain(dev.cq);
      for (const ibv_wc& wc : wcs) EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc.wr_id;
      EXPECT_EQ(wcs.size(), 4u);
      EXPECT_STREQ(got[0], "first");
      EXPECT_STREQ(got[1], "second");
    }
    EXPECT_EQ(fake.live_objects(), 0);
  }
}

}  // namespace
}  // namespace rdmavirt::shim::testing
