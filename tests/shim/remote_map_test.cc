// What a moved peer publishes (remote_map.h) and how the shim uses it: QPs
// and AHs toward the peer's virtual GID reach its new physical location,
// QPNs and rkeys, with the application's values untouched.
#include "shim/core/remote_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "shim/datapath/thread_probe.h"
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
  RemoteMapTest() = default;
  RemoteMapTest(IdentityMode mode, bool migratable, bool probed)
      : ShimTest(mode, migratable, probed) {}

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
  // Two UD QPs at RTS: `a` (ours) and `b`.
  std::pair<ibv_qp*, ibv_qp*> UdQps() {
    ibv_qp* a = dev().Qp(IBV_QPT_UD);
    ibv_qp* b = dev().Qp(IBV_QPT_UD);
    EXPECT_EQ(ToRts(shim_, a, 0, {}), 0);
    EXPECT_EQ(ToRts(shim_, b, 0, {}), 0);
    return {a, b};
  }
  // The peer known as MovedPeerGid() is UD QP `b` now (its rkey unused).
  void PublishUdPeer(ibv_qp* b) {
    ibv_mr* mr = dev().Reg(unused_, sizeof(unused_));
    PublishPeer(b, kPeerVqpn, mr, kPeerVrkey);
  }
  char unused_[8] = {};
  // `a` receives one datagram `text` that `sender` sends it through an AH
  // to this device's GID, into `dst` (GRH first); its completion.
  ibv_wc ReceiveFrom(ibv_qp* sender, ibv_qp* a, char* dst, size_t len, const char* text) {
    ibv_mr* dmr = dev().Reg(dst, len);
    ibv_sge rsge = Sge(dst, len, dmr);
    ibv_recv_wr rwr{};
    rwr.sg_list = &rsge;
    rwr.num_sge = 1;
    ibv_recv_wr* rbad = nullptr;
    EXPECT_EQ(ibv_post_recv(a, &rwr, &rbad), 0);
    ibv_mr* smr = dev().Reg(const_cast<char*>(text), strlen(text) + 1);
    ibv_sge sge = Sge(const_cast<char*>(text), strlen(text) + 1, smr);
    ibv_send_wr wr = UdSend(&sge, dev().Ah(dev().gid), a->qp_num);
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(sender, &wr, &bad), 0);
    ibv_wc wc{};
    for (const ibv_wc& w : Drain(dev().cq))
      if (w.qp_num == a->qp_num) wc = w;
    return wc;
  }
  static constexpr uint32_t kPeerVrkey = 0x80abcd42;
  // An RC QP connected to a peer published as moved before, then one
  // connected before: their RDMA reaches the peer's new MR.
  void ConnectToAMovedPeer();
  void PublishToAConnectedQp();
  // Another endpoint behind the same virtual GID, that did not move.
  static constexpr uint32_t kOtherVqpn = 0x800778;
};

