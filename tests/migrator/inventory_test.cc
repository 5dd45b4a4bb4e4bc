// The inventory against a real etcd (Debian's etcd-server), started by each
// test on 127.0.0.1: registration under a lease, lookups by GID, claims of
// moves, and what happens when a migrator or etcd goes away.
#include "migrator/host/inventory.h"

#include <arpa/inet.h>

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "migrator/host/addresses.h"
#include "migrator/transport/tls.h"
#include "tests/migrator/etcd_process.h"
#include "tests/migrator/test_certs.h"

namespace rdmavirt::migrator {
namespace {

using testing::Etcd;
using testing::kEtcd;

std::string Gid(const char* text) {
  unsigned char g[16];
  EXPECT_EQ(inet_pton(AF_INET6, text, g), 1) << text;
  return std::string(reinterpret_cast<char*>(g), 16);
}

v1::InventoryHost Host(const std::string& name, const std::string& address,
                       std::vector<std::string> gids) {
  v1::InventoryHost h;
  h.set_name(name);
  h.set_address(address);
  v1::RdmaPort* p = h.mutable_info()->add_devices()->add_ports();
  p->set_state("ACTIVE");
  for (std::string& g : gids) p->add_gids(std::move(g));
  return h;
}

// Waits up to `limit` for `done`.
bool Eventually(const std::function<bool()>& done, absl::Duration limit = absl::Seconds(30)) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return done();
}

std::unique_ptr<Inventory> Connect(const std::string& url, absl::Duration ttl = absl::Seconds(10),
                                   const TlsFiles& tls = {}) {
  Inventory::Options o;
  o.endpoints = {url};
  o.ttl = ttl;
  o.rpc_timeout = absl::Seconds(2);
  o.tls = tls;
  absl::StatusOr<std::unique_ptr<Inventory>> inv = Inventory::Create(o);
  EXPECT_TRUE(inv.ok()) << inv.status();
  return inv.ok() ? *std::move(inv) : nullptr;
}

class InventoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(kEtcd)) << kEtcd << " missing: run tools/install-deps.sh";
  }
  // Until etcd answers.
  static void AwaitUp(Inventory* inv) {
    ASSERT_TRUE(Eventually([&] { return inv->Hosts().ok(); })) << inv->Hosts().status();
  }
};

TEST_F(InventoryTest, ARegisteredHostIsFoundByEachOfItsGids) {
  Etcd etcd;
  auto a = Connect(etcd.url());
  auto b = Connect(etcd.url());
  AwaitUp(a.get());
  ASSERT_TRUE(a->StartRegistration([] {
                 return Host("hostA", "10.78.0.1:7700",
                             {"fe80::5054:ff:fe77:1", "::ffff:10.77.0.1", "fec0::1"});
               }).ok());
  EXPECT_TRUE(a->Registered());
  for (const char* g : {"fe80::5054:ff:fe77:1", "::ffff:10.77.0.1", "fec0::1"}) {
    absl::StatusOr<v1::InventoryHost> owner = b->OwnerOfGid(Gid(g));
    ASSERT_TRUE(owner.ok()) << g << ": " << owner.status();
    EXPECT_EQ(owner->name(), "hostA");
    EXPECT_EQ(owner->address(), "10.78.0.1:7700");
  }
  absl::StatusOr<v1::InventoryHost> none = b->OwnerOfGid(Gid("::ffff:10.77.0.9"));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("no migrator owns GID ::ffff:10.77.0.9"),
            std::string::npos)
      << none.status();
  absl::StatusOr<std::vector<v1::InventoryHost>> hosts = b->Hosts();
  ASSERT_TRUE(hosts.ok());
  ASSERT_EQ(hosts->size(), 1u);
  EXPECT_EQ((*hosts)[0].info().devices(0).ports(0).gids_size(), 3);
}

