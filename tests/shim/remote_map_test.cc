// What a moved peer publishes (remote_map.h) and how the shim uses it: QPs
// and AHs toward the peer's virtual GID reach its new physical location,
// QPNs and rkeys, with the application's values untouched.
#include "shim/remote_map.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

TEST(RemoteEndpointTest, MapsWhatWasPublishedAndPassesTheRestThrough) {
  RemoteMapping m;
  m.qpns = {{0x800011, 0x21}, {0x800012, 0x22}};
  m.rkeys = {{0x80001a5a, 0x3377}};
  auto e = RemoteEndpoint::Build(m);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Qpn(0x800011), 0x21u);
  EXPECT_EQ(e->Qpn(0x800012), 0x22u);
  EXPECT_EQ(e->Qpn(0x800013), 0x800013u);  // unknown: unchanged
  EXPECT_EQ(e->Rkey(0x80001a5a), 0x3377u);
  EXPECT_EQ(e->Rkey(0x1a5a), 0x1a5au);
}

TEST(RemoteEndpointTest, EmptyMappingTranslatesNothing) {
  auto e = RemoteEndpoint::Build(RemoteMapping{});
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Qpn(5), 5u);
  EXPECT_EQ(e->Rkey(0), 0u);
}

TEST(RemoteEndpointTest, ManyEntriesAllFound) {
  RemoteMapping m;
  for (uint32_t i = 0; i < 1000; ++i) m.rkeys.push_back({i * 256 + 7, i});
  auto e = RemoteEndpoint::Build(m);
  ASSERT_NE(e, nullptr);
  for (uint32_t i = 0; i < 1000; ++i) EXPECT_EQ(e->Rkey(i * 256 + 7), i);
}

// A GID the fake device does not have: a peer's virtual identity from
// before its move. Traffic sent there untranslated is lost.
ibv_gid MovedPeerGid() {
  ibv_gid g{};
  g.raw[10] = g.raw[11] = 0xff;
  g.raw[12] = 10;
  g.raw[13] = 77;
  g.raw[14] = 0x80 | 5;  // offset-mode marker, as the peer's shim showed it
  g.raw[15] = 5;
  return g;
}

class RemoteMapTest : public ShimTest {
 protected:
  // Publishes that the peer known as MovedPeerGid() now lives at the fake's
  // GID, with `peer`'s QPN behind `vqpn` and `mr`'s rkey behind `vrkey`.
  void PublishPeer(ibv_qp* peer, uint32_t vqpn, ibv_mr* mr, uint32_t vrkey) {
    RemoteMapping m;
    m.virtual_gid = MovedPeerGid();
    m.physical_gid = FakeBackend::Gid(kIpv4GidIndex);
    m.qpns = {{vqpn, ShimQp(peer)->real->qp_num}};
    m.rkeys = {{vrkey, ShimMr(mr)->real->rkey}};
    ASSERT_EQ(shim_.PublishRemote(m), 0);
  }
  // Two RC QPs: `a` (ours) still to be connected; `b` (the moved peer's
  // QP, on the same fake device) connected back to `a` the ordinary way.
  std::pair<ibv_qp*, ibv_qp*> Qps() {
    ibv_qp* a = dev().Qp(IBV_QPT_RC);
    ibv_qp* b = dev().Qp(IBV_QPT_RC);
    ibv_gid own{};
    EXPECT_EQ(shim_.QueryGid(dev().ctx, FakeBackend::kPort, kIpv4GidIndex, &own), 0);
    EXPECT_EQ(ToRts(shim_, b, a->qp_num, own), 0);
    return {a, b};
  }
  static constexpr uint32_t kPeerVqpn = 0x800777;
  static constexpr uint32_t kPeerVrkey = 0x80abcd42;
};

TEST_F(RemoteMapTest, ConnectingToAMovedPeerUsesItsPublishedLocation) {
  auto [a, b] = Qps();
  char dst[64] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  PublishPeer(b, kPeerVqpn, dmr, kPeerVrkey);
  ASSERT_NE(shim_.FindRemote(MovedPeerGid()), nullptr);

  ASSERT_EQ(ToRts(shim_, a, kPeerVqpn, MovedPeerGid()), 0);
  bool saw_rtr = false;
  for (const auto& m : fake_.modifies()) {
    if (m.qp != ShimQp(a)->real || !(m.mask & IBV_QP_DEST_QPN)) continue;
    saw_rtr = true;
    EXPECT_EQ(m.attr.dest_qp_num, ShimQp(b)->real->qp_num);
    EXPECT_TRUE(GidEq(m.attr.ah_attr.grh.dgid, FakeBackend::Gid(kIpv4GidIndex)));
  }
  EXPECT_TRUE(saw_rtr);

  // The application's query shows what it set: the virtual peer.
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(shim_.QueryQp(a, &attr, IBV_QP_DEST_QPN | IBV_QP_AV, &init), 0);
  EXPECT_EQ(attr.dest_qp_num, kPeerVqpn);
  EXPECT_TRUE(GidEq(attr.ah_attr.grh.dgid, MovedPeerGid()));

  // An RDMA WRITE with the peer's virtual rkey lands in its MR.
  char src[16] = "moved and found";
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_sge sge = Sge(src, sizeof(src), smr);
  ibv_send_wr wr{};
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(dst);
  wr.wr.rdma.rkey = kPeerVrkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(wr.wr.rdma.rkey, kPeerVrkey) << "the application's WR is restored";
  EXPECT_EQ(fake_.sends().back().rkey, ShimMr(dmr)->real->rkey);
  auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_STREQ(dst, "moved and found");
}

