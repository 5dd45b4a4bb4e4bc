// The shim's hand-written codec against protoc's generated code for
// control.proto: what the shim writes, the migrator parses; what the
// migrator writes, the shim reads; what is malformed, the shim refuses.
#include "shim/migration/control.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "rdmavirt/v1/control.pb.h"
#include "shim/migration/wire.h"
#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim {
namespace {

ibv_gid GidOf(uint8_t last) {
  ibv_gid g{};
  g.raw[10] = g.raw[11] = 0xff;
  g.raw[12] = 10;
  g.raw[13] = 77;
  g.raw[15] = last;
  return g;
}

std::string Raw(const ibv_gid& g) { return std::string(reinterpret_cast<const char*>(g.raw), 16); }

TEST(ControlCodecTest, HelloParsesAsTheSchemaSays) {
  v1::ShimToMigrator m;
  ASSERT_TRUE(m.ParseFromString(EncodeHello(4242, "abc123", true, "integrity")));
  ASSERT_TRUE(m.has_hello());
  EXPECT_EQ(m.hello().version(), v1::CONTROL_VERSION_V1);
  EXPECT_EQ(m.hello().pid(), 4242);
  EXPECT_EQ(m.hello().endpoint_id(), "abc123");
  EXPECT_EQ(m.hello().phase(), v1::ENDPOINT_PHASE_RELEASED);
  EXPECT_EQ(m.hello().program(), "integrity");
}

TEST(ControlCodecTest, ReplyCarriesTheEndpointView) {
  EndpointView v;
  v.paused = true;
  v.device = "rxe0";
  v.devices = 1;
  v.mrs = 3;
  v.qps = 1;
  v.registered_bytes = 1ull << 33;
  v.has_gid = true;
  v.virtual_gid = GidOf(1);
  v.physical_gid = GidOf(2);
  v.qpns = {{0x11, 0x22}};
  v.rkeys = {{0x80001234u, 0x5678}};
  QpView q;
  q.virtual_qpn = 0x11;
  q.physical_qpn = 0x22;
  q.qp_type = IBV_QPT_RC;
  q.state = IBV_QPS_RTS;
  q.connected = true;
  q.remote_virtual_gid = GidOf(3);
  q.remote_virtual_qpn = 0x33;
  q.remote_physical_gid = GidOf(4);
  q.outstanding_recvs = 5;
  v.qp_list.push_back(q);
  v.ud_peer_physical_gids = {GidOf(5), GidOf(6)};
  v1::ShimToMigrator m;
  ASSERT_TRUE(m.ParseFromString(
      EncodeReply(7, Error(Code::kDeadlineExceeded, "late"), v, "ep", -1, 99, 4)));
  EXPECT_EQ(m.request_id(), 7u);
  const v1::Reply& r = m.reply();
  EXPECT_EQ(r.code(), 4);
  EXPECT_EQ(r.message(), "late");
  EXPECT_EQ(r.elapsed_us(), 99u);
  EXPECT_EQ(r.drained_sends(), 4u);
  const v1::EndpointSummary& s = r.summary();
  EXPECT_EQ(s.pid(), -1) << "negative int32 as protobuf writes it";
  EXPECT_TRUE(s.suspended());
  EXPECT_EQ(s.phase(), v1::ENDPOINT_PHASE_RUNNING);
  EXPECT_EQ(s.device(), "rxe0");
  EXPECT_EQ(s.counts().mrs(), 3u);
  EXPECT_EQ(s.counts().registered_bytes(), 1ull << 33);
  ASSERT_EQ(s.qps_size(), 1);
  EXPECT_EQ(s.qps(0).remote_virtual_qpn(), 0x33u);
  EXPECT_EQ(s.qps(0).remote_physical_gid(), Raw(GidOf(4)));
  EXPECT_EQ(s.qps(0).outstanding_recvs(), 5u);
  ASSERT_EQ(s.ud_peer_physical_gids_size(), 2);
  EXPECT_EQ(s.ud_peer_physical_gids(0), Raw(GidOf(5)));
  EXPECT_EQ(s.ud_peer_physical_gids(1), Raw(GidOf(6)));
  EXPECT_EQ(s.mapping().virtual_gid(), Raw(GidOf(1)));
  ASSERT_EQ(s.mapping().rkeys_size(), 1);
  EXPECT_EQ(s.mapping().rkeys(0).virtual_id(), 0x80001234u);
  EXPECT_EQ(s.mapping().rkeys(0).physical_id(), 0x5678u);
}

TEST(ControlCodecTest, RequestsFromTheSchemaDecode) {
  v1::MigratorToShim m;
  m.set_request_id(12);
  v1::Restore* r = m.mutable_restore();
  r->set_device("rxe0");
  for (uint8_t i = 1; i <= 2; ++i) {
    v1::Mapping* p = r->add_peers();
    p->set_virtual_gid(Raw(GidOf(i)));
    p->set_physical_gid(Raw(GidOf(i + 10)));
    v1::IdPair* q = p->add_qpns();
    q->set_virtual_id(100 + i);
    q->set_physical_id(200 + i);
  }
  ControlRequest req;
  std::string why;
  ASSERT_TRUE(DecodeRequest(m.SerializeAsString(), &req, &why)) << why;
  EXPECT_EQ(req.id, 12u);
  EXPECT_EQ(req.kind, ControlRequest::Kind::kRestore);
  EXPECT_EQ(req.device, "rxe0");
  ASSERT_EQ(req.peers.size(), 2u);
  EXPECT_EQ(memcmp(req.peers[1].physical_gid.raw, GidOf(12).raw, 16), 0);
  ASSERT_EQ(req.peers[1].qpns.size(), 1u);
  EXPECT_EQ(req.peers[1].qpns[0], std::make_pair(102u, 202u));

  v1::MigratorToShim q;
  q.set_request_id(13);
  q.mutable_quiesce()->set_drain_timeout_ms(2500);
  ASSERT_TRUE(DecodeRequest(q.SerializeAsString(), &req, &why)) << why;
  EXPECT_EQ(req.kind, ControlRequest::Kind::kQuiesce);
  EXPECT_EQ(req.drain_timeout_ms, 2500u);

  v1::MigratorToShim pq;
  pq.set_request_id(15);
  pq.mutable_peer_quiesce()->set_virtual_gid(Raw(GidOf(7)));
  pq.mutable_peer_quiesce()->set_drain_timeout_ms(900);
  ASSERT_TRUE(DecodeRequest(pq.SerializeAsString(), &req, &why)) << why;
  EXPECT_EQ(req.kind, ControlRequest::Kind::kPeerQuiesce);
  EXPECT_EQ(req.drain_timeout_ms, 900u);
  ASSERT_TRUE(req.has_toward);
  EXPECT_EQ(memcmp(req.toward.raw, GidOf(7).raw, 16), 0);
  pq.mutable_peer_quiesce()->set_virtual_gid("short");
  EXPECT_FALSE(DecodeRequest(pq.SerializeAsString(), &req, &why));
  EXPECT_NE(why.find("16 bytes"), std::string::npos) << why;

  v1::MigratorToShim e;
  e.set_request_id(14);
  e.mutable_release();  // an empty message still selects the command
  ASSERT_TRUE(DecodeRequest(e.SerializeAsString(), &req, &why)) << why;
  EXPECT_EQ(req.kind, ControlRequest::Kind::kRelease);
  EXPECT_TRUE(req.known.empty());
}

TEST(ControlCodecTest, AReleaseCarriesThePagesTheDestinationHolds) {
  const std::vector<char> page_a(4096, 'a'), page_b(4096, 'b');
  std::string addrs, digests;
  EncodeKnownPages(
      {{0x10000, DigestOf(page_a.data(), 4096)}, {0x13000, DigestOf(page_b.data(), 4096)}}, &addrs,
      &digests);
  v1::MigratorToShim m;
  m.set_request_id(21);
  m.mutable_release()->set_known_page_addrs(addrs);
  m.mutable_release()->set_known_page_digests(digests);
  ControlRequest req;
  std::string why;
  ASSERT_TRUE(DecodeRequest(m.SerializeAsString(), &req, &why)) << why;
  ASSERT_EQ(req.known.size(), 2u);
  EXPECT_TRUE(req.known.Unchanged(0x10000, page_a.data(), 4096));
  EXPECT_TRUE(req.known.Unchanged(0x13000, page_b.data(), 4096));
  EXPECT_FALSE(req.known.Unchanged(0x10000, page_b.data(), 4096)) << "changed content";
  EXPECT_FALSE(req.known.Unchanged(0x11000, page_a.data(), 4096)) << "a page not sent";

  // Digests that do not match the addresses in number, and addresses out of
  // order, are refused rather than half believed.
  m.mutable_release()->set_known_page_digests(digests.substr(0, 16));
  EXPECT_FALSE(DecodeRequest(m.SerializeAsString(), &req, &why));
  EXPECT_NE(why.find("known pages"), std::string::npos) << why;
  m.mutable_release()->set_known_page_digests(digests);
  m.mutable_release()->set_known_page_addrs(addrs.substr(8) + addrs.substr(0, 8));
  EXPECT_FALSE(DecodeRequest(m.SerializeAsString(), &req, &why));
}

TEST(ControlCodecTest, MalformedRequestsAreRefusedWithAReason) {
  v1::MigratorToShim m;
  m.set_request_id(5);
  v1::Mapping* p = m.mutable_peer_reconnect()->mutable_mapping();
  p->set_virtual_gid(Raw(GidOf(1)));
  p->set_physical_gid(Raw(GidOf(2)));
  const std::string good = m.SerializeAsString();
  ControlRequest req;
  std::string why;
  ASSERT_TRUE(DecodeRequest(good, &req, &why)) << why;
  // Every truncation is refused (or, cut at a field boundary, incomplete).
  for (size_t n = 1; n < good.size(); ++n) {
    why.clear();
    EXPECT_FALSE(DecodeRequest(good.substr(0, n), &req, &why)) << n;
    EXPECT_FALSE(why.empty());
  }
  p->set_virtual_gid("short");
  EXPECT_FALSE(DecodeRequest(m.SerializeAsString(), &req, &why));
  EXPECT_NE(why.find("16 bytes"), std::string::npos) << why;
  EXPECT_FALSE(DecodeRequest(std::string("\xff\xff\xff", 3), &req, &why));
  v1::MigratorToShim no_id;
  no_id.mutable_describe();
  EXPECT_FALSE(DecodeRequest(no_id.SerializeAsString(), &req, &why));
  EXPECT_NE(why.find("id"), std::string::npos) << why;
  v1::MigratorToShim no_command;
  no_command.set_request_id(3);
  EXPECT_FALSE(DecodeRequest(no_command.SerializeAsString(), &req, &why));
}

TEST(ControlCodecTest, ExecuteRunsTheStepAndReportsTheEndpoint) {
  FakeBackend fake;
  Shim shim(&fake, IdentityMode{}, true);
  {
    testing::Device<Shim> dev(shim);
    ibv_qp* qp = dev.Qp(IBV_QPT_RC);
    ASSERT_EQ(testing::ToRts(shim, qp, 0x1d1, dev.gid), 0);
    // Registered memory: writable by the HCA, and read-only for it.
    alignas(4096) static char writable[8192];
    static char read_only[4096];
    dev.Reg(writable, sizeof writable, IBV_ACCESS_LOCAL_WRITE);
    dev.Reg(read_only, sizeof read_only, IBV_ACCESS_REMOTE_READ);
    ControlRequest req;
    req.id = 1;
    req.kind = ControlRequest::Kind::kQuiesce;
    bool released = true;
    v1::ShimToMigrator m;
    ASSERT_TRUE(m.ParseFromString(Execute(&shim, req, "ep", 77, &released)));
    EXPECT_FALSE(released);
    EXPECT_EQ(m.reply().code(), 0) << m.reply().message();
    // The quiesce's reply names the memory a release may mark, and only it.
    ASSERT_EQ(m.reply().writable_registered_size(), 1);
    EXPECT_EQ(m.reply().writable_registered(0).begin(), reinterpret_cast<uintptr_t>(writable));
    EXPECT_EQ(m.reply().writable_registered(0).end(),
              reinterpret_cast<uintptr_t>(writable) + sizeof writable);
    EXPECT_TRUE(m.reply().summary().suspended());
    EXPECT_EQ(m.reply().summary().counts().qps(), 1u);
    EXPECT_EQ(m.reply().summary().qps(0).remote_virtual_qpn(), 0x1d1u);
    req.id = 2;
    req.kind = ControlRequest::Kind::kRelease;
    ASSERT_TRUE(m.ParseFromString(Execute(&shim, req, "ep", 77, &released)));
    EXPECT_TRUE(released);
    // Nothing known: each page of the writable registration is marked.
    EXPECT_EQ(m.reply().pages_marked(), 2u);
    EXPECT_EQ(m.reply().pages_unchanged(), 0u);
    EXPECT_EQ(m.reply().summary().phase(), v1::ENDPOINT_PHASE_RELEASED);
    req.id = 3;
    req.kind = ControlRequest::Kind::kRestore;
    ASSERT_TRUE(m.ParseFromString(Execute(&shim, req, "ep", 77, &released)));
    EXPECT_EQ(m.reply().code(), 0) << m.reply().message();
    EXPECT_FALSE(released);
    EXPECT_EQ(m.reply().summary().mapping().qpns_size(), 1);
    req.id = 4;
    req.kind = ControlRequest::Kind::kResume;
    ASSERT_TRUE(m.ParseFromString(Execute(&shim, req, "ep", 77, &released)));
    EXPECT_FALSE(m.reply().summary().suspended());
  }
  EXPECT_EQ(fake.live_objects(), 0);
}

}  // namespace
}  // namespace rdmavirt::shim