void RemoteMapTest::ConnectToAMovedPeer() {
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

void RemoteMapTest::PublishToAConnectedQp() {
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

TEST_F(RemoteMapTest, ConnectingToAMovedPeerUsesItsPublishedLocation) { ConnectToAMovedPeer(); }
TEST_F(RemoteMapTest, APublicationReachesQpsAlreadyConnected) { PublishToAConnectedQp(); }

// The same in a process the migrator may move, whose pause probes its
// threads, in default mode: its QPs start on the marked path, whose
// probed entry dispatches a single WR through a table chosen by the path
// (Qp::post_probed). A QP that connects to a moved peer, or whose peer's
// move is published while it runs, goes to the translating path, and its
// next post must find the table that translates.
class ProbedRemoteMapTest : public RemoteMapTest {
 protected:
  ProbedRemoteMapTest() : RemoteMapTest(IdentityMode{}, /*migratable=*/true, /*probed=*/true) {}
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(InstallThreadProbe(&why)) << why;
  }
};

TEST_F(ProbedRemoteMapTest, ConnectingToAMovedPeerUsesItsPublishedLocation) {
  ConnectToAMovedPeer();
}
TEST_F(ProbedRemoteMapTest, APublicationReachesQpsAlreadyConnected) { PublishToAConnectedQp(); }

TEST_F(RemoteMapTest, UdAddressHandlesTowardAMovedPeer) {
  auto [a, b] = UdQps();
  PublishUdPeer(b);
  ibv_ah* ah = dev().Ah(MovedPeerGid());
  ASSERT_NE(ah, nullptr);
  ASSERT_FALSE(fake_.ahs().empty());
  EXPECT_TRUE(GidEq(fake_.ahs().back().attr.grh.dgid, FakeBackend::Gid(kIpv4GidIndex)));

  char payload[8] = "dgram";
  ibv_mr* smr = dev().Reg(payload, sizeof(payload));
  ibv_sge sge = Sge(payload, sizeof(payload), smr);
  ibv_send_wr wr = UdSend(&sge, ah, kPeerVqpn);
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  EXPECT_EQ(fake_.sends().back().remote_qpn, ShimQp(b)->real->qp_num);
  EXPECT_EQ(wr.wr.ud.remote_qpn, kPeerVqpn);
  EXPECT_EQ(wr.wr.ud.ah, ah);
  Drain(dev().cq);
}

// The migrator learns from Describe where the UD peers an endpoint sends to
// are (no QP names them): each address handle's destination, where it is
// now (a moved peer at its physical GID), each once.
TEST_F(RemoteMapTest, DescribeNamesWhereTheAddressHandlesPointNow) {
  auto [a, b] = UdQps();
  ASSERT_NE(dev().Ah(dev().gid), nullptr);
  ASSERT_NE(dev().Ah(dev().gid), nullptr);
  ibv_gid group{};  // a multicast group's (::ffff:239.1.130.3): no host's
  group.raw[10] = group.raw[11] = 0xff;
  group.raw[12] = 239;
  group.raw[13] = 1;
  group.raw[14] = 130;
  group.raw[15] = 3;
  ASSERT_NE(dev().Ah(group), nullptr);
  std::vector<ibv_gid> peers = shim_.Describe().ud_peer_physical_gids;
  ASSERT_EQ(peers.size(), 1u) << "a multicast group named as a peer";
  EXPECT_TRUE(GidEq(peers[0], FakeBackend::Gid(1))) << "this host's device, physical";
  RemoteMapping m;  // the moved peer, on another host now
  m.virtual_gid = MovedPeerGid();
  m.physical_gid = ibv_gid{};
  m.physical_gid.raw[10] = m.physical_gid.raw[11] = 0xff;
  m.physical_gid.raw[12] = 10;
  m.physical_gid.raw[15] = 9;
  m.qpns = {{kPeerVqpn, ShimQp(b)->real->qp_num}};
  ASSERT_EQ(shim_.PublishRemote(m), 0);
  ASSERT_NE(dev().Ah(MovedPeerGid()), nullptr);
  peers = shim_.Describe().ud_peer_physical_gids;
  ASSERT_EQ(peers.size(), 2u);
  auto named = [&peers](const ibv_gid& g) {
    return std::count_if(peers.begin(), peers.end(),
                         [&g](const ibv_gid& p) { return GidEq(p, g); });
  };
  EXPECT_EQ(named(FakeBackend::Gid(1)), 1);
  EXPECT_EQ(named(m.physical_gid), 1) << "where the moved peer is";
}

// A peer that moved onto this very host: its datagrams come in looped back
// by the device, whose IPv4 header rxe leaves without a checksum. They must
// still show the peer's virtual QPN and address (the soak found them
// showing the physical QPN once P was moved to Q's host).
TEST_F(RemoteMapTest, DatagramsOfAPeerThatMovedOntoThisHostShowItsVirtualSource) {
  auto [a, b] = UdQps();
  PublishUdPeer(b);

  char dst[FakeBackend::kGrhBytes + 8] = {};
  const ibv_wc wc = ReceiveFrom(b, a, dst, sizeof(dst), "dgram");
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

// Every process started on one host has that host's GID: two endpoints
// behind one virtual GID, and only one of them moves (a drain moves them one
// at a time). The lab found the other's peers re-pointed at the mover's new
// host, their traffic stopped for good.
TEST_F(RemoteMapTest, OnlyTheQpsOfTheEndpointThatMovedFollowIt) {
  auto [a, b] = Qps();
  ibv_qp* stays = dev().Qp(IBV_QPT_RC);  // toward the endpoint that did not move
  char dst[16] = {};
  ibv_mr* dmr = dev().Reg(dst, sizeof(dst));
  ASSERT_EQ(ToRts(shim_, a, kPeerVqpn, MovedPeerGid()), 0);
  ASSERT_EQ(ToRts(shim_, stays, kOtherVqpn, MovedPeerGid()), 0);
  PublishPeer(b, kPeerVqpn, dmr, kPeerVrkey);
  EXPECT_NE(ShimQp(a)->remote.load(), nullptr);
  EXPECT_EQ(ShimQp(stays)->remote.load(), nullptr) << "re-pointed at an endpoint it never knew";
  EXPECT_EQ(shim_.FindRemote(MovedPeerGid(), kOtherVqpn), nullptr);
  EXPECT_NE(shim_.FindRemote(MovedPeerGid(), kPeerVqpn), nullptr);
  // Connected after the publication: the same.
  ibv_qp* late = dev().Qp(IBV_QPT_RC);
  ASSERT_EQ(ToRts(shim_, late, kOtherVqpn, MovedPeerGid()), 0);
  EXPECT_EQ(ShimQp(late)->remote.load(), nullptr);
  for (const auto& m : fake_.modifies()) {
    if (m.qp != ShimQp(late)->real || !(m.mask & IBV_QP_DEST_QPN)) continue;
    EXPECT_EQ(m.attr.dest_qp_num, kOtherVqpn & ~kQpnMarker);
    EXPECT_FALSE(GidEq(m.attr.ah_attr.grh.dgid, FakeBackend::Gid(kIpv4GidIndex)));
  }
}

TEST_F(RemoteMapTest, ADatagramGoesWhereTheEndpointOfItsQpnIs) {
  auto [sender, b] = UdQps();
  ibv_qp* a = sender;                     // a name the lambda below can capture (clang 14)
  ibv_ah* ah = dev().Ah(MovedPeerGid());  // made before the move
  ASSERT_NE(ah, nullptr);
  PublishUdPeer(b);
  char payload[8] = "dgram";
  ibv_mr* smr = dev().Reg(payload, sizeof(payload));
  auto send = [&](uint32_t qpn) {
    ibv_sge sge = Sge(payload, sizeof(payload), smr);
    ibv_send_wr wr = UdSend(&sge, ah, qpn);
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(a, &wr, &bad), 0);
    EXPECT_EQ(wr.wr.ud.remote_qpn, qpn);
    EXPECT_EQ(wr.wr.ud.ah, ah);
    return fake_.sends().back();
  };
  const auto moved = send(kPeerVqpn);
  EXPECT_EQ(moved.remote_qpn, ShimQp(b)->real->qp_num);
  ASSERT_EQ(ShimAh(ah)->nroutes.load(), 1);
  EXPECT_EQ(moved.ah, ShimAh(ah)->routes[0].real);
  const auto stayed = send(kOtherVqpn);
  EXPECT_EQ(stayed.remote_qpn, kOtherVqpn & ~kQpnMarker);
  EXPECT_EQ(stayed.ah, ShimAh(ah)->real) << "sent to where the moved one went";
  // A second move of the same endpoint replaces its route.
  PublishUdPeer(b);
  EXPECT_EQ(ShimAh(ah)->nroutes.load(), 1);
  Drain(dev().cq);
}

TEST_F(RemoteMapTest, ADatagramFromAnotherEndpointOfTheMovedOnesHostKeepsItsOwnSource) {
  auto [a, b] = UdQps();             // b: the moved peer, now on this device
  ibv_qp* c = dev().Qp(IBV_QPT_UD);  // a native of this device
  ASSERT_EQ(ToRts(shim_, c, 0, {}), 0);
  PublishUdPeer(b);

  char dst[FakeBackend::kGrhBytes + 8] = {};
  const ibv_wc wc = ReceiveFrom(c, a, dst, sizeof(dst), "native");
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  ASSERT_EQ(wc.qp_num, a->qp_num) << "the datagram was not received";
  EXPECT_EQ(wc.src_qp, c->qp_num) << "shown as the moved peer's";
  const auto* ip = reinterpret_cast<const uint8_t*>(dst) + 20;
  EXPECT_NE(memcmp(ip + 12, MovedPeerGid().raw + 12, 4), 0) << "its source shown as the moved peer";
  EXPECT_STREQ(dst + FakeBackend::kGrhBytes, "native");
}

// A guest whose NIC was swapped: its old address is gone, and RoCE cannot
// resolve an AH toward it (rxe: ETIMEDOUT). An AH toward its virtual GID is
// then made toward where it is now (the VM lab's drain failed on this).
TEST_F(RemoteMapTest, AnAhTowardAGidNobodyAnswersAtAnyMoreGoesWhereItsEndpointMoved) {
  auto [a, b] = UdQps();
  PublishUdPeer(b);
  fake_.FailNext(FakeBackend::Op::kCreateAh, ETIMEDOUT);
  ibv_ah* ah = dev().Ah(MovedPeerGid());
  ASSERT_NE(ah, nullptr) << "no AH toward a peer that moved";
  EXPECT_TRUE(GidEq(fake_.ahs().front().attr.grh.dgid, FakeBackend::Gid(kIpv4GidIndex)))
      << "its own AH does not go where the peer is now";
  // Nothing moved from a GID: the failure is the application's.
  fake_.FailNext(FakeBackend::Op::kCreateAh, ETIMEDOUT);
  ibv_ah_attr attr{};
  attr.is_global = 1;
  attr.grh.dgid = dev().gid;
  attr.grh.sgid_index = kIpv4GidIndex;
  attr.port_num = FakeBackend::kPort;
  errno = 0;
  EXPECT_EQ(shim_.CreateAh(dev().pd, &attr), nullptr);
  EXPECT_EQ(errno, ETIMEDOUT);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