TEST_F(RemoteMapTest, APublicationReachesQpsAlreadyConnected) {
  auto [a, b] = Qps();
  char dst[16] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(ToRts(shim_, a, kPeerVqpn, MovedPeerGid()), 0);
  EXPECT_EQ(ShimQp(a)->remote.load(), nullptr);
  PublishPeer(b, kPeerVqpn, dmr, kPeerVrkey);
  EXPECT_NE(ShimQp(a)->remote.load(), nullptr);
  EXPECT_EQ(ShimQp(a)->path.get(), Path::kTranslated) << "its posts must translate from now on";

  char src[4] = "abc";
  ibv_mr* smr = dev().Reg(src, sizeof(src));
  ibv_sge sge = Sge(src, sizeof(src), smr);
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(dst);
  wr.wr.rdma.rkey = kPeerVrkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(fake_.sends().back().rkey, ShimMr(dmr)->real->rkey);
  Drain(dev().cq);
}

TEST_F(RemoteMapTest, UdAddressHandlesTowardAMovedPeer) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  char unused[8];
  ibv_mr* mr = dev().Reg(unused, sizeof(unused));
  PublishPeer(b, kPeerVqpn, mr, kPeerVrkey);
  ibv_ah* ah = dev().Ah(MovedPeerGid());
  ASSERT_NE(ah, nullptr);
  ASSERT_FALSE(fake_.ahs().empty());
  EXPECT_TRUE(GidEq(fake_.ahs().back().attr.grh.dgid, FakeBackend::Gid(kIpv4GidIndex)));

  char payload[8] = "dgram";
  ibv_mr* smr = dev().Reg(payload, sizeof(payload));
  ibv_sge sge = Sge(payload, sizeof(payload), smr);
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = kPeerVqpn;
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(fake_.sends().back().remote_qpn, ShimQp(b)->real->qp_num);
  EXPECT_EQ(wr.wr.ud.remote_qpn, kPeerVqpn);
  EXPECT_EQ(wr.wr.ud.ah, ah);
  Drain(dev().cq);
}

// A peer that moved onto this very host: its datagrams come in looped back
// by the device, whose IPv4 header rxe leaves without a checksum. They must
// still show the peer's virtual QPN and address (the soak found them
// showing the physical QPN once P was moved to Q's host).
TEST_F(RemoteMapTest, DatagramsOfAPeerThatMovedOntoThisHostShowItsVirtualSource) {
  ibv_qp* a = dev().Qp(IBV_QPT_UD);
  ibv_qp* b = dev().Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(shim_, a, 0, {}), 0);
  ASSERT_EQ(ToRts(shim_, b, 0, {}), 0);
  char unused[8];
  ibv_mr* mr = dev().Reg(unused, sizeof(unused));
  PublishPeer(b, kPeerVqpn, mr, kPeerVrkey);

  char dst[FakeBackend::kGrhBytes + 8] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ibv_sge rsge = Sge(dst, sizeof(dst), dmr);
  ibv_recv_wr rwr{};
  rwr.sg_list = &rsge;
  rwr.num_sge = 1;
  ibv_recv_wr* rbad = nullptr;
  ASSERT_EQ(ibv_post_recv(a, &rwr, &rbad), 0);
  char payload[8] = "dgram";
  ibv_mr* smr = dev().Reg(payload, sizeof(payload));
  ibv_sge sge = Sge(payload, sizeof(payload), smr);
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.wr.ud.ah = dev().Ah(dev().gid);
  wr.wr.ud.remote_qpn = a->qp_num;
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(b, &wr, &bad), 0);

  ibv_wc wc{};
  for (const ibv_wc& w : Drain(dev().cq))
    if (w.qp_num == a->qp_num) wc = w;
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  ASSERT_EQ(wc.qp_num, a->qp_num) << "the datagram was not received";
  EXPECT_EQ(wc.src_qp, kPeerVqpn) << "physical " << ShimQp(b)->real->qp_num;
  const auto* ip = reinterpret_cast<const uint8_t*>(dst) + 20;
  EXPECT_EQ(memcmp(ip + 12, MovedPeerGid().raw + 12, 4), 0) << "the source the GRH shows";
  EXPECT_STREQ(dst + FakeBackend::kGrhBytes, "dgram");
}

TEST_F(RemoteMapTest, ALaterPublicationReplacesAnEarlierOne) {
  auto [a, b] = Qps();
  char dst[8] = {};
  ibv_mr* first = dev().Reg(dst, sizeof(dst));
  ibv_mr* second = dev().Reg(dst, sizeof(dst));
  PublishPeer(b, kPeerVqpn, first, kPeerVrkey);
  PublishPeer(b, kPeerVqpn, second, kPeerVrkey);
  ASSERT_EQ(ToRts(shim_, a, kPeerVqpn, MovedPeerGid()), 0);
  EXPECT_EQ(ShimQp(a)->remote.load()->Rkey(kPeerVrkey), ShimMr(second)->real->rkey);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
