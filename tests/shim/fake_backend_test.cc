// The fake's own behaviour, without the shim: the shim tests rely on it
// acting like an HCA.
#include "tests/shim/fake_backend.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

class FakeBackendTest : public ::testing::Test {
 protected:
  FakeBackendTest() : dev_(std::make_unique<Device<FakeBackend>>(fake_)) {}
  void TearDown() override {
    dev_.reset();
    EXPECT_EQ(fake_.live_objects(), 0);
    EXPECT_EQ(fake_.foreign_objects(), 0);
  }
  Device<FakeBackend>& dev() { return *dev_; }
  FakeBackend fake_;
  std::unique_ptr<Device<FakeBackend>> dev_;
};

TEST_F(FakeBackendTest, DeviceAndGidTable) {
  EXPECT_STREQ(fake_.device()->name, "fake0");
  ibv_gid g0, g1;
  ASSERT_EQ(fake_.QueryGid(dev().ctx, 1, 0, &g0), 0);
  ASSERT_EQ(fake_.QueryGid(dev().ctx, 1, 1, &g1), 0);
  EXPECT_EQ(g0.raw[0], 0xfe);
  EXPECT_EQ(g0.raw[1], 0x80);
  const uint8_t v4[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 9};
  EXPECT_EQ(memcmp(g1.raw, v4, 16), 0);
  ibv_gid bad;
  errno = 0;
  EXPECT_EQ(fake_.QueryGid(dev().ctx, 1, 2, &bad), -1);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(FakeBackendTest, KeysAreRxeLike) {
  char buf[64];
  ibv_mr* a = dev().Reg(buf, sizeof(buf));
  ibv_mr* b = dev().Reg(buf, sizeof(buf));
  EXPECT_EQ(a->lkey >> 8, FakeBackend::kFirstMrIndex);
  EXPECT_EQ(b->lkey >> 8, FakeBackend::kFirstMrIndex + 1);
  EXPECT_EQ(a->lkey, a->rkey);
}

TEST_F(FakeBackendTest, RcSendWithImmLoopback) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  char src[32] = "hello, fake";
  char dst[32] = {};
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ibv_sge rsge = Sge(dst, sizeof(dst), dmr);
  ibv_recv_wr rwr{};
  rwr.wr_id = 7;
  rwr.sg_list = &rsge;
  rwr.num_sge = 1;
  ibv_recv_wr* rbad = nullptr;
  ASSERT_EQ(ibv_post_recv(b, &rwr, &rbad), 0);
  ibv_sge ssge = Sge(src, 12, smr);
  ibv_send_wr swr{};
  swr.wr_id = 9;
  swr.sg_list = &ssge;
  swr.num_sge = 1;
  swr.opcode = IBV_WR_SEND_WITH_IMM;
  swr.imm_data = htobe32(0xabcd);
  swr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &swr, &bad), 0);
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wcs[0].qp_num, b->qp_num);
  EXPECT_EQ(wcs[0].byte_len, 12u);
  EXPECT_EQ(wcs[0].imm_data, htobe32(0xabcd));
  EXPECT_EQ(wcs[1].opcode, IBV_WC_SEND);
  EXPECT_EQ(wcs[1].wr_id, 9u);
  EXPECT_STREQ(dst, "hello, fake");
}

TEST_F(FakeBackendTest, ChecksKeysLikeHardware) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  uint64_t local = 0, remote = 0;
  ibv_mr* lmr = dev().Reg(&local, 8);
  ibv_mr* rmr = dev().Reg(&remote, 8);
  ibv_sge sge = Sge(&local, 8, lmr);
  sge.lkey = 0x1234;  // nobody's key
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(&remote);
  wr.wr.rdma.rkey = rmr->rkey;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);  // errors complete even when unsignaled
  EXPECT_EQ(wcs[0].status, IBV_WC_LOC_PROT_ERR);

  // The QP is in error now: reconnect a fresh pair for the rkey check.
  auto [c, d] = dev().Pair(IBV_QPT_RC);
  (void)d;
  sge.lkey = lmr->lkey;
  wr.wr.rdma.rkey = 0x4321;
  ASSERT_EQ(ibv_post_send(c, &wr, &bad), 0);
  wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_REM_ACCESS_ERR);
}

TEST_F(FakeBackendTest, UdDeliversWithIpv4Grh) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(fake_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(fake_, b, 0, {}), 0);
  ibv_ah* ah = dev().Ah(dev().gid);
  char src[8] = "ud!";
  char dst[64] = {};
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ibv_sge rsge = Sge(dst, sizeof(dst), dmr);
  ibv_recv_wr rwr{};
  rwr.sg_list = &rsge;
  rwr.num_sge = 1;
  ibv_recv_wr* rbad;
  ASSERT_EQ(ibv_post_recv(b, &rwr, &rbad), 0);
  ibv_sge ssge = Sge(src, 4, smr);
  ibv_send_wr wr{};
  wr.sg_list = &ssge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = b->qp_num;
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].src_qp, a->qp_num);
  EXPECT_EQ(wcs[0].byte_len, FakeBackend::kGrhBytes + 4);
  EXPECT_TRUE(wcs[0].wc_flags & IBV_WC_GRH);
  const auto* ip = reinterpret_cast<const uint8_t*>(dst) + 20;
  EXPECT_EQ(ip[0], 0x45);
  EXPECT_EQ(memcmp(ip + 12, FakeBackend::kIpv4, 4), 0);
  EXPECT_EQ(memcmp(ip + 16, FakeBackend::kIpv4, 4), 0);
  EXPECT_STREQ(dst + FakeBackend::kGrhBytes, "ud!");
  // Looped back on one device, as rxe does it: no checksum.
  EXPECT_EQ(ip[10] << 8 | ip[11], 0);
}

TEST_F(FakeBackendTest, FaultInjectionIsOneShot) {
  fake_.FailNext(FakeBackend::Op::kAllocPd, ENOSPC);
  errno = 0;
  EXPECT_EQ(fake_.AllocPd(dev().ctx), nullptr);
  EXPECT_EQ(errno, ENOSPC);
  ibv_pd* pd = fake_.AllocPd(dev().ctx);
  ASSERT_NE(pd, nullptr);
  EXPECT_EQ(fake_.DeallocPd(pd), 0);
}

TEST(FakeBackendStandaloneTest, CountsForeignPointers) {
  FakeBackend fake;
  ibv_pd not_ours{};
  EXPECT_EQ(fake.DeallocPd(&not_ours), EINVAL);
  EXPECT_EQ(fake.foreign_objects(), 1);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