TEST_F(InventoryTest, AHostThatStopsLeavesAtOnceAndOneThatDiesWhenItsLeaseExpires) {
  Etcd etcd;
  auto watcher = Connect(etcd.url());
  AwaitUp(watcher.get());
  auto stops = Connect(etcd.url(), absl::Seconds(3));
  auto dies = Connect(etcd.url(), absl::Seconds(3));
  ASSERT_TRUE(stops->StartRegistration([] { return Host("stops", "a:1", {"fec0::1"}); }).ok());
  ASSERT_TRUE(dies->StartRegistration([] { return Host("dies", "b:1", {"fec0::2"}); }).ok());
  // Kept alive past several lease lengths.
  absl::SleepFor(absl::Seconds(7));
  ASSERT_EQ(watcher->Hosts()->size(), 2u);

  stops->StopRegistration(/*revoke=*/true);
  EXPECT_EQ(watcher->OwnerOfGid(Gid("fec0::1")).status().code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(watcher->Hosts()->size(), 1u);

  // No revoke: as if the migrator was killed. Its keys go with the lease.
  dies->StopRegistration(/*revoke=*/false);
  EXPECT_TRUE(watcher->OwnerOfGid(Gid("fec0::2")).ok());
  EXPECT_TRUE(Eventually([&] { return watcher->Hosts().ok() && watcher->Hosts()->empty(); },
                         absl::Seconds(20)));
  EXPECT_EQ(watcher->OwnerOfGid(Gid("fec0::2")).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(InventoryTest, ASecondClaimOfOneEndpointIsRefusedUntilTheFirstIsDropped) {
  Etcd etcd;
  auto h1 = Connect(etcd.url());
  auto h2 = Connect(etcd.url());
  AwaitUp(h1.get());
  v1::MoveClaim first;
  first.set_subject("endpoint/e1");
  first.set_migration_id("m1");
  first.set_kind("migrate");
  first.set_source("h1");
  first.set_destination("h2:7700");
  // Not registered: nothing would hold the claim.
  EXPECT_EQ(h1->Claim(first).code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(h1->StartRegistration([] { return Host("h1", "h1:7700", {}); }).ok());
  ASSERT_TRUE(h2->StartRegistration([] { return Host("h2", "h2:7700", {}); }).ok());
  ASSERT_TRUE(h1->Claim(first).ok());

  v1::MoveClaim second = first;
  second.set_migration_id("m2");
  second.set_source("h2");
  absl::Status refused = h2->Claim(second);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("endpoint/e1 is being moved already: migrate m1 from h1"),
            std::string::npos)
      << refused;
  absl::StatusOr<std::vector<v1::MoveClaim>> moves = h2->Moves();
  ASSERT_TRUE(moves.ok());
  ASSERT_EQ(moves->size(), 1u);
  EXPECT_EQ((*moves)[0].migration_id(), "m1");

  // Another move's id does not drop it; its own does.
  ASSERT_TRUE(h2->Unclaim("endpoint/e1", "m2").ok());
  EXPECT_EQ(h2->Claim(second).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(h1->Unclaim("endpoint/e1", "m1").ok());
  EXPECT_TRUE(h2->Claim(second).ok());

  // A claim goes with its host's lease.
  h2->StopRegistration(/*revoke=*/true);
  EXPECT_TRUE(h2->Moves()->empty());
}

TEST_F(InventoryTest, WithoutEtcdCallsSayItCannotBeReached) {
  const int port = testing::FreePort();
  auto inv = Connect(absl::StrCat("http://127.0.0.1:", port), absl::Seconds(3));
  absl::StatusOr<std::vector<v1::InventoryHost>> hosts = inv->Hosts();
  EXPECT_EQ(hosts.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(hosts.status().message().find("the inventory cannot be reached"), std::string::npos)
      << hosts.status();
  EXPECT_FALSE(inv->StartRegistration([] { return Host("late", "l:1", {"fec0::7"}); }).ok());
  EXPECT_FALSE(inv->Registered());
  absl::StatusOr<v1::InventoryHost> owner = inv->OwnerOfGid(Gid("fec0::7"));
  EXPECT_EQ(owner.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(owner.status().message().find("no migrator owns"), std::string::npos);
  inv->StopRegistration(false);
}

// An etcd member in an election: its first answers are etcd's "leader
// changed", then it serves (no key).
class ElectingKv final : public etcdserverpb::KV::Service {
 public:
  explicit ElectingKv(int refusals) : refusals_(refusals) {}
  grpc::Status Range(grpc::ServerContext*, const etcdserverpb::RangeRequest*,
                     etcdserverpb::RangeResponse*) override {
    ++calls_;
    if (refusals_.fetch_sub(1) > 0)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "etcdserver: leader changed");
    return grpc::Status::OK;
  }
  int calls() const { return calls_.load(); }

 private:
  std::atomic<int> refusals_;
  std::atomic<int> calls_{0};
};

// `kv` served on a port of 127.0.0.1, in `*port`.
std::unique_ptr<grpc::Server> Serve(ElectingKv* kv, int* port) {
  return grpc::ServerBuilder()
      .AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port)
      .RegisterService(kv)
      .BuildAndStart();
}

TEST(InventoryElectionTest, AMemberInAnElectionIsAskedAgainUntilItServes) {
  // In the lab, etcd's member on host1 (the leader) was killed: host3's
  // member answered "leader changed", host2's was too slow, and
  // `rdmavirtctl hosts` failed with the cluster two thirds up.
  ElectingKv kv(/*refusals=*/3);
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&kv, &port);
  ASSERT_NE(server, nullptr);
  auto inv = Connect(absl::StrCat("http://127.0.0.1:", port));
  absl::StatusOr<std::vector<v1::InventoryHost>> hosts = inv->Hosts();
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  EXPECT_TRUE(hosts->empty());
  EXPECT_EQ(kv.calls(), 4);
  // One that stays in its election fails the call at its deadline.
  ElectingKv stuck(/*refusals=*/1000000);
  int stuck_port = 0;
  std::unique_ptr<grpc::Server> stuck_server = Serve(&stuck, &stuck_port);
  ASSERT_NE(stuck_server, nullptr);
  auto stuck_inv = Connect(absl::StrCat("http://127.0.0.1:", stuck_port));
  hosts = stuck_inv->Hosts();
  EXPECT_EQ(hosts.status().code(), absl::StatusCode::kUnavailable) << hosts.status();
  EXPECT_NE(hosts.status().message().find("leader changed"), std::string::npos) << hosts.status();
  stuck_inv->StopRegistration(false);
  inv->StopRegistration(false);
  server->Shutdown();
  stuck_server->Shutdown();
}

TEST_F(InventoryTest, AnEtcdThatLostItsDataGetsTheHostAgain) {
  auto etcd = std::make_unique<Etcd>();
  auto inv = Connect(etcd->url(), absl::Seconds(3));
  AwaitUp(inv.get());
  ASSERT_TRUE(inv->StartRegistration([] { return Host("h", "h:1", {"fec0::3"}); }).ok());
  const int port = etcd->port();
  etcd.reset();
  // A new, empty etcd on the same port: the old lease means nothing there.
  etcd = std::make_unique<Etcd>("", port);
  auto watcher = Connect(etcd->url());
  AwaitUp(watcher.get());
  EXPECT_TRUE(Eventually([&] { return watcher->OwnerOfGid(Gid("fec0::3")).ok(); }))
      << watcher->OwnerOfGid(Gid("fec0::3")).status();
  EXPECT_TRUE(inv->Registered());
  inv->StopRegistration(false);
}

TEST_F(InventoryTest, OverMutualTlsOnlyACertificateOfTheCaIsLetIn) {
  const std::string certs = testing::MakeTestCerts("inventory");
  absl::Cleanup remove_certs = [&] { testing::RemoveTestCerts(certs); };  // after etcd stops
  Etcd etcd(certs);
  absl::StatusOr<TlsFiles> mine = LoadTls(certs, "host1.pem", "host1.key");
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto inv = Connect(etcd.url(), absl::Seconds(10), *mine);
  AwaitUp(inv.get());
  ASSERT_TRUE(
      inv->StartRegistration([] { return Host("host1", "10.78.0.1:7700", {"fec0::4"}); }).ok());
  EXPECT_EQ(inv->OwnerOfGid(Gid("fec0::4"))->name(), "host1");
  // Without a certificate the handshake fails: etcd says nothing.
  auto plain = Connect("http" + etcd.url().substr(5), absl::Seconds(10));
  EXPECT_FALSE(plain->Hosts().ok());
  // https needs a certificate to present.
  Inventory::Options o;
  o.endpoints = {etcd.url()};
  EXPECT_EQ(Inventory::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  inv->StopRegistration(true);
}

TEST(InventoryOptionsTest, BadEndpointsAreRefusedBeforeAnythingIsDialed) {
  for (const char* bad : {"127.0.0.1:2379", "ftp://h:1", "http://", "http://h", "http://h:1/x"}) {
    Inventory::Options o;
    o.endpoints = {bad};
    absl::StatusOr<std::unique_ptr<Inventory>> inv = Inventory::Create(o);
    EXPECT_EQ(inv.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  Inventory::Options o;
  o.endpoints = {"http://a:1,http://b:2"};
  absl::StatusOr<std::unique_ptr<Inventory>> two = Inventory::Create(o);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ((*two)->Describe(), "http://a:1,http://b:2");
  o.prefix = "/no-slash";
  EXPECT_FALSE(Inventory::Create(o).ok());
}

TEST(GidTest, TextAndKeyForms) {
  EXPECT_EQ(GidText(Gid("::ffff:10.77.0.1")), "::ffff:10.77.0.1");
  EXPECT_EQ(GidKey(Gid("fe80::1")), "fe800000000000000000000000000001");
}

}  // namespace
}  // namespace rdmavirt::migrator
