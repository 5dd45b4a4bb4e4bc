// The migrator's orchestration over fake hosts (FakeHost: shims, processes
// and CRIU), with real gRPC between migrators (in-process channels): the
// happy path, refusals before anything is touched, rollback at each
// failure point, checkpoint/restore, and recovery after a restart.
#include "migrator/move/migrator.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "migrator/criu/image_dir.h"
#include "migrator/host/addresses.h"
#include "migrator/host/containers.h"
#include "migrator/host/inventory.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/move/record_store.h"
#include "migrator/transport/grpc_service.h"
#include "tests/migrator/etcd_process.h"
#include "tests/migrator/fake_host.h"

namespace rdmavirt::migrator {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using testing::FakeEndpoint;
using testing::FakeHost;
using testing::FakeQp;
using testing::Gid;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::Rendezvous;

std::string VGid(int n) {
  std::string g(16, '\0');
  g[0] = static_cast<char>(0xfe);
  g[1] = static_cast<char>(0x80);
  g[15] = static_cast<char>(n);
  return g;
}

// A directory for the test, removed when the test binary exits if every
// test passed.
std::string TempDir(const std::string& name) {
  struct Dirs {
    std::vector<std::string> all;
    ~Dirs() {
      if (!::testing::UnitTest::GetInstance()->Passed()) return;
      std::error_code ec;
      for (const std::string& d : all) std::filesystem::remove_all(d, ec);
    }
  };
  static Dirs dirs;
  std::string dir = absl::StrCat(::testing::TempDir(), "/migrator_test-", getpid(), "-", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  dirs.all.push_back(dir);
  return dir;
}

// A FakeHost's containers: each a name for the process that is its first
// (and its endpoint, pid 1 inside); the checkpoint is the host's dump
// beside an export file that names the container, the restore the host's
// restore of it.
class FakeContainers final : public ContainerRuntime {
 public:
  explicit FakeContainers(FakeHost* host) : host_(host) {}

  void Run(const std::string& name, pid_t pid, const std::string& runtime = "runc",
           std::vector<std::string> binds = {}) {
    ContainerInfo c;
    c.name = name;
    c.id = absl::StrCat("id-", name);
    c.image = "localhost/app:1";
    c.image_id = "img1";
    c.runtime = runtime;
    c.pid = pid;
    c.running = true;
    c.devices = {"/dev/null"};  // a character device every host has
    c.binds = std::move(binds);
    absl::MutexLock lock(&mu_);
    containers_[name] = c;
  }
  bool Has(const std::string& name) {
    absl::MutexLock lock(&mu_);
    return containers_.contains(name);
  }
  std::vector<std::string> Events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::set<std::string> images = {"img1"};
  absl::Status restore_error;

  absl::StatusOr<std::string> Version() override { return std::string("fake"); }
  absl::StatusOr<ContainerInfo> Inspect(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    auto it = containers_.find(name);
    if (it == containers_.end()) return absl::NotFoundError(absl::StrCat("no container ", name));
    return it->second;
  }
  absl::StatusOr<std::vector<ContainerInfo>> List() override {
    absl::MutexLock lock(&mu_);
    std::vector<ContainerInfo> out;
    for (const auto& [name, c] : containers_) out.push_back(c);
    return out;
  }
  bool HasImage(const std::string& image_id) override { return images.contains(image_id); }
  absl::Status CanCheckpoint(const std::string& runtime) override {
    if (runtime == "crun")
      return absl::FailedPreconditionError("its OCI runtime crun is built without CRIU");
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> Checkpoint(const std::string& name, const std::string& file,
                                      bool leave_running, bool tcp) override {
    absl::StatusOr<ContainerInfo> c = Inspect(name);
    if (!c.ok()) return c.status();
    const std::string dir = std::filesystem::path(file).parent_path();
    absl::StatusOr<DumpStats> d = host_->Dump(c->pid, dir, "", leave_running, tcp);
    if (!d.ok()) return d.status();
    std::ofstream(file) << name;
    absl::MutexLock lock(&mu_);
    events_.push_back(absl::StrCat("checkpoint ", name));
    return d->image_bytes + name.size();
  }
  absl::StatusOr<pid_t> Restore(const std::string& asked, const std::string& file,
                                bool tcp) override {
    std::string name;
    std::ifstream(file) >> name;
    if (name != asked) return absl::InvalidArgumentError("the export names another container");
    {
      absl::MutexLock lock(&mu_);
      events_.push_back(absl::StrCat("restore ", name));
      if (!restore_error.ok()) return restore_error;
    }
    absl::StatusOr<pid_t> pid =
        host_->Restore(std::filesystem::path(file).parent_path(), tcp, false, nullptr, nullptr);
    if (!pid.ok()) return pid.status();
    Run(name, *pid);
    return *pid;
  }
  absl::Status Remove(const std::string& name) override {
    absl::MutexLock lock(&mu_);
    auto it = containers_.find(name);
    if (it == containers_.end()) return absl::OkStatus();
    (void)host_->Kill(it->second.pid);
    containers_.erase(it);
    events_.push_back(absl::StrCat("remove ", name));
    return absl::OkStatus();
  }
  pid_t PidInside(pid_t pid) override {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, c] : containers_)
      if (c.pid == pid) return 1;
    return pid;
  }
  pid_t HostPid(pid_t root, pid_t inside) override { return inside == 1 ? root : 0; }

 private:
  FakeHost* const host_;
  absl::Mutex mu_;
  std::map<std::string, ContainerInfo> containers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

// Hosts 1..3 ("h1:7700"...), each a FakeHost, a Migrator and its Transfer
// service behind a gRPC server on a unix socket.
class Cluster {
 public:
  struct Node {
    std::unique_ptr<FakeHost> host;
    std::unique_ptr<FakeContainers> containers;
    std::string state_dir;
    bool rdma = true;
    uint32_t guest_nics = 0;               // capacity; 0: no NICs for guests
    std::unique_ptr<Inventory> inventory;  // with an etcd: registered there
    absl::Duration inventory_ttl = absl::Seconds(3);
    std::unique_ptr<Migrator> m;
    std::unique_ptr<TransferService> svc;
    std::unique_ptr<grpc::Server> server;
  };

  // `inventory`: an etcd URL; the migrators register there and find their
  // peers' hosts through it (else by a table of the hosts' GIDs).
  explicit Cluster(const std::string& test, const std::string& inventory = "")
      : inventory_(inventory) {
    for (int n = 1; n <= 3; ++n) {
      Node& node = nodes_[n];
      node.host = std::make_unique<FakeHost>(n);
      node.containers = std::make_unique<FakeContainers>(node.host.get());
      node.state_dir = TempDir(absl::StrCat(test, "-h", n));
      Start(n);
    }
  }
  ~Cluster() {
    for (auto& [n, node] : nodes_) Stop(n);
  }

  static std::string Target(int n) { return absl::StrCat("h", n, ":7700"); }

  // (Re)starts host n's migrator on its state directory, and has it
  // recover what a previous run left there, as the daemon does (unless
  // the test shows what comes before that, or sets the host up for it).
  void Start(int n, bool recover = true) {
    Node& node = nodes_[n];
    Migrator::Options o;
    o.host_name = absl::StrCat("h", n);
    o.state_dir = node.state_dir;
    o.version = "test";
    o.hello_timeout = absl::Seconds(2);
    o.close_timeout = absl::Seconds(1);
    o.rpc_timeout = absl::Seconds(5);
    o.transfer_timeout = absl::Seconds(10);
    o.restart_wait = absl::Seconds(3);
    o.shims_return_within = absl::ZeroDuration();  // a fake host's never left
    o.drain_timeout_ms = 100;
    if (inventory_.empty()) {
      o.locate_peer = [this, n](const std::string& gid) -> std::string {
        for (auto& [k, other] : nodes_)
          if (other.host->gid() == gid) return k == n ? "" : Target(k);
        return "unknown:7700";
      };
    } else {
      Inventory::Options io;
      io.endpoints = {inventory_};
      io.ttl = node.inventory_ttl;
      node.inventory = *Inventory::Create(io);
      o.inventory = node.inventory.get();
    }
    o.connect = [this](const std::string& target) -> std::unique_ptr<v1::Transfer::StubInterface> {
      for (auto& [k, other] : nodes_)
        if (Target(k) == target && other.server != nullptr)
          return v1::Transfer::NewStub(
              grpc::CreateChannel(Socket(k), grpc::InsecureChannelCredentials()));
      // Nothing listens there.
      return v1::Transfer::NewStub(
          grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
    };
    o.address_toward = [n](const std::string&) -> std::string {
      return absl::StrCat("10.0.0.", n);
    };
    o.list_devices = [this, n] {
      std::vector<v1::RdmaDevice> out;
      if (!nodes_[n].rdma) return out;
      v1::RdmaDevice d;
      d.set_name("fake0");
      v1::RdmaPort* p = d.add_ports();
      p->set_port_num(1);
      p->set_state("ACTIVE");
      p->add_gids(GidText(nodes_[n].host->gid()));
      out.push_back(d);
      return out;
    };
    if (node.guest_nics > 0) {
      o.guest_nic_bridge = "br0";
      o.guest_nic_first = absl::StrCat("10.9.", n, ".1/16");
      o.guest_nic_capacity = node.guest_nics;
    }
    FakeHost* h = node.host.get();
    o.addresses = h;
    o.containers = node.containers.get();
    node.m = std::make_unique<Migrator>(o, h, h, h);
    node.svc = std::make_unique<TransferService>(node.m.get(), Admission::kAnyone);
    grpc::ServerBuilder b;
    b.RegisterService(node.svc.get());
    b.AddListeningPort(Socket(n), grpc::InsecureServerCredentials());
    node.server = b.BuildAndStart();
    if (node.inventory != nullptr) {
      Migrator* m = node.m.get();
      const absl::Status st = node.inventory->StartRegistration([m, n] {
        v1::InventoryHost h = m->DescribeForInventory();
        h.set_address(Target(n));
        return h;
      });
      EXPECT_TRUE(st.ok()) << st;
    }
    if (recover) node.m->Recover();
  }

  void Stop(int n) {
    Node& node = nodes_[n];
    if (node.server) node.server->Shutdown();
    node.server.reset();
    node.svc.reset();
    if (node.inventory != nullptr) node.inventory->StopRegistration(/*revoke=*/true);
    node.m.reset();
    node.inventory.reset();
  }

  Node& operator[](int n) { return nodes_[n]; }
  FakeHost& host(int n) { return *nodes_[n].host; }
  FakeContainers& containers(int n) { return *nodes_[n].containers; }
  Migrator& m(int n) { return *nodes_[n].m; }

 private:
  // Host n's migrator listens on a unix socket: a channel made before it
  // stopped fails as a dead host's does (UNAVAILABLE), and reaches it
  // again once it is started anew.
  std::string Socket(int n) { return absl::StrCat("unix:", nodes_[n].state_dir, "/grpc.sock"); }

  const std::string inventory_;
  std::map<int, Node> nodes_;
};

// Endpoint 100 on h1 (vgid 1) with an RC QP to endpoint 300 on h3 (vgid 3)
// and one to endpoint 200 on h1 itself (vgid 2).
void Topology(Cluster& c) {
  c.host(1).Add(100, VGid(1),
                {FakeQp{11, 2, VGid(3), 31, Gid(3)}, FakeQp{12, 2, VGid(2), 21, Gid(1)}});
  c.host(1).Add(200, VGid(2), {FakeQp{21, 2, VGid(1), 12, Gid(1)}});
  c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
}

struct MoveRun {
  absl::Status status;
  std::vector<std::string> phases;
  v1::MigrationReport report;
};

MoveRun Migrate(Cluster& c, int pid, const std::string& to,
                const std::vector<std::string>& addresses = {}, int from = 1,
                uint32_t max_precopy = 0, bool postcopy = false) {
  MoveRun run;
  v1::MigrateRequest req;
  req.set_pid(pid);
  req.set_destination(to);
  req.set_max_precopy_iterations(max_precopy);
  req.set_postcopy(postcopy);
  for (const std::string& a : addresses) req.add_addresses(a);
  run.status = c.m(from).Migrate(req, [&](const v1::Progress& p) {
    if (p.has_report())
      run.report = p.report();
    else if (run.phases.empty() || run.phases.back() != p.phase())
      run.phases.push_back(p.phase());
  });
  return run;
}

std::vector<std::string> Commands(const std::vector<std::string>& log) {
  std::vector<std::string> out;
  for (const auto& c : log)
    if (c != "describe") out.push_back(c);
  return out;
}

TEST(MigratorTest, MigratesAndReconnectsEveryPeer) {
  Cluster c("ok");
  Topology(c);
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_FALSE(run.report.rolled_back());
  EXPECT_THAT(run.phases, ElementsAre("prepare", "precopy", "quiesce", "release", "dump",
                                      "transfer", "restore", "reconnect", "cleanup"))
      << ::testing::PrintToString(run.phases);
  // The source process is gone; the endpoint runs on h2, resumed.
  EXPECT_FALSE(c.host(1).Exists(100));
  FakeEndpoint moved = c.host(2).Get(100);
  ASSERT_EQ(moved.pid, 100);
  EXPECT_TRUE(moved.alive && moved.connected && !moved.released && !moved.paused);
  EXPECT_THAT(Commands(moved.log), ElementsAre("restore", "resume"));
  // Each peer was suspended, then re-pointed at h2, its host's cached
  // routes forgotten first (rxe keeps an RC QP's route across modify_qp).
  EXPECT_EQ(c.host(1).routes_forgotten(), 1);
  EXPECT_EQ(c.host(3).routes_forgotten(), 1);
  for (auto [host, pid] : {std::pair{1, 200}, std::pair{3, 300}}) {
    FakeEndpoint p = c.host(host).Get(pid);
    EXPECT_THAT(Commands(p.log), ElementsAre("peer_quiesce", "peer_reconnect")) << pid;
    ASSERT_EQ(p.reconnected_to.size(), 1u);
    EXPECT_EQ(p.reconnected_to[0].virtual_gid(), VGid(1));
    EXPECT_EQ(p.reconnected_to[0].physical_gid(), Gid(2));
    EXPECT_FALSE(p.paused);
  }
  EXPECT_EQ(run.report.peers(), 2u);
  EXPECT_EQ(run.report.qps(), 2u);
  EXPECT_GE(run.report.precopy_iterations(), 1u);
  EXPECT_GT(run.report.bytes_moved(), 64u << 10);
  // What each round sent and the final dump add up to what moved (the
  // rest is the connection state).
  ASSERT_EQ(run.report.precopy_bytes_size(), static_cast<int>(run.report.precopy_iterations()));
  uint64_t images = run.report.final_bytes();
  for (uint64_t n : run.report.precopy_bytes()) images += n;
  EXPECT_GT(run.report.final_bytes(), 0u);
  EXPECT_LE(images, run.report.bytes_moved());
  EXPECT_GT(run.report.breakdown().blackout_us(), 0u);
  EXPECT_GE(run.report.breakdown().total_us(), run.report.breakdown().blackout_us());
  // Recorded as done; the destination kept no images.
  auto records = ListRecords(c[1].state_dir + "/migrations");
  ASSERT_EQ(records.size(), 1u);
  EXPECT_TRUE(records[0].second.done());
  EXPECT_TRUE(records[0].second.report().ok());
  auto incoming = ListRecords(c[2].state_dir + "/incoming");
  ASSERT_EQ(incoming.size(), 1u);
  EXPECT_TRUE(incoming[0].second.done());
  EXPECT_FALSE(std::filesystem::exists(incoming[0].first + "/final"));
  EXPECT_EQ(c.m(1).Status().recent_size(), 1);
}

// A move whose `sink` sees every progress message, in order.
MoveRun MigrateWatched(Cluster& c, int pid, const std::string& to,
                       const std::function<void(const v1::Progress&)>& watch) {
  MoveRun run;
  v1::MigrateRequest req;
  req.set_pid(pid);
  req.set_destination(to);
  run.status = c.m(1).Migrate(req, [&](const v1::Progress& p) {
    watch(p);
    if (p.has_report())
      run.report = p.report();
    else if (run.phases.empty() || run.phases.back() != p.phase())
      run.phases.push_back(p.phase());
  });
  return run;
}

// Once the endpoint runs on the destination, a host whose migrator died
// (and comes back) is asked again: its peers are re-pointed, the endpoint
// resumed; before, the move ended there, the peer or the endpoint left
// paused for ever.

// AllAtOnce runs every call once, up to kMaxAtOnce of them at the same
// time and never more: 32 calls that wait for each other all meet, and a
// hundred calls never have more than 32 running.
TEST(AllAtOnceTest, RunsEveryCallOnceAndAtMost32AtATime) {
  Rendezvous meet;
  meet.expected = static_cast<int>(kMaxAtOnce);
  std::vector<int> ran(kMaxAtOnce, 0);
  AllAtOnce(kMaxAtOnce, [&](size_t i) {
    meet.Arrive();
    ++ran[i];
  });
  EXPECT_EQ(ran, std::vector<int>(kMaxAtOnce, 1));
  {
    absl::MutexLock lock(&meet.mu);
    EXPECT_TRUE(meet.all_met) << "the calls did not all run at once";
  }
  std::atomic<int> running{0}, most{0};
  std::vector<std::atomic<int>> calls(100);
  AllAtOnce(calls.size(), [&](size_t i) {
    const int now = ++running;
    for (int m = most.load(); now > m && !most.compare_exchange_weak(m, now);) {
    }
    absl::SleepFor(absl::Milliseconds(2));
    ++calls[i];
    --running;
  });
  for (const std::atomic<int>& c : calls) EXPECT_EQ(c.load(), 1);
  EXPECT_LE(most.load(), static_cast<int>(kMaxAtOnce));
  EXPECT_GE(most.load(), 2) << "never two at once";
}

// `peer` was paused for h1's endpoint 100 moving to h2, re-pointed at it
// there once, and resumed.
void ExpectRepointedToH2(const FakeEndpoint& peer) {
  EXPECT_THAT(peer.log, Contains("peer_quiesce"));
  ASSERT_EQ(peer.reconnected_to.size(), 1u);
  EXPECT_EQ(peer.reconnected_to[0].virtual_gid(), VGid(1));
  EXPECT_EQ(peer.reconnected_to[0].physical_gid(), Gid(2));
  EXPECT_FALSE(peer.paused);
}

// Peers on several hosts are re-pointed at once: the re-points of host1's
// peer and of host3's wait for each other, in vain if one host were asked
// only after the other had answered (1024 QPs take seconds to re-point).
// A peer that ends between its quiesce and its re-point (its workload
// done) leaves nothing to re-point: the move is done all the same. Before,
// it was reported failed ("peer reconnect of process N: no shim of process
// N is connected"), an inventory test's drain in the lab found.
TEST(MigratorTest, APeerThatEndedBeforeItsRepointDoesNotFailTheMove) {
  Cluster c("peer-ended");
  Topology(c);
  c.host(3).Fail(300, "peer_reconnect", absl::StatusCode::kNotFound);
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_FALSE(run.report.rolled_back());
  EXPECT_FALSE(c.host(3).Exists(300));
  EXPECT_TRUE(c.host(2).Get(100).alive);
  // The other peer was re-pointed.
  EXPECT_THAT(Commands(c.host(1).Get(200).log), ElementsAre("peer_quiesce", "peer_reconnect"));
  ASSERT_EQ(c.host(1).Get(200).reconnected_to.size(), 1u);
}

TEST(MigratorTest, PeersOnEveryHostAreRepointedAtOnce) {
  Cluster c("ok");
  Topology(c);
  Rendezvous meet;
  meet.expected = 2;
  c.host(1).reconnect_rendezvous = &meet;
  c.host(3).reconnect_rendezvous = &meet;
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  absl::MutexLock lock(&meet.mu);
  EXPECT_EQ(meet.arrived, 2);
  EXPECT_TRUE(meet.all_met) << "one host's peers were re-pointed after the other's";
}
// A host's shims are described all at once, so that one slow to answer
// (its process stopped, say) costs one deadline, not one per shim: for
// `rdmavirtctl ps`, and for a peer's quiesce, which describes every shim
// of its host inside the blackout. Three describes wait for each other
// here, in vain if they were asked one after the other.
TEST(MigratorTest, AHostsShimsAreDescribedAtOnce) {
  Cluster c("describe");
  Topology(c);
  for (pid_t pid : {301, 302})
    c.host(3).Add(pid, VGid(pid), {FakeQp{static_cast<uint32_t>(pid), 2, "", 0, ""}});
  Rendezvous listed;
  listed.expected = 3;
  c.host(3).describe_rendezvous = &listed;
  const v1::ListEndpointsResponse ps = c.m(3).ListEndpoints();
  ASSERT_EQ(ps.endpoints_size(), 3);
  for (const v1::EndpointSummary& e : ps.endpoints())
    EXPECT_FALSE(e.mapping().virtual_gid().empty()) << "process " << e.pid() << " not described";
  {
    absl::MutexLock lock(&listed.mu);
    EXPECT_TRUE(listed.all_met) << "ps described the shims one after the other";
  }

  Rendezvous quiesced;  // the move's peer on host3 is found among three
  quiesced.expected = 3;
  c.host(3).describe_rendezvous = &quiesced;
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  ExpectRepointedToH2(c.host(3).Get(300));
  absl::MutexLock lock(&quiesced.mu);
  EXPECT_TRUE(quiesced.all_met) << "the peers' host described its shims one after the other";
}

// A UD sender names no peer in any QP: the hosts its address handles
// point at are its peers' too. Its receiver on host3 is paused for the
// move and learns where the sender went (before, host3 was never asked,
// and the receiver named the moved sender by its new physical identities).
TEST(MigratorTest, TheHostsAUdSendersAddressHandlesPointAtLearnWhereItWent) {
  Cluster c("udpeer");
  FakeEndpoint& sender = c.host(1).Add(100, VGid(1), {FakeQp{11, 4, "", 0, ""}});
  sender.ud_peer_pgids = {Gid(3)};
  c.host(3).Add(300, VGid(3), {FakeQp{31, 4, "", 0, ""}});
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  ExpectRepointedToH2(c.host(3).Get(300));  // the receiver
}

TEST(MigratorTest, AHostWhoseMigratorRestartsAfterTheMoveIsAskedAgain) {
  for (int down : {3, 2}) {  // the peer's host; the destination
    SCOPED_TRACE(down);
    Cluster c(absl::StrCat("restart", down));
    Topology(c);
    int restarts = 0;
    MoveRun run = MigrateWatched(c, 100, "h2", [&](const v1::Progress& p) {
      if (p.phase() == "reconnect" && p.detail().empty()) c.Stop(down);
      if (absl::StrContains(p.detail(), "does not answer") && restarts++ == 0) c.Start(down);
    });
    ASSERT_TRUE(run.status.ok()) << run.status;
    EXPECT_TRUE(run.report.ok()) << run.report.error();
    EXPECT_EQ(restarts, 1);
    FakeEndpoint moved = c.host(2).Get(100);
    EXPECT_TRUE(moved.alive && moved.connected && !moved.paused);
    FakeEndpoint peer = c.host(3).Get(300);
    ASSERT_EQ(peer.reconnected_to.size(), 1u);
    EXPECT_EQ(peer.reconnected_to[0].physical_gid(), Gid(2));
    EXPECT_FALSE(peer.paused);
    EXPECT_FALSE(c.host(1).Exists(100));
  }
}

TEST(MigratorTest, AHostThatStaysDownAfterTheMoveIsReportedAfterTheWait) {
  Cluster c("staysdown");
  Topology(c);
  const absl::Time start = absl::Now();
  MoveRun run = MigrateWatched(c, 100, "h2", [&](const v1::Progress& p) {
    if (p.phase() == "reconnect" && p.detail().empty()) c.Stop(3);
  });
  EXPECT_GE(absl::Now() - start, absl::Seconds(3));
  EXPECT_FALSE(run.report.ok());
  EXPECT_FALSE(run.report.rolled_back()) << "the endpoint runs on h2";
  EXPECT_THAT(run.report.error(), HasSubstr("reconnecting the peers on h3"));
  EXPECT_THAT(run.report.error(), HasSubstr("times over"));
  FakeEndpoint moved = c.host(2).Get(100);
  EXPECT_TRUE(moved.alive && !moved.paused);
  EXPECT_FALSE(c.host(1).Exists(100));
}

TEST(MigratorTest, PreCopyIteratesWhileDumpsStayLargeAndShrink) {
  Cluster c("precopy");
  Topology(c);
  // Over precopy_small_bytes every time, each smaller than the last.
  c.host(1).predump_sizes = {32 << 20, 16 << 20, 8 << 20};
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.report.precopy_iterations(), 3u);
  ASSERT_EQ(run.report.precopy_bytes_size(), 3);
  for (uint64_t n : run.report.precopy_bytes()) EXPECT_GE(n, 8u << 20);
  EXPECT_EQ(c.host(1).predumps, 3);
  EXPECT_EQ(c.host(2).restores, 1);  // found its parents at pre-1..3
}

// A process that dirties memory as fast as a round carries it never
// converges: another round would send as much again and leave the final
// dump no smaller. Two rounds in a row that did not shrink say so.
TEST(MigratorTest, PreCopyStopsWhenTwoRoundsInARowNoLongerShrink) {
  Cluster c("precopy-flat");
  Topology(c);
  c.host(1).predump_sizes = {32 << 20, 30 << 20, 29 << 20, 28 << 20};
  MoveRun run = Migrate(c, 100, "h2", {}, 1, /*max_precopy=*/8);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.report.precopy_iterations(), 3u);
  EXPECT_EQ(c.host(1).predumps, 3);
  EXPECT_EQ(c.host(2).restores, 1);
}

// One slow round (the host busy for a while) lets the process dirty as
// much as the round carried; the next one shrinks again and pre-copy goes
// on (found in the lab: 274 MiB, then 258 MiB, once the link was shared).
TEST(MigratorTest, PreCopyGoesOnAfterOneRoundThatDidNotShrink) {
  Cluster c("precopy-slow-round");
  Topology(c);
  c.host(1).predump_sizes = {32 << 20, 31 << 20, 16 << 20, 8 << 20, 1 << 20};
  MoveRun run = Migrate(c, 100, "h2", {}, 1, /*max_precopy=*/8);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.report.precopy_iterations(), 5u) << "the last one is under 4 MiB";
  EXPECT_EQ(c.host(1).predumps, 5);
}

TEST(MigratorTest, UnreachableDestinationTouchesNothing) {
  Cluster c("unreachable");
  Topology(c);
  MoveRun run = Migrate(c, 100, "10.77.0.9");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kUnavailable) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("unreachable"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(1).Get(200).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
  EXPECT_EQ(c.host(1).predumps, 0);
  EXPECT_FALSE(run.report.ok());
}

TEST(MigratorTest, DestinationWithoutRdmaOrCriuIsRefused) {
  Cluster c("norc");
  Topology(c);
  c[2].rdma = false;
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("no RDMA device"));
  c[2].rdma = true;
  c.host(2).check_error = absl::FailedPreconditionError("vdso");
  c.Stop(2);
  c.Start(2);  // CRIU's verdict is cached per run
  run = Migrate(c, 100, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("CRIU does not work"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
}

TEST(MigratorTest, RefusesProcessesNotUnderTheShim) {
  Cluster c("noshim");
  c.host(1).AddPlainProcess(555);
  MoveRun run = Migrate(c, 555, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("process 555 is not under the rdmavirt shim"));
  run = Migrate(c, 556, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kNotFound);
  run = Migrate(c, 555, "bad host!");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
}

MoveRun MigrateContainer(Cluster& c, const std::string& name, const std::string& to) {
  MoveRun run;
  v1::MigrateRequest req;
  req.set_container(name);
  req.set_destination(to);
  run.status = c.m(1).Migrate(req, [&](const v1::Progress& p) {
    if (p.has_report()) run.report = p.report();
  });
  return run;
}

// A container moves whole: its runtime checkpoints it on the source and
// restores it, with its name, on the destination; its endpoint is
// released before and restored after, its peers re-pointed, and the
// source's copy removed.
TEST(ContainerMoveTest, AContainerMovesWholeByItsRuntimeAndItsSourceCopyIsRemoved) {
  Cluster c("container");
  Topology(c);
  c.containers(1).Run("app", 100);
  MoveRun run = MigrateContainer(c, "app", "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_EQ(run.report.container(), "app");
  EXPECT_THAT(c.containers(1).Events(), ElementsAre("checkpoint app", "remove app"));
  EXPECT_THAT(c.containers(2).Events(), ElementsAre("restore app"));
  EXPECT_FALSE(c.containers(1).Has("app"));
  EXPECT_TRUE(c.containers(2).Has("app"));
  EXPECT_EQ(c.host(1).predumps, 0);  // no pre-copy for a container
  EXPECT_THAT(Commands(c.host(1).Get(100).log), Contains("release"));
  EXPECT_TRUE(c.host(2).Get(100).alive);
  EXPECT_FALSE(c.host(2).Get(100).paused);
  EXPECT_FALSE(c.host(3).Get(300).paused);
  EXPECT_EQ(c.host(3).Get(300).reconnected_to.size(), 1u);
}

// What cannot move is refused before anything is quiesced, naming it: a
// runtime without CRIU on the source; on the destination, no image, or a
// container of that name already.
TEST(ContainerMoveTest, WhatCannotMoveIsRefusedBeforeAnythingIsQuiesced) {
  Cluster c("container-refused");
  Topology(c);
  c.containers(1).Run("crunny", 100, "crun");
  MoveRun run = MigrateContainer(c, "crunny", "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("crun"));
  c.containers(1).Run("app", 100);
  c.containers(2).images.clear();
  run = MigrateContainer(c, "app", "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("has no image"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  c.containers(2).images = {"img1"};
  c.containers(2).Run("app", 999);
  run = MigrateContainer(c, "app", "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kAlreadyExists) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("a container named app"));
  ASSERT_TRUE(c.containers(2).Remove("app").ok());
  c.containers(1).Run("app", 100, "runc", {"/nonexistent/rdmavirt-test"});
  run = MigrateContainer(c, "app", "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("has no /nonexistent/rdmavirt-test, which container app is given"));
  run = MigrateContainer(c, "nosuch", "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kNotFound) << run.status;
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
  EXPECT_TRUE(c.containers(1).Events().empty());
}

// A restore that fails on the destination rolls the container back on
// its source: continued there, its endpoint back, nothing left behind.
TEST(ContainerMoveTest, AFailedRestoreRollsTheContainerBackOnItsSource) {
  Cluster c("container-rollback");
  Topology(c);
  c.containers(1).Run("app", 100);
  c.containers(2).restore_error = absl::InternalError("runc: restore failed");
  MoveRun run = MigrateContainer(c, "app", "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  EXPECT_TRUE(c.containers(1).Has("app"));
  EXPECT_FALSE(c.containers(2).Has("app"));
  EXPECT_THAT(c.containers(1).Events(), ElementsAre("checkpoint app"));
  EXPECT_THAT(c.host(1).Events(), Contains("continue 100"));
  EXPECT_TRUE(c.host(1).Get(100).alive);
  EXPECT_FALSE(c.host(1).Get(100).paused);
  EXPECT_FALSE(c.host(3).Get(300).paused);
}

// Checkpointed (and removed), then restored on another host from the
// directory, under its name.
TEST(ContainerMoveTest, ACheckpointedContainerIsRemovedAndRestoredElsewhereByItsName) {
  Cluster c("container-ckpt");
  Topology(c);
  c.containers(1).Run("app", 100);
  const std::string dir = TempDir("container-ckpt-dir") + "/cp";
  v1::CheckpointRequest req;
  req.set_container("app");
  req.set_dir(dir);
  ASSERT_TRUE(c.m(1).Checkpoint(req, nullptr).ok());
  EXPECT_FALSE(c.containers(1).Has("app"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + kContainerExport));
  absl::StatusOr<v1::Manifest> manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->container().name(), "app");
  v1::RestoreRequest rr;
  rr.set_dir(dir);
  rr.set_on("h2");
  const absl::Status st = c.m(1).Restore(rr, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(c.containers(2).Has("app"));
  EXPECT_THAT(c.containers(2).Events(), ElementsAre("restore app"));
  EXPECT_TRUE(c.host(2).Get(100).alive);
  EXPECT_FALSE(c.host(3).Get(300).paused);
}

// ps names the container each endpoint runs in; a process in none has "".
TEST(ContainerMoveTest, EndpointsAreListedWithTheirContainer) {
  Cluster c("container-ps");
  Topology(c);
  c.containers(1).Run("app", 100);
  std::map<int, std::string> listed;
  const v1::ListEndpointsResponse list = c.m(1).ListEndpoints();
  for (const v1::EndpointSummary& e : list.endpoints()) listed[e.pid()] = e.container();
  EXPECT_EQ(listed[100], "app");
  EXPECT_EQ(listed[200], "");
}

// Post-copy: the final dump serves its pages from the source, whose
// address the destination's restore is given; the move ends once they have
// all gone, and only then is the source's copy killed.
TEST(MigratorTest, APostcopyMoveRestoresWithThePagesOfTheSourcesPageServer) {
  Cluster c("postcopy");
  Topology(c);
  MoveRun run = Migrate(c, 100, "h2", {}, 1, 0, /*postcopy=*/true);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_TRUE(run.report.postcopy());
  const std::vector<std::string> src = c.host(1).Events();
  auto serve = std::find_if(src.begin(), src.end(), [](const std::string& e) {
    return absl::StartsWith(e, "serve pages on 10.0.0.1:");
  });
  ASSERT_NE(serve, src.end()) << absl::StrJoin(src, ", ");
  const std::string port = serve->substr(serve->rfind(':') + 1);
  EXPECT_THAT(c.host(2).Events(), Contains(absl::StrCat("restore lazy from 10.0.0.1:", port)));
  EXPECT_EQ(src.back(), "kill 100");
  EXPECT_THAT(src, Not(Contains(HasSubstr("cancel pages"))));
  EXPECT_THAT(run.phases, Contains("postcopy"));
  EXPECT_FALSE(c.host(1).Exists(100));
  EXPECT_TRUE(c.host(2).Get(100).alive);
}

// A post-copy move that fails before the destination restored anything
// ends the source's page server and rolls back as any move; one whose
// pages do not all reach the destination after the restore says the
// process is lost.
TEST(MigratorTest, APostcopyMoveRollsBackBeforeTheRestoreAndSaysSoAfter) {
  {
    Cluster c("postcopy-back");
    Topology(c);
    c.host(2).restore_error = absl::InternalError("restore failed");
    MoveRun run = Migrate(c, 100, "h2", {}, 1, 0, /*postcopy=*/true);
    EXPECT_FALSE(run.status.ok());
    EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
    EXPECT_THAT(c.host(1).Events(), Contains(HasSubstr("cancel pages on 10.0.0.1:")));
    EXPECT_TRUE(c.host(1).Get(100).alive);
  }
  Cluster c("postcopy-lost");
  Topology(c);
  c.host(1).lazy_serve_error = absl::UnavailableError("page server: connection reset");
  MoveRun run = Migrate(c, 100, "h2", {}, 1, 0, /*postcopy=*/true);
  // As any failure past the restore: in the report, not undone.
  EXPECT_FALSE(run.report.ok());
  EXPECT_FALSE(run.report.rolled_back());
  EXPECT_THAT(run.report.error(), HasSubstr("post-copy: the process is lost"));
  EXPECT_THAT(run.report.error(), HasSubstr("connection reset"));
}

// CRIU killed during the destination's restore leaves the processes it
// had made there (the chaos soak found P's copy on the destination of a
// move that rolled back): those of the tree's pids that name a process
// now and did not before the restore are killed, and the move rolls back
// with one copy.
TEST(MigratorTest, ARestoreThatFailsPartWayLeavesNoProcessBehind) {
  Cluster c("restore-left");
  Topology(c);
  c.host(2).restore_error =
      absl::InternalError("lost criu swrk (it could not start or it crashed)");
  c.host(2).failed_restore_leaves_process = true;
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  EXPECT_FALSE(c.host(2).Exists(100));
  EXPECT_THAT(c.host(2).Events(), Contains("kill 100"));
  EXPECT_TRUE(c.host(1).Get(100).alive);
}

// A process that held the pid before the restore is not the restore's:
// left alone when the restore fails.
TEST(MigratorTest, AFailedRestoreLeavesAloneWhatHeldTheTreesPidBefore) {
  Cluster c("restore-held");
  Topology(c);
  c.host(2).AddPlainProcess(100);
  c.host(2).restore_error = absl::AlreadyExistsError("a pid of the dumped tree is in use");
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  EXPECT_TRUE(c.host(2).Exists(100));
  EXPECT_THAT(c.host(2).Events(), Not(Contains("kill 100")));
}

// A move of 100 from h1 to h2 held in its restore (stall_restore) until
// the test lets it go, on `*mover`, its outcome in `*run`; false (the
// restore let go, the move joined) if it ended before its restore.
bool MoveHeldInRestore(Cluster& c, MoveRun* run, std::thread* mover) {
  c.host(2).stall_restore = true;
  *mover = std::thread([&c, run] { *run = Migrate(c, 100, "h2"); });
  for (absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(1)))
    if (c.host(2).restores_started.load() > 0) return true;
  c.host(2).stall_restore = false;
  mover->join();
  return false;
}

// A second move of a process in the middle of its move (two operators,
// a drain racing a move) is refused before it touches anything, and the
// first one ends as if alone.
TEST(MigratorTest, ASecondMoveOfAProcessInTheMiddleOfItsMoveIsRefused) {
  Cluster c("second-move");
  Topology(c);
  MoveRun first;
  std::thread mover;
  ASSERT_TRUE(MoveHeldInRestore(c, &first, &mover))
      << "the move never reached the restore: " << first.status;
  const std::vector<std::string> before = c.host(1).Events();
  MoveRun second = Migrate(c, 100, "h3");
  EXPECT_EQ(second.status.code(), absl::StatusCode::kFailedPrecondition) << second.status;
  EXPECT_THAT(second.status.message(), HasSubstr("process 100 is already moving"));
  EXPECT_EQ(c.host(1).Events(), before);  // nothing stopped, dumped or continued again
  c.host(2).stall_restore = false;
  mover.join();
  EXPECT_TRUE(first.status.ok()) << first.status;
  EXPECT_TRUE(c.host(2).Get(100).alive);
  EXPECT_FALSE(c.host(1).Exists(100));
  EXPECT_FALSE(c.host(3).Exists(100));
}

// A terminal other than a pseudo-terminal (/dev/tty held open, a serial
// line), or a second pseudo-terminal, is refused before anything is
// quiesced; without it the same process moves.
TEST(MigratorTest, RefusesATerminalCriuCannotGiveBackBeforeQuiescingAnything) {
  for (const char* held : {"/dev/pts/3,/dev/tty", "/dev/ttyS0", "/dev/pts/3,/dev/pts/5"}) {
    SCOPED_TRACE(held);
    Cluster c("tty");
    Topology(c);
    c.host(1).SetTerminal(100, held);
    MoveRun run = Migrate(c, 100, "h2");
    EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
    EXPECT_THAT(
        std::string(run.status.message()),
        HasSubstr(absl::StrCat("process 100 holds the terminal ",
                               absl::StrContains(held, ",") ? strchr(held, ',') + 1 : held)));
    EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
    EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
    EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
    EXPECT_EQ(c.host(1).predumps, 0);
    EXPECT_EQ(c.host(1).dumps, 0);
    c.host(1).SetTerminal(100, "");
    run = Migrate(c, 100, "h2");
    EXPECT_TRUE(run.status.ok()) << run.status;
  }
}

// An RDMA device file that the release does not close (a MAD port, a
// verbs device or an RDMA CM channel a process outside the shim opened)
// is refused before anything is quiesced, naming who holds it, by a move
// and by a checkpoint: CRIU refused it only at the final dump, after the
// pre-copy and inside the blackout. An endpoint's own verbs device and
// RDMA CM channel (which its shim releases) move.
TEST(MigratorTest, RefusesADeviceFileTheReleaseDoesNotCloseBeforeQuiescingAnything) {
  struct Held {
    pid_t holder;
    const char* file;
    const char* said;
  };
  for (const Held& h : {Held{101, "/dev/infiniband/rdma_cm",
                             "process 101 (a descendant of process 100) holds "
                             "/dev/infiniband/rdma_cm, an RDMA CM channel (librdmacm) of a "
                             "process not under the rdmavirt shim"},
                        Held{100, "/dev/infiniband/umad0",
                             "process 100 holds /dev/infiniband/umad0, a device CRIU cannot dump"},
                        Held{101, "/dev/fuse (10:229)",
                             "process 101 (a descendant of process 100) holds /dev/fuse "
                             "(10:229), a device CRIU cannot dump"},
                        Held{101, "/dev/infiniband/uverbs0",
                             "process 101 (a descendant of process 100) holds "
                             "/dev/infiniband/uverbs0, an RDMA device of a process this step "
                             "does not release"}}) {
    SCOPED_TRACE(h.file);
    Cluster c("rdmafile");
    Topology(c);
    c.host(1).AddPlainProcess(101);
    c.host(1).AddChild(100, 101);
    c.host(1).AddDeviceFile(100, "/dev/infiniband/uverbs0");
    c.host(1).AddDeviceFile(h.holder, h.file);
    MoveRun run = Migrate(c, 100, "h2");
    EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
    EXPECT_THAT(std::string(run.status.message()), HasSubstr(h.said));
    EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
    EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
    EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
    EXPECT_EQ(c.host(1).predumps, 0);
    EXPECT_EQ(c.host(1).dumps, 0);
    v1::CheckpointRequest req;
    req.set_pid(100);
    req.set_dir(TempDir("rdmafile-ckpt") + "/cp");
    const absl::Status st = c.m(1).Checkpoint(req, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(h.said));
    EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
    EXPECT_EQ(c.host(1).dumps, 0);
  }
  // Only the endpoint's own verbs device and RDMA CM channel: it moves.
  Cluster c("rdmafile-ok");
  Topology(c);
  c.host(1).AddDeviceFile(100, "/dev/infiniband/uverbs0");
  c.host(1).AddDeviceFile(100, "/dev/infiniband/rdma_cm");
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_TRUE(run.status.ok()) << run.status;
}

// A pseudo-terminal whose master side stays behind (a shell's, an ssh
// session's) is replaced: the destination restores the process with a new
// one, and so does a restore from a checkpoint of it; a process without
// one is restored without.
TEST(MigratorTest, AProcessWithAPseudoTerminalIsRestoredWithANewOne) {
  Cluster c("newtty");
  Topology(c);
  c.host(1).SetTerminal(100, "/dev/pts/3");
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_THAT(c.host(2).Events(), Contains("restore terminal"));
  c.host(2).SetTerminal(100, "/dev/pts/0");
  const std::string dir = TempDir("newtty-dir") + "/cp";
  v1::CheckpointRequest req;
  req.set_pid(100);
  req.set_dir(dir);
  ASSERT_TRUE(c.m(2).Checkpoint(req, nullptr).ok());
  absl::StatusOr<v1::Manifest> manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->terminal(), "/dev/pts/0");
  v1::RestoreRequest rr;
  rr.set_dir(dir);
  ASSERT_TRUE(c.m(2).Restore(rr, nullptr).ok());
  EXPECT_EQ(c.host(2).Events().back(), "continue 100");
  EXPECT_THAT(c.host(2).Events(), Contains("restore terminal").Times(2));
  // Without one: a plain restore.
  run = Migrate(c, 200, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_THAT(c.host(2).Events(), Contains("restore"));
}

// Two peers moved at once toward each other (P h1 -> h2, Q h3 -> h1): one
// is quiesced with its peers at a time; a move that meets the other is
// refused (ABORTED) and rolled back with nothing of it quiesced, and once
// tried again both end up pointing at where the other went.
TEST(MigratorTest, TwoPeersMovingAtOnceMeetOneAtATime) {
  for (int round = 0; round < 5; ++round) {
    Cluster c(absl::StrCat("meet", round));
    c.host(1).Add(100, VGid(1), {FakeQp{11, 2, VGid(3), 31, Gid(3)}});
    c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
    MoveRun p, q;
    std::thread tp([&] { p = Migrate(c, 100, "h2", {}, 1); });
    std::thread tq([&] { q = Migrate(c, 300, "h1", {}, 3); });
    tp.join();
    tq.join();
    for (MoveRun* run : {&p, &q}) {
      if (run->status.ok()) {
        EXPECT_TRUE(run->report.ok()) << run->report.error();
        continue;
      }
      EXPECT_EQ(run->status.code(), absl::StatusCode::kAborted) << run->status;
      EXPECT_THAT(std::string(run->status.message()), HasSubstr("try again when"));
      EXPECT_TRUE(run->report.rolled_back()) << run->report.error();
    }
    // Whichever was refused goes now, from where it still is.
    if (!p.status.ok()) p = Migrate(c, 100, "h2", {}, 1);
    if (!q.status.ok()) q = Migrate(c, 300, "h1", {}, 3);
    ASSERT_TRUE(p.status.ok() && p.report.ok()) << p.status << " " << p.report.error();
    ASSERT_TRUE(q.status.ok() && q.report.ok()) << q.status << " " << q.report.error();
    FakeEndpoint pe = c.host(2).Get(100);
    FakeEndpoint qe = c.host(1).Get(300);
    ASSERT_EQ(pe.pid, 100);
    ASSERT_EQ(qe.pid, 300);
    EXPECT_TRUE(pe.alive && pe.connected && !pe.paused && !pe.released);
    EXPECT_TRUE(qe.alive && qe.connected && !qe.paused && !qe.released);
    EXPECT_FALSE(c.host(1).Exists(100));
    EXPECT_FALSE(c.host(3).Exists(300));
    ASSERT_EQ(pe.qps.size(), 1u);
    ASSERT_EQ(qe.qps.size(), 1u);
    EXPECT_EQ(pe.qps[0].remote_pgid, Gid(1)) << "P does not point at Q on h1";
    EXPECT_EQ(qe.qps[0].remote_pgid, Gid(2)) << "Q does not point at P on h2";
  }
}

// Two moves of different processes that share a peer (A on h1 and B on h2,
// each connected to X on h3), started at once: X is paused by one move at a
// time. The second waits, with nothing of its own quiesced, and goes once
// the first has re-pointed and resumed X. Before, both paused X, the
// first's re-point resumed it, and the second's re-point found it running
// ("peer reconnect needs a paused endpoint"): its move failed after the
// endpoint had moved, and X was left pointing at where B had been.
TEST(MigratorTest, TwoMovesSharingAPeerPauseItOneAtATimeAndBothGo) {
  for (int round = 0; round < 5; ++round) {
    Cluster c(absl::StrCat("sharedpeer", round));
    c.host(1).Add(100, VGid(1), {FakeQp{11, 2, VGid(3), 31, Gid(3)}});
    c.host(2).Add(200, VGid(2), {FakeQp{21, 2, VGid(3), 32, Gid(3)}});
    c.host(3).Add(300, VGid(3),
                  {FakeQp{31, 2, VGid(1), 11, Gid(1)}, FakeQp{32, 2, VGid(2), 21, Gid(2)}});
    MoveRun a, b;
    std::thread ta([&] { a = Migrate(c, 100, "h2", {}, 1); });
    std::thread tb([&] { b = Migrate(c, 200, "h1", {}, 2); });
    ta.join();
    tb.join();
    ASSERT_TRUE(a.status.ok() && a.report.ok()) << a.status << " " << a.report.error();
    ASSERT_TRUE(b.status.ok() && b.report.ok()) << b.status << " " << b.report.error();
    FakeEndpoint x = c.host(3).Get(300);
    EXPECT_TRUE(x.alive && x.connected && !x.paused && !x.released);
    ASSERT_EQ(x.qps.size(), 2u);
    EXPECT_EQ(x.qps[0].remote_pgid, Gid(2)) << "X does not point at A on h2";
    EXPECT_EQ(x.qps[1].remote_pgid, Gid(1)) << "X does not point at B on h1";
    EXPECT_TRUE(c.host(2).Get(100).alive);
    EXPECT_TRUE(c.host(1).Get(200).alive);
    EXPECT_FALSE(c.host(1).Exists(100));
    EXPECT_FALSE(c.host(2).Exists(200));
  }
}

// Three moves at once (A h1 -> h2, B h2 -> h3, C h3 -> h1) whose endpoints
// share peers, one on each host, each connected to the movers of the other
// two hosts: every peer is paused by two moves, as endpoints with UD QPs
// are by every move. The younger yields to the older, the older waits: all
// three go, none refused, and each peer ends pointing at where each went.
TEST(MigratorTest, ThreeMovesSharingPeersOnEveryHostAllGo) {
  for (int round = 0; round < 3; ++round) {
    Cluster c(absl::StrCat("sharedpeers", round));
    const int movers[] = {100, 200, 300};  // on h1, h2, h3
    const int peers[] = {101, 201, 301};
    for (int h = 1; h <= 3; ++h) {
      std::vector<FakeQp> to_peers, to_movers;
      for (int k = 1; k <= 3; ++k) {
        if (k == h) continue;  // a peer on its own host shares its virtual GID
        to_peers.push_back(
            FakeQp{uint32_t(10 * h + k), 2, VGid(k), uint32_t(50 + 10 * k + h), Gid(k)});
        to_movers.push_back(
            FakeQp{uint32_t(50 + 10 * h + k), 2, VGid(k), uint32_t(10 * k + h), Gid(k)});
      }
      c.host(h).Add(movers[h - 1], VGid(h), to_peers);
      c.host(h).Add(peers[h - 1], VGid(h), to_movers);
    }
    MoveRun run[3];
    std::vector<std::thread> threads;
    for (int h = 1; h <= 3; ++h)
      threads.emplace_back(
          [&, h] { run[h - 1] = Migrate(c, movers[h - 1], absl::StrCat("h", h % 3 + 1), {}, h); });
    for (std::thread& t : threads) t.join();
    for (int h = 1; h <= 3; ++h)
      ASSERT_TRUE(run[h - 1].status.ok() && run[h - 1].report.ok())
          << "round " << round << ", the move from h" << h << ": " << run[h - 1].status << " "
          << run[h - 1].report.error();
    for (int h = 1; h <= 3; ++h) {
      EXPECT_TRUE(c.host(h % 3 + 1).Get(movers[h - 1]).alive);
      EXPECT_FALSE(c.host(h).Exists(movers[h - 1]));
      FakeEndpoint x = c.host(h).Get(peers[h - 1]);
      EXPECT_TRUE(x.alive && x.connected && !x.paused && !x.released);
      ASSERT_EQ(x.qps.size(), 2u);
      for (const FakeQp& q : x.qps) {
        const int k = q.remote_vgid == VGid(1) ? 1 : q.remote_vgid == VGid(2) ? 2 : 3;
        EXPECT_EQ(q.remote_pgid, Gid(k % 3 + 1))
            << "the peer on h" << h << " does not point at where the mover of h" << k << " went";
      }
    }
  }
}

// A move that met another lets go of the peers it paused after each
// attempt: each let-go resumes them, not only the first. The second was
// the answer to the first repeated (ReconnectPeers keeps the answers of
// requests asked again), and its peers stayed paused and held by the move:
// older moves waiting for them waited until their limit (in the lab, no
// move went for five minutes).
TEST(MigratorTest, EachLetGoOfAMovesPeersResumesThem) {
  Cluster c("letgo");
  c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
  for (uint32_t attempt = 1; attempt <= 3; ++attempt) {
    v1::QuiescePeersRequest q;
    q.set_migration_id("20261207-120000-aaaaaa");
    q.set_virtual_gid(VGid(1));
    q.add_virtual_qpns(11);
    absl::StatusOr<v1::QuiescePeersResponse> paused = c.m(3).QuiescePeers(q);
    ASSERT_TRUE(paused.ok()) << paused.status();
    ASSERT_EQ(paused->pids_size(), 1);
    ASSERT_TRUE(c.host(3).Get(300).paused) << "attempt " << attempt;
    v1::ReconnectPeersRequest r;
    r.set_migration_id(q.migration_id());
    r.mutable_mapping()->set_virtual_gid(VGid(1));
    r.set_resume_only(true);
    r.set_quiesce_attempt(attempt);
    absl::StatusOr<v1::ReconnectPeersResponse> resumed = c.m(3).ReconnectPeers(r);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    EXPECT_FALSE(c.host(3).Get(300).paused) << "still paused after let-go " << attempt;
  }
}

TEST(MigratorTest, ASourceCopyThatWillNotDieIsReportedNotHidden) {
  Cluster c("unkillable");
  Topology(c);
  c.host(1).kill_error = absl::DeadlineExceededError("process 100 did not die");
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_FALSE(run.report.ok());
  EXPECT_FALSE(run.report.rolled_back());
  EXPECT_THAT(run.report.error(), HasSubstr("the endpoint moved, but: the stopped source copy "
                                            "(pid 100) could not be killed and stays stopped"));
  // Tried three times; the endpoint runs on h2 all the same.
  int kills = 0;
  for (const std::string& ev : c.host(1).Events()) kills += ev == "kill 100";
  EXPECT_EQ(kills, 3);
  FakeEndpoint moved = c.host(2).Get(100);
  EXPECT_TRUE(moved.alive && moved.connected && !moved.paused);
}

TEST(MigratorTest, AFailedRecordWriteRefusesTheMoveBeforeAnythingIsQuiesced) {
  Cluster c("norecord");
  Topology(c);
  // The state directory's migrations/ is a file: no record can be written.
  const std::string migrations = c[1].state_dir + "/migrations";
  std::filesystem::remove_all(migrations);
  { std::ofstream(migrations) << "not a directory"; }
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("cannot write the migration record that crash recovery reads"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
  EXPECT_EQ(c.host(1).predumps, 0);
  EXPECT_EQ(c.host(1).dumps, 0);
}

// The destination's record is what its crash recovery reads: a destination
// that cannot write it says no before anything is quiesced.
TEST(MigratorTest, ADestinationThatCannotWriteItsRecordRefusesTheMove) {
  Cluster c("norecord-dst");
  Topology(c);
  const std::string incoming = c[2].state_dir + "/incoming";
  std::filesystem::remove_all(incoming);
  { std::ofstream(incoming) << "not a directory"; }
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("cannot write the incoming record that crash recovery reads"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
  EXPECT_FALSE(c.host(2).Exists(100));
}

// After a failure, the endpoint runs on h1 again, restored on its HCA, and
// every peer points at it.
void ExpectRolledBack(Cluster& c, const MoveRun& run, bool restored) {
  EXPECT_FALSE(run.status.ok());
  EXPECT_FALSE(run.report.ok());
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && !e.stopped && e.connected && !e.released && !e.paused);
  for (auto [host, pid] : {std::pair{1, 200}, std::pair{3, 300}}) {
    FakeEndpoint p = c.host(host).Get(pid);
    EXPECT_FALSE(p.paused) << pid;
    if (restored) {
      ASSERT_EQ(p.reconnected_to.size(), 1u) << pid;
      EXPECT_EQ(p.reconnected_to[0].physical_gid(), Gid(1));
    } else {
      EXPECT_TRUE(p.reconnected_to.empty()) << pid;
      EXPECT_THAT(p.log, Contains("resume")) << pid;
    }
  }
  // Nothing stays on the destination.
  FakeEndpoint d = c.host(2).Get(100);
  EXPECT_FALSE(d.pid != 0 && d.alive);
  auto incoming = ListRecords(c[2].state_dir + "/incoming");
  for (const auto& [dir, rec] : incoming) {
    EXPECT_TRUE(rec.done());
    EXPECT_FALSE(std::filesystem::exists(dir + "/final"));
  }
}

TEST(MigratorTest, RestoreFailureOnDestinationRollsBack) {
  Cluster c("restorefail");
  Topology(c);
  c.host(2).restore_error = absl::InternalError("criu restore blew up");
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_THAT(run.phases, Contains("rollback"));
  EXPECT_THAT(run.report.error(), HasSubstr("criu restore blew up"));
  ExpectRolledBack(c, run, /*restored=*/true);
  EXPECT_THAT(Commands(c.host(1).Get(100).log),
              ElementsAre("quiesce", "release", "restore", "resume"));
}

TEST(MigratorTest, DestinationShimFailureKillsTheRestoredProcess) {
  Cluster c("destshim");
  Topology(c);
  // The restored process comes up but its shim cannot restore.
  c.host(2).Fail(100, "restore", absl::StatusCode::kResourceExhausted);
  // (Fail() created a placeholder endpoint; CRIU's restore replaces it.)
  ASSERT_TRUE(c.host(2).Kill(100).ok());
  MoveRun run = Migrate(c, 100, "h2");
  ExpectRolledBack(c, run, true);
  EXPECT_EQ(c.host(2).restores, 1);
}

// An MPI job's local tree: orted (500) and its ranks 501 and 502 (under
// the shim), orted connected to mpirun from the service address
// 10.0.0.102; and a shimmed process of no job (100), whose TCP connection
// is on the host's own address. The listing names each rank's job tree
// and the addresses it takes along; 100 has none.
TEST(MigratorTest, TheListingNamesEachRanksJobTreeAndItsServiceAddresses) {
  Cluster c("job-tree");
  FakeHost& h = c.host(1);
  h.AddPlainProcess(500);
  h.SetProgram(500, "orted");
  for (pid_t rank : {501, 502}) {
    h.Add(rank, VGid(1), {FakeQp{static_cast<uint32_t>(rank), 2, "", 0, ""}});
    h.SetProgram(rank, "mpi_verify");
    h.AddChild(500, rank);
  }
  h.HoldAddress("eth0", "10.0.0.102/24");
  h.SetTcpAddress(500, "10.0.0.102/24");
  h.SetTcpAddress(501, "10.0.0.1/24");
  h.Add(100, VGid(1), {FakeQp{11, 2, "", 0, ""}});
  h.SetTcpAddress(100, "10.0.0.1/24");

  const v1::ListEndpointsResponse ps = c.m(1).ListEndpoints();
  ASSERT_EQ(ps.endpoints_size(), 3);
  const v1::EndpointSummary& plain = ps.endpoints(0);
  EXPECT_EQ(plain.pid(), 100);
  EXPECT_EQ(plain.job_root_pid(), 0);
  EXPECT_THAT(plain.job_addresses(), IsEmpty());
  for (int i : {1, 2}) {
    const v1::EndpointSummary& rank = ps.endpoints(i);
    EXPECT_EQ(rank.job_root_pid(), 500) << rank.pid();
    EXPECT_EQ(rank.job_root_program(), "orted");
    EXPECT_THAT(rank.job_addresses(), ElementsAre("10.0.0.102/24"));
  }
}

TEST(MigratorTest, AServiceAddressAndItsTcpConnectionsMoveWithTheProcess) {
  Cluster c("svcaddr");
  Topology(c);
  c.host(1).HoldAddress("eth0", "10.0.0.50/24");
  c.host(1).SetTcpAddress(100, "10.0.0.50/24");
  MoveRun run = Migrate(c, 100, "h2", {"10.0.0.50"});
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  // The source gave it up once the process was stopped, before the dump;
  // the destination took it (on its interface on that subnet) before the
  // restore. The prefix is the one the source had.
  EXPECT_THAT(c.host(1).Events(),
              ElementsAre("stop 100", "remove 10.0.0.50/24@eth0", "dump 100 tcp", "kill 100"));
  EXPECT_THAT(c.host(2).Events(),
              ElementsAre("add 10.0.0.50/24@eth0", "restore tcp", "continue 100"));
  EXPECT_THAT(c.host(1).Addresses(), ElementsAre("10.0.0.1/24@eth0"));
  EXPECT_THAT(c.host(2).Addresses(), ElementsAre("10.0.0.2/24@eth0", "10.0.0.50/24@eth0"));
  EXPECT_THAT(run.report.addresses(), ElementsAre("10.0.0.50/24"));
  EXPECT_EQ(c.host(2).Get(100).tcp_address, "10.0.0.50/24");
}

TEST(MigratorTest, WithoutItsServiceAddressAProcessWithTcpDoesNotMove) {
  Cluster c("svcaddr-none");
  Topology(c);
  c.host(1).HoldAddress("eth0", "10.0.0.50/24");
  c.host(1).SetTcpAddress(100, "10.0.0.50/24");
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_THAT(run.report.error(), HasSubstr("--tcp-established"));
  ExpectRolledBack(c, run, true);
  EXPECT_THAT(c.host(1).Addresses(), Contains("10.0.0.50/24@eth0"));
}

TEST(MigratorTest, AServiceAddressTheSourceDoesNotHoldIsRefusedBeforeAnything) {
  Cluster c("svcaddr-notheld");
  Topology(c);
  MoveRun run = Migrate(c, 100, "h2", {"10.0.0.60/24"});
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("10.0.0.60/24 is not on h1"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_EQ(c.host(1).predumps, 0);
}

TEST(MigratorTest, ADestinationOffTheServiceSubnetIsRefusedBeforeAnything) {
  Cluster c("svcaddr-subnet");
  Topology(c);
  c.host(1).HoldAddress("eth1", "192.168.7.5/24");
  MoveRun run = Migrate(c, 100, "h2", {"192.168.7.5/24"});
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("host h2 cannot take the service address 192.168.7.5/24"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
  EXPECT_THAT(c.host(1).Addresses(), Contains("192.168.7.5/24@eth1"));
  EXPECT_TRUE(c.host(1).Events().empty());
}

TEST(MigratorTest, BadServiceAddressesAreRefused) {
  Cluster c("svcaddr-bad");
  Topology(c);
  for (const char* bad : {"fe80::1/64", "10.0.0.300", "10.0.0.5/40", "127.0.0.1", "10.0.0.0/24"}) {
    MoveRun run = Migrate(c, 100, "h2", {bad});
    EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument) << bad << run.status;
  }
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
}

TEST(MigratorTest, ARollbackGivesTheServiceAddressBackToTheSource) {
  Cluster c("svcaddr-rollback");
  Topology(c);
  c.host(1).HoldAddress("eth0", "10.0.0.50/24");
  c.host(1).SetTcpAddress(100, "10.0.0.50/24");
  c.host(2).restore_error = absl::InternalError("criu restore blew up");
  MoveRun run = Migrate(c, 100, "h2", {"10.0.0.50/24"});
  ExpectRolledBack(c, run, true);
  // h2 took it for the restore and gave it up at the abort; h1 took it
  // back before the process continued.
  EXPECT_THAT(c.host(2).Events(),
              ElementsAre("add 10.0.0.50/24@eth0", "restore tcp", "remove 10.0.0.50/24@eth0"));
  EXPECT_THAT(c.host(1).Events(),
              ElementsAre("stop 100", "remove 10.0.0.50/24@eth0", "dump 100 tcp",
                          "add 10.0.0.50/24@eth0", "continue 100"));
  EXPECT_THAT(c.host(1).Addresses(), Contains("10.0.0.50/24@eth0"));
  EXPECT_THAT(c.host(2).Addresses(), ElementsAre("10.0.0.2/24@eth0"));
}

// A shell (not under the shim) and its child under the shim, moved by the
// shell's pid: the tree is stopped, dumped, restored and killed from the
// shell; the child's endpoint is what is quiesced, released and brought
// back. Before, the shell's pid was refused as not under the shim.
TEST(MigratorTest, AParentMovesWithItsChildUnderTheShim) {
  Cluster c("tree");
  Topology(c);
  c.host(1).AddPlainProcess(90);
  c.host(1).AddChild(90, 100);
  MoveRun run = Migrate(c, 90, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_EQ(run.report.pid(), 100);
  EXPECT_EQ(run.report.tree_root(), 90);
  EXPECT_THAT(c.host(1).Events(), ::testing::IsSupersetOf({"stop 90", "dump 90", "kill 90"}));
  // Both are gone from h1 and run on h2, the child's endpoint resumed.
  EXPECT_FALSE(c.host(1).Exists(90));
  EXPECT_FALSE(c.host(1).Exists(100));
  EXPECT_TRUE(c.host(2).Exists(90));
  EXPECT_THAT(c.host(2).Descendants(90), ElementsAre(100));
  FakeEndpoint moved = c.host(2).Get(100);
  EXPECT_TRUE(moved.alive && moved.connected && !moved.released && !moved.paused);
  EXPECT_THAT(Commands(moved.log), ElementsAre("restore", "resume"));
  for (auto [host, pid] : {std::pair{1, 200}, std::pair{3, 300}}) {
    FakeEndpoint p = c.host(host).Get(pid);
    ASSERT_EQ(p.reconnected_to.size(), 1u) << pid;
    EXPECT_EQ(p.reconnected_to[0].physical_gid(), Gid(2));
  }
}

TEST(MigratorTest, ATreeRolledBackContinuesFromItsRoot) {
  Cluster c("treeback");
  Topology(c);
  c.host(1).AddPlainProcess(90);
  c.host(1).AddChild(90, 100);
  c.host(2).restore_error = absl::InternalError("restore failed");
  MoveRun run = Migrate(c, 90, "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  EXPECT_THAT(c.host(1).Events(), ::testing::IsSupersetOf({"stop 90", "continue 90"}));
  FakeEndpoint back = c.host(1).Get(100);
  EXPECT_TRUE(back.alive && back.connected && !back.released && !back.paused);
  EXPECT_TRUE(c.host(1).Exists(90));
}

// A job script with two programs under the shim, each with a peer on h3:
// the tree moves as one; each endpoint has a move of its own around the
// tree's (quiesced, released, brought back on h2, its peer re-pointed).
void TwoProgramTree(Cluster& c) {
  c.host(1).AddPlainProcess(90);
  c.host(1).Add(100, VGid(1), {FakeQp{11, 2, VGid(3), 31, Gid(3)}});
  c.host(1).Add(105, VGid(4), {FakeQp{41, 2, VGid(5), 51, Gid(3)}});
  c.host(1).AddChild(90, 100);
  c.host(1).AddChild(90, 105);
  c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
  c.host(3).Add(305, VGid(5), {FakeQp{51, 2, VGid(4), 41, Gid(1)}});
}

TEST(MigratorTest, ATreeWithTwoProcessesUnderTheShimMovesAsOne) {
  Cluster c("tree2");
  TwoProgramTree(c);
  MoveRun run = Migrate(c, 90, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_EQ(run.report.pid(), 100);
  EXPECT_THAT(run.report.tree_endpoints(), ElementsAre(105));
  EXPECT_EQ(c.host(1).dumps, 1);
  for (pid_t p : {90, 100, 105}) {
    EXPECT_FALSE(c.host(1).Exists(p)) << p;
    EXPECT_TRUE(c.host(2).Exists(p)) << p;
  }
  for (pid_t p : {100, 105}) {
    FakeEndpoint moved = c.host(2).Get(p);
    EXPECT_TRUE(moved.alive && moved.connected && !moved.released && !moved.paused) << p;
    EXPECT_THAT(Commands(moved.log), ElementsAre("restore", "resume")) << p;
  }
  // Each peer re-pointed at its own endpoint, now on h2.
  for (auto [peer, vgid] : {std::pair{300, 1}, std::pair{305, 4}}) {
    FakeEndpoint p = c.host(3).Get(peer);
    EXPECT_THAT(Commands(p.log), ElementsAre("peer_quiesce", "peer_reconnect")) << peer;
    ASSERT_EQ(p.reconnected_to.size(), 1u) << peer;
    EXPECT_EQ(p.reconnected_to[0].virtual_gid(), VGid(vgid));
    EXPECT_EQ(p.reconnected_to[0].physical_gid(), Gid(2));
    EXPECT_FALSE(p.paused);
  }
  // Two records on the source, both done, the second naming the first.
  auto records = ListRecords(c[1].state_dir + "/migrations");
  ASSERT_EQ(records.size(), 2u);
  int members = 0;
  for (const auto& [dir, rec] : records) {
    EXPECT_TRUE(rec.done() && rec.report().ok()) << rec.report().error();
    if (!rec.tree_lead().empty()) {
      ++members;
      EXPECT_EQ(rec.tree_lead(), run.report.migration_id());
      EXPECT_EQ(rec.report().pid(), 105);
    }
  }
  EXPECT_EQ(members, 1);
}

TEST(MigratorTest, ATreeWhoseSecondEndpointCannotComeBackThereRollsBackWhole) {
  Cluster c("tree2back");
  TwoProgramTree(c);
  c.host(2).Fail(105, "restore", absl::StatusCode::kInternal);
  MoveRun run = Migrate(c, 90, "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  // All of it runs on h1 again, each endpoint back and resumed; nothing on h2.
  for (pid_t p : {100, 105}) {
    FakeEndpoint back = c.host(1).Get(p);
    EXPECT_TRUE(back.alive && back.connected && !back.released && !back.paused) << p;
    EXPECT_FALSE(c.host(2).Exists(p)) << p;
  }
  EXPECT_TRUE(c.host(1).Exists(90));
  EXPECT_FALSE(c.host(2).Exists(90));
  for (pid_t peer : {300, 305}) EXPECT_FALSE(c.host(3).Get(peer).paused) << peer;
}

// Two endpoints of the tree connected to each other (UCX connects the
// ranks of one host so): both quiesced before either is released, both
// restored, re-pointed at each other on the destination while paused (no
// lookup of peers finds them), their peer re-pointed once with both
// mappings, then all resumed. Before, the move was refused.
TEST(MigratorTest, ATreeWhoseEndpointsAreConnectedToEachOtherMovesAsOne) {
  Cluster c("tree2conn");
  Topology(c);  // 100 and 200 are connected; 100 and 300 too
  c.host(1).AddPlainProcess(90);
  c.host(1).AddChild(90, 100);
  c.host(1).AddChild(90, 200);
  MoveRun run = Migrate(c, 90, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_THAT(run.report.tree_endpoints(), ElementsAre(200));
  for (pid_t pid : {100, 200}) {
    EXPECT_FALSE(c.host(1).Exists(pid)) << pid;
    FakeEndpoint moved = c.host(2).Get(pid);
    EXPECT_TRUE(moved.alive && moved.connected && !moved.released && !moved.paused) << pid;
    EXPECT_THAT(Commands(moved.log), ElementsAre("restore", "peer_reconnect", "resume")) << pid;
    // Each points at where the other is now.
    for (const FakeQp& q : moved.qps) {
      if (q.remote_vgid == VGid(1) || q.remote_vgid == VGid(2)) {
        EXPECT_EQ(q.remote_pgid, Gid(2)) << pid << " qp " << q.virtual_qpn;
      }
    }
  }
  FakeEndpoint peer = c.host(3).Get(300);
  EXPECT_TRUE(!peer.paused && !peer.released);
  ASSERT_EQ(peer.reconnected_to.size(), 2u) << "one step, both mappings";
  EXPECT_EQ(peer.qps[0].remote_pgid, Gid(2));
}

// A tree whose two endpoints share a peer (as the ranks of one host share
// every other rank with UD QPs), connected to each other or not: the
// second endpoint's quiesce finds the peer paused by the first one's, and
// the tree is one move to it, not a younger one to refuse. Before, the
// second endpoint was refused again and again until the move timed out.
TEST(MigratorTest, ATreeWhoseEndpointsShareAPeerMovesAsOne) {
  for (bool linked : {true, false}) {
    SCOPED_TRACE(linked ? "linked" : "not linked");
    Cluster c(linked ? "treeshared1" : "treeshared0");
    c.host(1).AddPlainProcess(90);
    std::vector<FakeQp> a = {FakeQp{11, 2, VGid(3), 31, Gid(3)}};
    std::vector<FakeQp> b = {FakeQp{21, 2, VGid(3), 32, Gid(3)}};
    if (linked) {
      a.push_back(FakeQp{12, 2, VGid(2), 22, Gid(1)});
      b.push_back(FakeQp{22, 2, VGid(1), 12, Gid(1)});
    }
    c.host(1).Add(100, VGid(1), a);
    c.host(1).Add(200, VGid(2), b);
    c.host(1).AddChild(90, 100);
    c.host(1).AddChild(90, 200);
    c.host(3).Add(300, VGid(3),
                  {FakeQp{31, 2, VGid(1), 11, Gid(1)}, FakeQp{32, 2, VGid(2), 21, Gid(1)}});
    MoveRun run = Migrate(c, 90, "h2");
    ASSERT_TRUE(run.status.ok()) << run.status;
    EXPECT_TRUE(run.report.ok()) << run.report.error();
    for (pid_t pid : {100, 200}) {
      EXPECT_FALSE(c.host(1).Exists(pid)) << pid;
      FakeEndpoint moved = c.host(2).Get(pid);
      EXPECT_TRUE(moved.alive && moved.connected && !moved.released && !moved.paused) << pid;
    }
    FakeEndpoint peer = c.host(3).Get(300);
    EXPECT_TRUE(!peer.paused && !peer.released);
    ASSERT_EQ(peer.qps.size(), 2u);
    EXPECT_EQ(peer.qps[0].remote_pgid, Gid(2));
    EXPECT_EQ(peer.qps[1].remote_pgid, Gid(2));
  }
}

// The same tree when its restore fails: both brought back on the source
// and kept paused, re-pointed at each other and their peer in one step,
// then resumed.
TEST(MigratorTest, ATreeWhoseEndpointsAreConnectedToEachOtherRollsBackWhole) {
  Cluster c("tree2back");
  Topology(c);
  c.host(1).AddPlainProcess(90);
  c.host(1).AddChild(90, 100);
  c.host(1).AddChild(90, 200);
  c.host(2).restore_error = absl::InternalError("restore failed");
  MoveRun run = Migrate(c, 90, "h2");
  EXPECT_FALSE(run.status.ok());
  EXPECT_TRUE(run.report.rolled_back()) << run.report.error();
  for (pid_t pid : {100, 200}) {
    FakeEndpoint back = c.host(1).Get(pid);
    EXPECT_TRUE(back.alive && back.connected && !back.released && !back.paused) << pid;
    EXPECT_THAT(Commands(back.log),
                ElementsAre("quiesce", "release", "restore", "peer_reconnect", "resume"))
        << pid;
  }
  FakeEndpoint peer = c.host(3).Get(300);
  EXPECT_TRUE(!peer.paused && !peer.released);
  EXPECT_EQ(peer.reconnected_to.size(), 2u) << "one step, both mappings";
}

// A pseudo-terminal whose both sides the tree holds moves with it (an MPI
// daemon reads its ranks' output through one); one whose master stays
// behind is replaced, and a second one held anywhere in the tree is
// refused, naming who holds it.
TEST(MigratorTest, ATerminalInTheTreeIsRefusedUnlessTheTreeHoldsBothItsSides) {
  Cluster c("treetty");
  Topology(c);
  c.host(3).AddPlainProcess(91);
  c.host(3).AddChild(91, 300);
  c.host(3).SetTerminal(300, "/dev/pts/4");
  c.host(3).AddPtyMaster(91, 4);
  MoveRun run = Migrate(c, 91, "h2", {}, 3);
  EXPECT_TRUE(run.status.ok()) << run.status;
  c.host(2).SetTerminal(300, "/dev/pts/4");
  c.host(2).AddPtyMaster(91, 5);
  c.host(2).SetTerminal(91, "/dev/pts/7");
  run = Migrate(c, 91, "h3", {}, 2);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("process 300 (a descendant of process 91) holds the terminal /dev/pts/4 "
                        "besides /dev/pts/7"));
}

TEST(MigratorTest, FinalDumpFailureRollsBack) {
  Cluster c("dumpfail");
  Topology(c);
  c.host(1).dump_error = absl::FailedPreconditionError("can't dump");
  MoveRun run = Migrate(c, 100, "h2");
  ExpectRolledBack(c, run, true);
}

TEST(MigratorTest, TransferFailureRollsBack) {
  Cluster c("xferfail");
  Topology(c);
  // Once the endpoint is quiesced, h2 can no longer store the final dump.
  v1::MigrateRequest req;
  req.set_pid(100);
  req.set_destination("h2");
  MoveRun run;
  run.status = c.m(1).Migrate(req, [&](const v1::Progress& p) {
    if (p.has_report()) run.report = p.report();
    if (p.phase() != "quiesce") return;
    for (const auto& e : std::filesystem::directory_iterator(c[2].state_dir + "/incoming"))
      std::ofstream(e.path().string() + "/final") << "in the way";
  });
  EXPECT_EQ(run.status.code(), absl::StatusCode::kAlreadyExists) << run.status;
  EXPECT_THAT(run.report.error(), HasSubstr("sending the final dump"));
  ExpectRolledBack(c, run, true);
}

TEST(MigratorTest, QuiesceFailureResumesWithoutRestore) {
  Cluster c("quiescefail");
  Topology(c);
  c.host(1).Fail(100, "quiesce", absl::StatusCode::kDeadlineExceeded);
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kDeadlineExceeded);
  ExpectRolledBack(c, run, /*restored=*/false);
  EXPECT_THAT(Commands(c.host(1).Get(100).log), ElementsAre("quiesce", "resume"));
}

TEST(MigratorTest, PeerQuiesceFailureResumesThePeers) {
  Cluster c("peerfail");
  Topology(c);
  c.host(3).Fail(300, "peer_quiesce", absl::StatusCode::kDeadlineExceeded);
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(Commands(c.host(1).Get(100).log), ElementsAre());  // never quiesced
  EXPECT_THAT(Commands(c.host(1).Get(200).log), ElementsAre("peer_quiesce", "resume"));
  EXPECT_FALSE(c.host(1).Get(200).paused);
}

TEST(MigratorTest, CheckpointThenRestoreReconnectsPeers) {
  Cluster c("ckpt");
  Topology(c);
  const std::string dir = TempDir("ckpt-dir") + "/cp";
  v1::CheckpointRequest req;
  req.set_pid(100);
  req.set_dir(dir);
  ASSERT_TRUE(c.m(1).Checkpoint(req, nullptr).ok());
  EXPECT_FALSE(c.host(1).Exists(100));
  absl::StatusOr<v1::Manifest> manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->endpoint().mapping().virtual_gid(), VGid(1));
  EXPECT_TRUE(VerifyImages(dir, *manifest).ok());
  // The peers wait, suspended.
  EXPECT_TRUE(c.host(3).Get(300).paused);
  EXPECT_TRUE(c.host(1).Get(200).paused);
  // A non-empty directory is refused, before anything is touched.
  req.set_pid(200);
  EXPECT_EQ(c.m(1).Checkpoint(req, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Commands(c.host(1).Get(200).log), ElementsAre("peer_quiesce"));

  v1::RestoreRequest rr;
  rr.set_dir(dir);
  absl::Status st = c.m(1).Restore(rr, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && e.connected && !e.released && !e.paused);
  EXPECT_FALSE(c.host(3).Get(300).paused);
  EXPECT_FALSE(c.host(1).Get(200).paused);
  EXPECT_EQ(c.host(3).Get(300).reconnected_to.back().physical_gid(), Gid(1));
}

TEST(MigratorTest, CheckpointLeaveRunningRestoresInPlace) {
  Cluster c("ckptrun");
  Topology(c);
  v1::CheckpointRequest req;
  req.set_pid(100);
  req.set_dir(TempDir("ckptrun-dir"));
  req.set_leave_running(true);
  ASSERT_TRUE(c.m(1).Checkpoint(req, nullptr).ok());
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && e.connected && !e.released && !e.paused);
  EXPECT_FALSE(c.host(3).Get(300).paused);
}

TEST(MigratorTest, RestoreElsewhereStreamsTheCheckpoint) {
  Cluster c("ckptaway");
  Topology(c);
  const std::string dir = TempDir("ckptaway-dir");
  v1::CheckpointRequest req;
  req.set_pid(100);
  req.set_dir(dir);
  ASSERT_TRUE(c.m(1).Checkpoint(req, nullptr).ok());
  v1::RestoreRequest rr;
  rr.set_dir(dir);
  rr.set_on("h2");
  absl::Status st = c.m(1).Restore(rr, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  FakeEndpoint e = c.host(2).Get(100);
  EXPECT_TRUE(e.alive && e.connected && !e.released && !e.paused);
  EXPECT_EQ(c.host(3).Get(300).reconnected_to.back().physical_gid(), Gid(2));
  // Re-pointed by the restore, the peer is nobody's paused peer any more:
  // it moves (it was refused before, "paused as a peer of migration ...").
  v1::MigrateRequest mq;
  mq.set_pid(300);
  mq.set_destination("h1");
  st = c.m(3).Migrate(mq, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_TRUE(c.host(1).Get(300).alive);
}

// Restore --on is the second half of a move (the same steps): a failure is
// rolled back as a move's is, except that the peers, paused by the
// checkpoint, wait for the next restore.
// The source gives up on a slow restore and aborts it: the abort does not
// wait behind the CRIU restore, and what the restore makes after it is
// killed, so that only the source's copy runs.
TEST(MigratorTest, AnAbortDoesNotWaitForTheRestoreItCancels) {
  Cluster c("abortrestore");
  Topology(c);
  MoveRun run;
  std::thread mover;
  ASSERT_TRUE(MoveHeldInRestore(c, &run, &mover))
      << "the move never reached the restore: " << run.status;
  std::string id;
  for (const auto& e : std::filesystem::directory_iterator(c[2].state_dir + "/incoming"))
    id = e.path().filename().string();
  ASSERT_FALSE(id.empty());
  v1::AbortIncomingRequest abort;
  abort.set_migration_id(id);
  EXPECT_TRUE(c.m(2).AbortIncoming(abort).ok());
  EXPECT_TRUE(c.host(2).stall_restore.load()) << "the abort returned while CRIU still restores";
  c.host(2).stall_restore = false;
  mover.join();
  EXPECT_EQ(run.status.code(), absl::StatusCode::kAborted) << run.status;
  EXPECT_TRUE(run.report.rolled_back());
  EXPECT_FALSE(c.host(2).Exists(100)) << "the copy restored after the abort was killed";
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && !e.stopped && e.connected && !e.paused);
}

// main() recovers on a thread of its own while the migrator already
// serves: a move begun in that window is this run's, in flight, and
// Recover() leaves it alone on both of its hosts. (The chaos soak found a
// restarted source rolling back, under its own feet, the move it had just
// begun: "no migration ... was prepared here".)
TEST(MigratorTest, RecoveryLeavesAloneTheMovesThisRunBegan) {
  Cluster c("recover-own");
  Topology(c);
  MoveRun run;
  std::thread mover;
  ASSERT_TRUE(MoveHeldInRestore(c, &run, &mover))
      << "the move never reached the restore: " << run.status;
  // Each host's recovery, as main() runs it, while the move is in flight.
  c.m(1).Recover();
  c.m(2).Recover();
  c.host(2).stall_restore = false;
  mover.join();
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_TRUE(c.host(2).Get(100).alive);
  EXPECT_FALSE(c.host(2).Get(100).paused);
  EXPECT_FALSE(c.host(1).Exists(100));
}

// A source that aborts while its image stream hangs (the source stalled,
// the network slow) is answered at once, not when the stream ends; the
// stream then stops at its next piece and leaves no image behind.
TEST(MigratorTest, AnAbortDoesNotWaitForAnImageStream) {
  Cluster c("abortstream");
  v1::PrepareRequest prep;
  prep.set_migration_id("stream-1");
  prep.mutable_endpoint()->set_pid(100);
  ASSERT_TRUE(c.m(2).Prepare(prep).ok());
  const std::string src = TempDir("abortstream-src");
  std::ofstream(src + "/pages.img") << "0123456789";
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(src);
  ASSERT_TRUE(files.ok());
  v1::ImageChunk first;
  first.set_migration_id("stream-1");
  first.mutable_manifest()->set_format_version(1);
  for (const auto& f : *files) *first.mutable_manifest()->add_files() = f;

  absl::Notification second_asked, go_on;
  int calls = 0;
  auto next = [&](v1::ImageChunk* chunk) {
    switch (calls++) {
      case 0:
        *chunk = first;
        return true;
      case 1:
        chunk->set_migration_id("stream-1");
        chunk->set_name("pages.img");
        chunk->set_data("01234");
        return true;
      case 2:
        second_asked.Notify();
        go_on.WaitForNotification();  // the source stalls here
        chunk->set_migration_id("stream-1");
        chunk->set_name("pages.img");
        chunk->set_offset(5);
        chunk->set_data("56789");
        return true;
      default:
        return false;
    }
  };
  absl::StatusOr<v1::PushImagesResponse> pushed;
  std::thread stream([&] { pushed = c.m(2).PushImages(next); });
  second_asked.WaitForNotification();
  v1::AbortIncomingRequest abort;
  abort.set_migration_id("stream-1");
  EXPECT_TRUE(c.m(2).AbortIncoming(abort).ok());
  EXPECT_FALSE(go_on.HasBeenNotified()) << "the abort returned only after the stream went on";
  go_on.Notify();
  stream.join();
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kAborted) << pushed.status();
  const std::string dir = c[2].state_dir + "/incoming/stream-1";
  EXPECT_FALSE(std::filesystem::exists(dir + "/final/pages.img"));
  absl::StatusOr<v1::MigrationRecord> rec = ReadRecord(dir);
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ(rec->phase(), "aborted");
}

TEST(MigratorTest, ARestoreElsewhereThatFailsIsRolledBackAndCanBeMadeAgain) {
  Cluster c("ckptfail");
  Topology(c);
  const std::string dir = TempDir("ckptfail-dir");
  v1::CheckpointRequest req;
  req.set_pid(100);
  req.set_dir(dir);
  ASSERT_TRUE(c.m(1).Checkpoint(req, nullptr).ok());
  c.host(2).restore_error = absl::InternalError("criu: restore failed");
  v1::RestoreRequest rr;
  rr.set_dir(dir);
  rr.set_on("h2");
  absl::Status st = c.m(1).Restore(rr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_FALSE(c.host(2).Exists(100));
  EXPECT_TRUE(c.host(3).Get(300).paused);
  EXPECT_TRUE(c.host(3).Get(300).reconnected_to.empty());
  const v1::StatusResponse status = c.m(1).Status();
  ASSERT_FALSE(status.recent().empty());
  EXPECT_TRUE(status.recent(0).rolled_back());
  EXPECT_THAT(status.recent(0).error(), HasSubstr("restore failed"));

  c.host(2).restore_error = absl::OkStatus();
  st = c.m(1).Restore(rr, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(c.host(2).Get(100).alive);
  EXPECT_FALSE(c.host(3).Get(300).paused);
  EXPECT_EQ(c.host(3).Get(300).reconnected_to.back().physical_gid(), Gid(2));
  EXPECT_EQ(c.m(1).Status().recent(0).pid(), c.host(2).Get(100).pid);
}

TEST(MigratorTest, CorruptedCheckpointIsRefusedAndNothingIsCreated) {
  Cluster c("corrupt");
  Topology(c);
  const std::string dir = TempDir("corrupt-dir");
  v1::CheckpointRequest req;
  req.set_pid(100);
  req.set_dir(dir);
  ASSERT_TRUE(c.m(1).Checkpoint(req, nullptr).ok());
  {
    std::fstream f(dir + "/pages-1.img", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('X');
  }
  v1::RestoreRequest rr;
  rr.set_dir(dir);
  absl::Status st = c.m(1).Restore(rr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  std::filesystem::resize_file(dir + "/pages-1.img", 10);
  st = c.m(1).Restore(rr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  std::filesystem::remove(dir + "/manifest.pb");
  st = c.m(1).Restore(rr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_EQ(c.host(1).restores, 0);
  EXPECT_FALSE(c.host(1).Exists(100));
}

// ---- recovery after a restart ------------------------------------------

// A migration that stopped in `phase` as a crash would leave it, written
// the way the migrator writes it.
v1::MigrationRecord CrashedRecord(const std::string& phase) {
  v1::MigrationRecord rec;
  v1::MigrationReport* r = rec.mutable_report();
  r->set_migration_id("crashed-1");
  r->set_kind("migrate");
  r->set_pid(100);
  rec.set_role("source");
  rec.set_phase(phase);
  rec.set_destination("h2:7700");
  rec.set_local_peers(true);
  rec.add_peer_hosts("h3:7700");
  rec.mutable_endpoint()->mutable_mapping()->set_virtual_gid(VGid(1));
  rec.mutable_endpoint()->mutable_mapping()->set_physical_gid(Gid(1));
  rec.set_quiesced(true);
  return rec;
}

// Puts the fakes where the crash left them: peers suspended, the endpoint
// quiesced, released and SIGSTOPped (its socket closed).
void Crash(Cluster& c, bool released, bool stopped) {
  for (auto [h, pid] : {std::pair{1, 200}, std::pair{3, 300}})
    ASSERT_TRUE(c.host(h)
                    .Call(
                        pid,
                        [] {
                          v1::MigratorToShim q;
                          q.mutable_peer_quiesce();
                          return q;
                        }(),
                        absl::Seconds(1))
                    .ok());
  v1::MigratorToShim q;
  q.mutable_quiesce();
  ASSERT_TRUE(c.host(1).Call(100, q, absl::Seconds(1)).ok());
  if (released) {
    v1::MigratorToShim r;
    r.mutable_release();
    ASSERT_TRUE(c.host(1).Call(100, r, absl::Seconds(1)).ok());
  }
  if (stopped) {
    ASSERT_TRUE(c.host(1).Stop(100).ok());
  }
}

TEST(MigratorRecoveryTest, SourceRollsBackAReleasedStoppedProcess) {
  Cluster c("recover-src");
  Topology(c);
  Crash(c, /*released=*/true, /*stopped=*/true);
  v1::MigrationRecord rec = CrashedRecord("transfer");
  rec.set_released(true);
  rec.set_stopped(true);
  const std::string dir = c[1].state_dir + "/migrations/crashed-1";
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(1);
  c.Start(1);
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && !e.stopped && e.connected && !e.released && !e.paused);
  EXPECT_EQ(c.host(3).Get(300).reconnected_to.back().physical_gid(), Gid(1));
  EXPECT_FALSE(c.host(3).Get(300).paused);
  EXPECT_FALSE(c.host(1).Get(200).paused);
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->done());
  EXPECT_TRUE(after->report().rolled_back());
  EXPECT_THAT(after->report().error(), HasSubstr("restarted"));
}

// A tree's move cut after both endpoints were released and the tree
// stopped: the tree's first move goes back first (the tree continued, its
// endpoint restored here), then the further endpoint, whose process must
// run to come back. Its record sorts first: in that order the second
// endpoint's shim, stopped, never says hello.
TEST(MigratorRecoveryTest, ATreeCutBeforeItsRestoreComesBackWhole) {
  Cluster c("recover-tree");
  TwoProgramTree(c);
  for (auto [peer, vgid] : {std::pair{300, 1}, std::pair{305, 4}}) {
    v1::MigratorToShim q;
    q.mutable_peer_quiesce()->set_virtual_gid(VGid(vgid));
    ASSERT_TRUE(c.host(3).Call(peer, q, absl::Seconds(1)).ok());
  }
  for (pid_t p : {100, 105}) {
    v1::MigratorToShim q, r;
    q.mutable_quiesce();
    r.mutable_release();
    ASSERT_TRUE(c.host(1).Call(p, q, absl::Seconds(1)).ok());
    ASSERT_TRUE(c.host(1).Call(p, r, absl::Seconds(1)).ok());
  }
  ASSERT_TRUE(c.host(1).Stop(90).ok());
  auto record = [](const std::string& id, pid_t pid, int vgid) {
    v1::MigrationRecord rec = CrashedRecord("dump");
    rec.mutable_report()->set_migration_id(id);
    rec.mutable_report()->set_pid(pid);
    rec.set_local_peers(false);
    rec.mutable_endpoint()->mutable_mapping()->set_virtual_gid(VGid(vgid));
    rec.set_released(true);
    rec.set_tree_root(90);
    return rec;
  };
  v1::MigrationRecord lead = record("crashed-2", 100, 1);
  lead.set_stopped(true);
  v1::MigrationRecord member = record("crashed-1", 105, 4);
  member.set_tree_lead("crashed-2");
  const std::string dirs = c[1].state_dir + "/migrations/";
  ASSERT_TRUE(WriteRecord(dirs + "crashed-2", lead).ok());
  ASSERT_TRUE(WriteRecord(dirs + "crashed-1", member).ok());
  c.Stop(1);
  c.Start(1);
  for (pid_t p : {100, 105}) {
    FakeEndpoint e = c.host(1).Get(p);
    EXPECT_TRUE(e.alive && !e.stopped && e.connected && !e.released && !e.paused) << p;
  }
  for (pid_t peer : {300, 305}) EXPECT_FALSE(c.host(3).Get(peer).paused) << peer;
  for (const char* id : {"crashed-1", "crashed-2"}) {
    absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dirs + id);
    ASSERT_TRUE(after.ok());
    EXPECT_TRUE(after->done() && after->report().rolled_back()) << id << after->report().error();
  }
}

// The migrator died as the release was answered: the shim is released (it
// waits for its resume marker) but the record does not say so. Recovery
// brings it back all the same. (The chaos soak's source, killed during the
// release, left its process released and stuck: "no shim of process ... is
// connected".)
TEST(MigratorRecoveryTest, SourceBringsBackAProcessReleasedWithoutARecordOfIt) {
  Cluster c("recover-rel");
  Topology(c);
  Crash(c, /*released=*/true, /*stopped=*/false);
  const std::string dir = c[1].state_dir + "/migrations/crashed-1";
  ASSERT_TRUE(WriteRecord(dir, CrashedRecord("release")).ok());
  c.Stop(1);
  c.Start(1);
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && e.connected && !e.released && !e.paused);
  EXPECT_FALSE(c.host(3).Get(300).paused);
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->done());
  EXPECT_TRUE(after->report().rolled_back()) << after->report().error();
}

TEST(MigratorRecoveryTest, SourceResumesAQuiescedProcess) {
  Cluster c("recover-q");
  Topology(c);
  Crash(c, /*released=*/false, /*stopped=*/false);
  ASSERT_TRUE(WriteRecord(c[1].state_dir + "/migrations/crashed-1", CrashedRecord("quiesce")).ok());
  c.Stop(1);
  c.Start(1);
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_FALSE(e.paused);
  EXPECT_THAT(Commands(e.log), Not(Contains("restore")));
  EXPECT_FALSE(c.host(3).Get(300).paused);
  EXPECT_TRUE(c.host(3).Get(300).reconnected_to.empty());
}

TEST(MigratorRecoveryTest, SourceRestoresAGoneProcessFromItsFinalDump) {
  Cluster c("recover-gone");
  Topology(c);
  Crash(c, true, false);
  const std::string dir = c[1].state_dir + "/migrations/crashed-1";
  ASSERT_TRUE(c.host(1).Dump(100, dir + "/final", "", /*leave_running=*/false, false).ok());
  v1::MigrationRecord rec = CrashedRecord("transfer");
  rec.set_released(true);
  rec.set_dumped(true);
  rec.set_image_dir(dir + "/final");
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  ASSERT_FALSE(c.host(1).Exists(100));
  c.Stop(1);
  c.Start(1);
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && e.connected && !e.released && !e.paused);
  EXPECT_EQ(c.host(1).restores, 1);
  EXPECT_FALSE(c.host(3).Get(300).paused);
  EXPECT_TRUE(ReadRecord(dir)->report().rolled_back());
}

// A destination's record of a move whose CRIU restore made pid 100 and
// was not confirmed (its migrator died during the restore).
v1::MigrationRecord RestoringRecord(const std::string& id) {
  v1::MigrationRecord rec;
  rec.mutable_report()->set_migration_id(id);
  rec.set_role("destination");
  rec.set_phase("restoring");
  rec.set_restored_pid(100);
  return rec;
}

// A half-restored copy that cannot be killed is not reported as gone: the
// record says so (the same path serves a source's abort).
TEST(MigratorRecoveryTest, ADestinationCopyThatCannotBeKilledIsSaid) {
  Cluster c("recover-dst-stuck");
  c.host(2).Add(100, VGid(1), {});
  const std::string dir = c[2].state_dir + "/incoming/crashed-2";
  v1::MigrationRecord rec = RestoringRecord("crashed-2");
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(2);
  c.Start(2, /*recover=*/false);
  c.host(2).kill_error = absl::InternalError("task stuck in D state");
  c.m(2).Recover();
  EXPECT_TRUE(c.host(2).Exists(100));
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->phase(), "aborted");
  EXPECT_THAT(after->report().error(),
              HasSubstr("but the restored copy (pid 100) could not be killed and stays stopped"));
}

TEST(MigratorRecoveryTest, DestinationKillsAHalfRestoredProcess) {
  Cluster c("recover-dst");
  // CRIU restored pid 100 on h2, then h2's migrator died before the restore completed.
  c.host(2).Add(100, VGid(1), {});
  v1::MigratorToShim q;
  q.mutable_quiesce();
  ASSERT_TRUE(c.host(2).Call(100, q, absl::Seconds(1)).ok());
  const std::string dir = c[2].state_dir + "/incoming/crashed-1";
  v1::MigrationRecord rec = RestoringRecord("crashed-1");
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  std::filesystem::create_directories(dir + "/final");
  c.Stop(2);
  c.Start(2);
  EXPECT_FALSE(c.host(2).Exists(100));
  EXPECT_FALSE(std::filesystem::exists(dir + "/final"));
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->done());
  EXPECT_EQ(after->phase(), "aborted");
}

// h1's migrator crashed with P (pid 100) released and stopped, in
// `phase` (`confirmed`: the destination restored it); while it was down, P
// died and a stranger was given its pid. What the restarted migrator
// recorded; the stranger must be neither killed nor continued.
v1::MigrationRecord RecoverWithThePidReused(Cluster& c, const std::string& phase, bool confirmed) {
  Topology(c);
  Crash(c, /*released=*/true, /*stopped=*/true);
  v1::MigrationRecord rec = CrashedRecord(phase);
  rec.set_released(true);
  rec.set_stopped(true);
  rec.set_confirmed(confirmed);
  rec.set_identity(c.host(1).Identity(100));
  EXPECT_FALSE(rec.identity().empty());
  const std::string dir = c[1].state_dir + "/migrations/crashed-1";
  EXPECT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(1);
  c.host(1).ReusePid(100);
  EXPECT_NE(c.host(1).Identity(100), rec.identity());
  c.Start(1);
  EXPECT_TRUE(c.host(1).Exists(100));
  EXPECT_THAT(c.host(1).Events(), AllOf(Not(Contains("kill 100")), Not(Contains("continue 100"))));
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  EXPECT_TRUE(after.ok());
  return after.ok() ? *after : v1::MigrationRecord();
}

// Confirmed: the move is finished, the stranger left alone.
TEST(MigratorRecoveryTest, SourceLeavesAloneAStrangerGivenTheMovedProcessPid) {
  Cluster c("recover-reused");
  EXPECT_TRUE(RecoverWithThePidReused(c, "reconnect", /*confirmed=*/true).done());
}

// Not confirmed: nothing to roll back, and it is said.
TEST(MigratorRecoveryTest, SourceDoesNotContinueAStrangerGivenTheStoppedProcessPid) {
  Cluster c("recover-reused-rb");
  const v1::MigrationRecord after = RecoverWithThePidReused(c, "transfer", /*confirmed=*/false);
  EXPECT_TRUE(after.done());
  EXPECT_FALSE(after.report().rolled_back());
  EXPECT_THAT(after.report().error(), HasSubstr("process 100 is gone"));
}

TEST(MigratorRecoveryTest, DestinationDoesNotKillAStrangerGivenTheRestoredPid) {
  Cluster c("recover-dst-reused");
  c.host(2).Add(100, VGid(1), {});
  const std::string dir = c[2].state_dir + "/incoming/crashed-1";
  v1::MigrationRecord rec = RestoringRecord("crashed-1");
  rec.set_restored_identity(c.host(2).Identity(100));
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(2);
  c.host(2).ReusePid(100);
  c.Start(2);
  EXPECT_TRUE(c.host(2).Exists(100));
  EXPECT_THAT(c.host(2).Events(), Not(Contains("kill 100")));
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->phase(), "aborted");
  EXPECT_THAT(after->report().error(),
              HasSubstr("restored process 100 was gone (its pid names another process now)"));
}

// Until `done()` holds, for at most 30 s; whether it did.
template <typename F>
bool Eventually(F done) {
  for (absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(10)))
    if (done()) return true;
  return done();
}

// h1's migrator died during the post-copy of a confirmed move of P (100):
// CRIU's page server (the helper, pid 700, a process of its own) still
// serves P's last pages to h2. The restarted migrator waits for it to end
// (`ending`: what it writes to its status file, or "" for none, and gone)
// and returns the record it finished with. With `repointed`, h3 had
// re-pointed P's peer Q (300) at P's new place before the crash, and
// resumed it.
v1::MigrationRecord RecoverDuringPostcopy(Cluster& c, const std::string& ending,
                                          bool repointed = false) {
  Topology(c);
  Crash(c, /*released=*/true, /*stopped=*/true);
  c.host(1).AddPlainProcess(700);
  v1::MigrationRecord rec = CrashedRecord("postcopy");
  rec.set_released(true);
  rec.set_stopped(true);
  rec.set_confirmed(true);
  if (repointed) {
    v1::Mapping* moved = rec.mutable_new_mapping();
    moved->set_virtual_gid(VGid(1));
    moved->set_physical_gid(Gid(2));
    v1::IdPair* qpn = moved->add_qpns();
    qpn->set_virtual_id(11);
    qpn->set_physical_id(41);
    rec.set_quiesce_attempt(1);
    // As the source's reconnect asked it (Migrator::ReconnectAll).
    v1::ReconnectPeersRequest req;
    req.set_migration_id(rec.report().migration_id());
    *req.mutable_mapping() = *moved;
    req.set_quiesce_attempt(1);
    EXPECT_TRUE(c.m(3).ReconnectPeers(req).ok());
    EXPECT_EQ(c.host(3).Get(300).reconnected_to.size(), 1u);
  }
  rec.mutable_report()->set_postcopy(true);
  const std::string dir = c[1].state_dir + "/migrations/crashed-1";
  const std::string status_file = c[1].state_dir + "/lazy-dump.log.status";
  rec.mutable_postcopy()->set_pid(700);
  rec.mutable_postcopy()->set_identity(c.host(1).Identity(700));
  rec.mutable_postcopy()->set_status_file(status_file);
  EXPECT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(1);
  c.Start(1, /*recover=*/false);
  std::thread recovery([&] { c.m(1).Recover(); });
  // It waits in phase postcopy while the helper runs.
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<v1::MigrationRecord> r = ReadRecord(dir);
    return r.ok() && r->phase() == "postcopy";
  }));
  absl::SleepFor(absl::Milliseconds(300));
  absl::StatusOr<v1::MigrationRecord> waiting = ReadRecord(dir);
  EXPECT_TRUE(waiting.ok() && !waiting->done());
  if (ending.empty()) {
    EXPECT_TRUE(c.host(1).Kill(700).ok());
  } else {
    std::ofstream(status_file) << ending << "\n";
  }
  recovery.join();
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  EXPECT_TRUE(after.ok());
  return after.ok() ? *after : v1::MigrationRecord();
}

// h1's migrator died after its post-copy dump began serving P's pages
// (700: CRIU's page server, which holds P) but before h2 confirmed the
// restore: the move goes back, the page server is killed first (so that
// CRIU lets go of P), and P runs on h1 again.
TEST(MigratorRecoveryTest, ASourceRestartedBeforeAPostcopyWasConfirmedEndsItsPageServer) {
  Cluster c("recover-postcopy-back");
  Topology(c);
  Crash(c, /*released=*/true, /*stopped=*/true);
  c.host(1).AddPlainProcess(700);
  v1::MigrationRecord rec = CrashedRecord("restore");
  rec.set_released(true);
  rec.set_stopped(true);
  rec.mutable_report()->set_postcopy(true);
  rec.mutable_postcopy()->set_pid(700);
  rec.mutable_postcopy()->set_identity(c.host(1).Identity(700));
  rec.mutable_postcopy()->set_status_file(c[1].state_dir + "/lazy-dump.log.status");
  const std::string dir = c[1].state_dir + "/migrations/crashed-1";
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(1);
  c.Start(1);
  EXPECT_FALSE(c.host(1).Exists(700));
  const std::vector<std::string> events = c.host(1).Events();
  const auto killed = std::find(events.begin(), events.end(), "kill 700");
  ASSERT_NE(killed, events.end());
  EXPECT_LT(killed, std::find(events.begin(), events.end(), "continue 100"));
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && !e.stopped && e.connected && !e.released && !e.paused);
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->report().rolled_back());
}

TEST(MigratorRecoveryTest, ASourceRestartedDuringAPostcopyFinishesItWhenThePagesHaveGone) {
  Cluster c("recover-postcopy");
  const v1::MigrationRecord after = RecoverDuringPostcopy(c, "0");
  EXPECT_TRUE(after.done());
  EXPECT_THAT(after.report().error(), Not(HasSubstr("post-copy")));
  EXPECT_FALSE(c.host(1).Exists(100));  // the stopped source copy, killed
}

// The post-copy begins once the peers are re-pointed and running again,
// so a restarted source asks their hosts again with the same request (the
// quiesce's attempt is in its record) and they answer from what they did.
// Before, it asked as attempt 0: h3 quiesced Q again and reset its QPs
// toward P, and Q's connection, now behind P's, stalled for good (in the
// lab: the client never wrote again).
TEST(MigratorRecoveryTest, ASourceRestartedDuringAPostcopyDoesNotRepointItsPeersAgain) {
  Cluster c("recover-postcopy-repointed");
  const v1::MigrationRecord after = RecoverDuringPostcopy(c, "0", /*repointed=*/true);
  EXPECT_TRUE(after.done());
  EXPECT_EQ(after.quiesce_attempt(), 1u);
  const FakeEndpoint q = c.host(3).Get(300);
  EXPECT_EQ(q.reconnected_to.size(), 1u) << "re-pointed again";
  EXPECT_FALSE(q.paused);
}

TEST(MigratorRecoveryTest, ASourceRestartedDuringAPostcopySaysTheProcessIsLostIfThePagesDidNotGo) {
  for (const char* ending : {"1", ""}) {
    SCOPED_TRACE(ending);
    Cluster c(absl::StrCat("recover-postcopy-lost", ending));
    const v1::MigrationRecord after = RecoverDuringPostcopy(c, ending);
    EXPECT_TRUE(after.done());
    EXPECT_FALSE(after.report().rolled_back());
    EXPECT_THAT(after.report().error(), HasSubstr("post-copy: the process is lost"));
    EXPECT_THAT(after.report().error(),
                HasSubstr(*ending != '\0' ? "exit status 1" : "without its exit status"));
  }
}

// h2's migrator died while CRIU's lazy-pages daemon (700) still brought in
// the pages of P (100), restored and resumed: the restarted migrator
// watches it; when the daemon fails, P is killed rather than left to
// fault on the pages that never came. One whose daemon succeeded is kept.
TEST(MigratorRecoveryTest, ADestinationRestartedDuringAPostcopyKillsTheProcessIfItsPagesFail) {
  for (const std::string ending : {"137", "0"}) {
    SCOPED_TRACE(ending);
    Cluster c(absl::StrCat("recover-dst-postcopy", ending));
    c.host(2).Add(100, VGid(1), {});
    c.host(2).AddPlainProcess(700);
    const std::string dir = c[2].state_dir + "/incoming/moved-1";
    v1::MigrationRecord rec = RestoringRecord("moved-1");
    rec.set_phase("resumed");
    rec.set_confirmed(true);
    rec.set_done(true);
    rec.set_restored_identity(c.host(2).Identity(100));
    const std::string status_file = c[2].state_dir + "/lazy-pages.status";
    rec.mutable_postcopy()->set_pid(700);
    rec.mutable_postcopy()->set_identity(c.host(2).Identity(700));
    rec.mutable_postcopy()->set_status_file(status_file);
    ASSERT_TRUE(WriteRecord(dir, rec).ok());
    c.Stop(2);
    c.Start(2);
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_TRUE(c.host(2).Exists(100));  // the daemon still runs
    std::ofstream(status_file) << ending << "\n";
    if (ending == "0") {
      absl::SleepFor(absl::Milliseconds(300));  // past the watcher's next look
      c.Stop(2);                                // joins its watcher
      EXPECT_TRUE(c.host(2).Exists(100));
    } else {
      EXPECT_TRUE(Eventually([&] { return !c.host(2).Exists(100); }));
    }
  }
}

// h2's migrator restarted after it restored P (endpoint 100, moved from
// h1) and confirmed the restore, and the source asks it to resume P
// before its recovery has put that move back (the daemon recovers beside
// serving, after `criu check`): the answer is UNAVAILABLE, which the
// source asks again, not "no endpoint to resume" (which ended a move in
// the lab with P paused) nor an abort's "nothing here" (which would leave
// P paused for good). Once recovered, P is resumed.
TEST(MigratorRecoveryTest, AMoveAskedAboutBeforeTheDestinationRecoveredIsAskedAgain) {
  Cluster c("recover-dst-early");
  FakeEndpoint& p = c.host(2).Add(100, VGid(1), {});
  p.paused = true;
  p.connected = false;  // its shim has not reconnected to the new run yet
  const std::string dir = c[2].state_dir + "/incoming/moved-1";
  v1::MigrationRecord rec = RestoringRecord("moved-1");
  rec.set_phase("restored");
  rec.set_confirmed(true);
  rec.mutable_report()->set_pid(100);
  ASSERT_TRUE(WriteRecord(dir, rec).ok());
  c.Stop(2);
  c.Start(2, /*recover=*/false);

  v1::ReconnectPeersRequest resume;
  resume.set_migration_id("moved-1");
  resume.set_resume_endpoint(true);
  resume.set_resume_only(true);
  resume.mutable_mapping()->set_virtual_gid(VGid(1));
  absl::StatusOr<v1::ReconnectPeersResponse> early = c.m(2).ReconnectPeers(resume);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable) << early.status();
  EXPECT_THAT(early.status().message(), HasSubstr("ask again"));
  v1::AbortIncomingRequest abort;
  abort.set_migration_id("moved-1");
  EXPECT_EQ(c.m(2).AbortIncoming(abort).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(c.host(2).Get(100).paused);
  EXPECT_TRUE(c.host(2).Exists(100));

  p.connected = true;
  c.m(2).Recover();
  absl::StatusOr<v1::ReconnectPeersResponse> asked_again = c.m(2).ReconnectPeers(resume);
  ASSERT_TRUE(asked_again.ok()) << asked_again.status();
  EXPECT_FALSE(c.host(2).Get(100).paused);
  absl::StatusOr<v1::MigrationRecord> after = ReadRecord(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->done());
  EXPECT_TRUE(after->report().ok());
}

// Two migrators that died together, each the source of a confirmed move
// toward the other (P, 100: h1 -> h2; Q, 200: h2 -> h1; both restored and
// paused on their destination), recover side by side. Each one's resume
// of its move on the other is answered once that other has put back its
// moves into it, which its recovery does first. Before, each resume waited
// for the other's whole recovery, itself waiting on this one: both gave up
// (restart_wait) and left their process paused.
TEST(MigratorRecoveryTest, TwoHostsRestartedTogetherFinishTheirMovesTowardEachOther) {
  Cluster c("recover-crossing");
  struct Crossing {
    int from, to;
    pid_t pid;
    std::string id;
  };
  const Crossing moves[] = {{1, 2, 100, "p-moved"}, {2, 1, 200, "q-moved"}};
  for (const Crossing& m : moves) {
    c.host(m.from).Add(m.pid, VGid(m.pid), {});  // the source copy: released and stopped
    v1::MigratorToShim q, r;
    q.mutable_quiesce();
    r.mutable_release();
    ASSERT_TRUE(c.host(m.from).Call(m.pid, q, absl::Seconds(1)).ok());
    ASSERT_TRUE(c.host(m.from).Call(m.pid, r, absl::Seconds(1)).ok());
    ASSERT_TRUE(c.host(m.from).Stop(m.pid).ok());
    c.host(m.to).Add(m.pid, VGid(m.pid), {}).paused = true;  // restored, confirmed

    v1::MigrationRecord src;
    src.mutable_report()->set_migration_id(m.id);
    src.mutable_report()->set_kind("migrate");
    src.mutable_report()->set_pid(m.pid);
    src.set_role("source");
    src.set_phase("reconnect");
    src.set_destination(Cluster::Target(m.to));
    src.set_identity(c.host(m.from).Identity(m.pid));
    src.set_quiesced(true);
    src.set_released(true);
    src.set_stopped(true);
    src.set_confirmed(true);
    src.mutable_new_mapping()->set_virtual_gid(VGid(m.pid));
    src.mutable_new_mapping()->set_physical_gid(Gid(m.to));
    ASSERT_TRUE(WriteRecord(c[m.from].state_dir + "/migrations/" + m.id, src).ok());
    v1::MigrationRecord dst = RestoringRecord(m.id);
    dst.set_phase("restored");
    dst.set_confirmed(true);
    dst.set_restored_pid(m.pid);
    dst.mutable_report()->set_pid(m.pid);
    ASSERT_TRUE(WriteRecord(c[m.to].state_dir + "/incoming/" + m.id, dst).ok());
  }
  c.Stop(1);
  c.Stop(2);
  c.Start(1, /*recover=*/false);
  c.Start(2, /*recover=*/false);
  std::thread h1([&] { c.m(1).Recover(); });
  std::thread h2([&] { c.m(2).Recover(); });
  h1.join();
  h2.join();

  for (const Crossing& m : moves) {
    SCOPED_TRACE(m.id);
    EXPECT_FALSE(c.host(m.to).Get(m.pid).paused) << "not resumed on its destination";
    EXPECT_FALSE(c.host(m.from).Exists(m.pid)) << "the stopped source copy is left";
    absl::StatusOr<v1::MigrationRecord> after =
        ReadRecord(c[m.from].state_dir + "/migrations/" + m.id);
    ASSERT_TRUE(after.ok());
    EXPECT_TRUE(after->done());
    EXPECT_TRUE(after->report().ok()) << after->report().error();
  }
}

// h3's migrator restarted while its endpoint 300 was paused as a peer of
// P (endpoint 100, moved h1 -> h2), and is asked to re-point it before
// its shim said Hello again: the answer is UNAVAILABLE, asked again once
// it has recovered, which re-points 300. Before, h3 answered OK having
// found no peer among its shims, and 300 stayed paused for good.
TEST(MigratorRecoveryTest, APeerHostAskedToRePointBeforeItRecoveredIsAskedAgain) {
  Cluster c("recover-peer-early");
  FakeEndpoint& peer = c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
  v1::MigratorToShim q;
  q.mutable_peer_quiesce()->set_virtual_gid(VGid(1));
  ASSERT_TRUE(c.host(3).Call(300, q, absl::Seconds(1)).ok());
  peer.connected = false;
  c.Stop(3);
  c.Start(3, /*recover=*/false);

  v1::ReconnectPeersRequest repoint;
  repoint.set_migration_id("moved-1");
  repoint.mutable_mapping()->set_virtual_gid(VGid(1));
  repoint.mutable_mapping()->set_physical_gid(Gid(2));
  absl::StatusOr<v1::ReconnectPeersResponse> early = c.m(3).ReconnectPeers(repoint);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable) << early.status();
  EXPECT_TRUE(c.host(3).Get(300).paused);

  peer.connected = true;
  c.m(3).Recover();
  absl::StatusOr<v1::ReconnectPeersResponse> asked_again = c.m(3).ReconnectPeers(repoint);
  ASSERT_TRUE(asked_again.ok()) << asked_again.status();
  ExpectRepointedToH2(c.host(3).Get(300));
}

// The source asks h3 again to re-point its peer 300 (its first request's
// deadline passed while h3 was stopped): h3 answers with the first
// request's outcome and re-points 300 once. Before, 300 was quiesced and
// its QPs reset a second time while traffic ran on them.
TEST(MigratorTest, AReconnectAskedAgainIsAnsweredByTheFirstAndRePointsOnce) {
  Cluster c("repoint-twice");
  c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
  v1::MigratorToShim q;
  q.mutable_peer_quiesce()->set_virtual_gid(VGid(1));
  ASSERT_TRUE(c.host(3).Call(300, q, absl::Seconds(1)).ok());

  v1::ReconnectPeersRequest repoint;
  repoint.set_migration_id("moved-1");
  repoint.mutable_mapping()->set_virtual_gid(VGid(1));
  repoint.mutable_mapping()->set_physical_gid(Gid(2));
  absl::StatusOr<v1::ReconnectPeersResponse> first = c.m(3).ReconnectPeers(repoint);
  ASSERT_TRUE(first.ok()) << first.status();
  ExpectRepointedToH2(c.host(3).Get(300));
  const size_t commands = c.host(3).Get(300).log.size();

  absl::StatusOr<v1::ReconnectPeersResponse> again = c.m(3).ReconnectPeers(repoint);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->pids_size(), first->pids_size());
  ExpectRepointedToH2(c.host(3).Get(300));
  EXPECT_EQ(c.host(3).Get(300).log.size(), commands) << "the peer was asked again";

  // Another move's request is its own.
  repoint.set_migration_id("moved-2");
  ASSERT_TRUE(c.m(3).ReconnectPeers(repoint).ok());
  EXPECT_EQ(c.host(3).Get(300).reconnected_to.size(), 2u);
}

// ---- guests ---------------------------------------------------------------

namespace guests {

// Endpoints 100 and 400 in a guest (h1), their peers 300 and 500 on h3.
void GuestTopology(Cluster& c) {
  c.host(1).Add(100, VGid(1), {FakeQp{11, 2, VGid(3), 31, Gid(3)}});
  c.host(1).Add(400, VGid(4), {FakeQp{41, 2, VGid(5), 51, Gid(3)}});
  c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
  c.host(3).Add(500, VGid(5), {FakeQp{51, 2, VGid(4), 41, Gid(1)}});
}

TEST(GuestTest, SuspendReleasesEveryEndpointAndResumeReconnectsItsPeers) {
  Cluster c("suspend");
  GuestTopology(c);
  absl::StatusOr<v1::GuestReport> s = c.m(1).Suspend(v1::SuspendRequest());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->ok());
  ASSERT_EQ(s->endpoints_size(), 2);
  for (pid_t pid : {100, 400}) {
    FakeEndpoint e = c.host(1).Get(pid);
    EXPECT_TRUE(e.alive && e.released) << pid;  // running, no device
    EXPECT_THAT(Commands(e.log), ElementsAre("quiesce", "release")) << pid;
  }
  for (pid_t pid : {300, 500}) {
    EXPECT_THAT(Commands(c.host(3).Get(pid).log), ElementsAre("peer_quiesce")) << pid;
    EXPECT_TRUE(c.host(3).Get(pid).paused) << pid;
  }
  // Suspended endpoints cannot be moved meanwhile; they show as in flight.
  EXPECT_EQ(Migrate(c, 100, "h2").status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.m(1).Status().in_flight_size(), 2);

  absl::StatusOr<v1::GuestReport> r = c.m(1).Resume(v1::ResumeRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ok()) << r->error();
  ASSERT_EQ(r->endpoints_size(), 2);
  for (const v1::MigrationReport& e : r->endpoints()) {
    EXPECT_TRUE(e.ok()) << e.error();
    EXPECT_GT(e.breakdown().blackout_us(), 0u);
    EXPECT_EQ(e.peers(), 1u);
  }
  for (pid_t pid : {100, 400}) {
    FakeEndpoint e = c.host(1).Get(pid);
    EXPECT_FALSE(e.released || e.paused) << pid;
    EXPECT_THAT(Commands(e.log), ElementsAre("quiesce", "release", "restore", "resume")) << pid;
  }
  for (auto [pid, vgid] : {std::pair{300, 1}, std::pair{500, 4}}) {
    FakeEndpoint p = c.host(3).Get(pid);
    EXPECT_THAT(Commands(p.log), ElementsAre("peer_quiesce", "peer_reconnect")) << pid;
    ASSERT_EQ(p.reconnected_to.size(), 1u);
    EXPECT_EQ(p.reconnected_to[0].virtual_gid(), VGid(vgid));
    EXPECT_FALSE(p.paused);
  }
  EXPECT_EQ(c.m(1).Status().in_flight_size(), 0);
  // Nothing left to resume; a second resume is a no-op.
  r = c.m(1).Resume(v1::ResumeRequest());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->endpoints_size(), 0);
}

// Two guests that talk to each other, suspended one after the other (as for
// a snapshot of both): neither is asked anything once released; the first
// back stays paused until the second is back and connected to it.
TEST(GuestTest, TwoGuestsSuspendedTogetherComeBackConnectedToEachOther) {
  Cluster c("suspend-both");
  c.host(1).Add(100, VGid(1), {FakeQp{11, 2, VGid(3), 31, Gid(3)}});
  c.host(3).Add(300, VGid(3), {FakeQp{31, 2, VGid(1), 11, Gid(1)}});
  ASSERT_TRUE(c.m(1).Suspend(v1::SuspendRequest()).ok());
  absl::StatusOr<v1::GuestReport> s = c.m(3).Suspend(v1::SuspendRequest());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(Commands(c.host(1).Get(100).log), ElementsAre("quiesce", "release"));
  EXPECT_THAT(Commands(c.host(3).Get(300).log), ElementsAre("peer_quiesce", "quiesce", "release"));

  absl::StatusOr<v1::GuestReport> r = c.m(1).Resume(v1::ResumeRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->ok()) << r->error();
  ASSERT_EQ(r->endpoints_size(), 1);
  EXPECT_EQ(r->endpoints(0).peers_waiting(), 1u);
  FakeEndpoint first = c.host(1).Get(100);
  EXPECT_TRUE(first.paused && !first.released);
  EXPECT_THAT(Commands(first.log), ElementsAre("quiesce", "release", "restore"));
  EXPECT_TRUE(c.host(3).Get(300).released);
  EXPECT_THAT(Commands(c.host(3).Get(300).log), ElementsAre("peer_quiesce", "quiesce", "release"));

  r = c.m(3).Resume(v1::ResumeRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->ok()) << r->error();
  EXPECT_EQ(r->endpoints(0).peers_waiting(), 0u);
  FakeEndpoint second = c.host(3).Get(300);
  EXPECT_FALSE(second.paused || second.released);
  ASSERT_EQ(second.restored_with.size(), 1u);  // restored toward where 100 is now
  EXPECT_EQ(second.restored_with[0].virtual_gid(), VGid(1));
  EXPECT_THAT(Commands(second.log),
              ElementsAre("peer_quiesce", "quiesce", "release", "restore", "resume"));
  first = c.host(1).Get(100);
  EXPECT_FALSE(first.paused || first.released);
  EXPECT_THAT(Commands(first.log), ElementsAre("quiesce", "release", "restore", "peer_reconnect"));
  ASSERT_EQ(first.reconnected_to.size(), 1u);
  EXPECT_EQ(first.reconnected_to[0].virtual_gid(), VGid(3));
  EXPECT_EQ(c.m(1).Status().in_flight_size(), 0);
  EXPECT_EQ(c.m(3).Status().in_flight_size(), 0);
}

TEST(GuestTest, SuspendRefusesEndpointsConnectedToEachOther) {
  Cluster c("suspend-local");
  Topology(c);  // 100 and 200 on h1 talk to each other
  absl::StatusOr<v1::GuestReport> s = c.m(1).Suspend(v1::SuspendRequest());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("connected to each other"));
  EXPECT_TRUE(Commands(c.host(1).Get(100).log).empty());
  EXPECT_TRUE(Commands(c.host(3).Get(300).log).empty());
  // One of them alone is fine: its local peer is peer-quiesced.
  v1::SuspendRequest one;
  one.add_pids(100);
  s = c.m(1).Suspend(one);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(Commands(c.host(1).Get(200).log), ElementsAre("peer_quiesce"));
  ASSERT_TRUE(c.m(1).Resume(v1::ResumeRequest()).ok());
  EXPECT_THAT(Commands(c.host(1).Get(200).log), ElementsAre("peer_quiesce", "peer_reconnect"));
}

TEST(GuestTest, AFailedSuspendPutsBackWhatItSuspended) {
  Cluster c("suspend-fail");
  GuestTopology(c);
  c.host(1).Fail(400, "release", absl::StatusCode::kInternal);
  absl::StatusOr<v1::GuestReport> s = c.m(1).Suspend(v1::SuspendRequest());
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("release"));
  FakeEndpoint first = c.host(1).Get(100);
  EXPECT_FALSE(first.released || first.paused);
  EXPECT_THAT(Commands(first.log), ElementsAre("quiesce", "release", "restore", "resume"));
  EXPECT_FALSE(c.host(1).Get(400).paused);
  for (pid_t pid : {300, 500}) EXPECT_FALSE(c.host(3).Get(pid).paused) << pid;
  // Nothing stays busy.
  v1::SuspendRequest one;
  one.add_pids(100);
  ASSERT_TRUE(c.m(1).Suspend(one).ok());
  ASSERT_TRUE(c.m(1).Resume(v1::ResumeRequest()).ok());
}

TEST(GuestTest, ResumeWithoutADeviceKeepsThemSuspended) {
  Cluster c("resume-nodev");
  GuestTopology(c);
  ASSERT_TRUE(c.m(1).Suspend(v1::SuspendRequest()).ok());
  c[1].rdma = false;  // the NIC is gone
  absl::StatusOr<v1::GuestReport> r = c.m(1).Resume(v1::ResumeRequest());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(c.host(1).Get(100).released);
  EXPECT_TRUE(c.host(3).Get(300).paused);
  c[1].rdma = true;  // a new NIC
  r = c.m(1).Resume(v1::ResumeRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ok()) << r->error();
  EXPECT_FALSE(c.host(3).Get(300).paused);
}

// A NIC handed out must survive a restart: one that cannot be saved is
// not handed out.
TEST(GuestTest, ANicThatCannotBeSavedIsNotHandedOut) {
  Cluster c("nics-unsaved");
  c[1].guest_nics = 2;
  c.Stop(1);
  c.Start(1);
  std::filesystem::create_directories(c[1].state_dir + "/guests.pb");  // rename cannot replace it
  v1::AllocateGuestNicRequest a;
  a.set_domain("vm-a");
  absl::StatusOr<v1::GuestNic> na = c.m(1).AllocateGuestNic(a);
  EXPECT_FALSE(na.ok());
  EXPECT_THAT(std::string(na.status().message()), HasSubstr("saving the guests' NICs"));
  EXPECT_EQ(c.m(1).GetHostInfo().guest_nics().in_use(), 0u);
  std::filesystem::remove_all(c[1].state_dir + "/guests.pb");
  na = c.m(1).AllocateGuestNic(a);
  ASSERT_TRUE(na.ok()) << na.status();
  EXPECT_EQ(c.m(1).GetHostInfo().guest_nics().in_use(), 1u);
}

TEST(GuestTest, HostHandsOutNicsUpToItsCapacityAndKeepsTrack) {
  Cluster c("nics");
  v1::AllocateGuestNicRequest a;
  a.set_domain("vm-a");
  EXPECT_EQ(c.m(1).AllocateGuestNic(a).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(c.m(1).GetHostInfo().has_guest_nics());
  c[1].guest_nics = 2;
  c.Stop(1);
  c.Start(1);
  absl::StatusOr<v1::GuestNic> na = c.m(1).AllocateGuestNic(a);
  ASSERT_TRUE(na.ok()) << na.status();
  EXPECT_EQ(na->address(), "10.9.1.1/16");
  EXPECT_THAT(na->mac(), ::testing::MatchesRegex("52:54:00(:[0-9a-f][0-9a-f]){3}"));
  EXPECT_THAT(na->interface_xml(), HasSubstr("<source bridge='br0'/>"));
  EXPECT_THAT(na->interface_xml(), HasSubstr(kGuestNicAlias));
  EXPECT_THAT(na->interface_xml(), HasSubstr(na->mac()));
  // Asked again (a retry): the same NIC.
  absl::StatusOr<v1::GuestNic> again = c.m(1).AllocateGuestNic(a);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->mac(), na->mac());
  v1::AllocateGuestNicRequest b;
  b.set_domain("vm-b");
  absl::StatusOr<v1::GuestNic> nb = c.m(1).AllocateGuestNic(b);
  ASSERT_TRUE(nb.ok());
  EXPECT_EQ(nb->address(), "10.9.1.2/16");
  v1::AllocateGuestNicRequest d;
  d.set_domain("vm-c");
  EXPECT_EQ(c.m(1).AllocateGuestNic(d).status().code(), absl::StatusCode::kResourceExhausted);

  v1::GuestEventRequest ev;
  ev.set_domain("vm-b");
  ev.set_event("started");
  ASSERT_TRUE(c.m(1).GuestEvent(ev).ok());
  v1::HostInfo info = c.m(1).GetHostInfo();
  ASSERT_TRUE(info.has_guest_nics());
  EXPECT_EQ(info.guest_nics().in_use(), 2u);
  EXPECT_THAT(info.guest_nics().domains(), ElementsAre("vm-b"));
  EXPECT_THAT(info.guest_nics().reserved(), ElementsAre("vm-a"));
  // A running guest gets no second NIC.
  EXPECT_EQ(c.m(1).AllocateGuestNic(b).status().code(), absl::StatusCode::kFailedPrecondition);

  // Kept across a restart; a stop frees the NIC and its address.
  c.Stop(1);
  c.Start(1);
  EXPECT_EQ(c.m(1).GetHostInfo().guest_nics().in_use(), 2u);
  ev.set_domain("vm-a");
  ev.set_event("stopped");
  ASSERT_TRUE(c.m(1).GuestEvent(ev).ok());
  absl::StatusOr<v1::GuestNic> nc = c.m(1).AllocateGuestNic(d);
  ASSERT_TRUE(nc.ok()) << nc.status();
  EXPECT_EQ(nc->address(), "10.9.1.1/16");
  ev.set_event("rebooted");
  EXPECT_EQ(c.m(1).GuestEvent(ev).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace guests

// ---- with an inventory (a real etcd) ---------------------------------------

TEST(MigratorInventoryTest, PeersAreFoundByTheirGidsAndTheMoveIsSeenFromEveryHost) {
  testing::Etcd etcd;
  Cluster c("inv-ok", etcd.url());
  Topology(c);
  c.host(2).stall_restore = true;
  MoveRun run;
  std::thread mover([&] { run = Migrate(c, 100, "h2"); });
  // While it restores, h3 (a peer's host, not a party to the move's RPCs
  // for status) lists it; a second move of the endpoint is refused.
  std::vector<v1::MoveClaim> seen;
  for (absl::Time end = absl::Now() + absl::Seconds(30); seen.empty() && absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(20))) {
    v1::StatusResponse st = c.m(3).Status(/*all=*/true);
    seen.assign(st.cluster_moves().begin(), st.cluster_moves().end());
  }
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].subject(), "endpoint/ep100");
  EXPECT_EQ(seen[0].source(), "h1");
  EXPECT_EQ(seen[0].destination(), "h2:7700");
  c.host(2).stall_restore = false;
  mover.join();
  ASSERT_TRUE(run.status.ok()) << run.status;
  // Found through the inventory: h3's peer re-pointed, h1's (local) too.
  FakeEndpoint moved = c.host(2).Get(100);
  EXPECT_TRUE(moved.alive && moved.connected && !moved.paused);
  for (auto [host, pid] : {std::pair{1, 200}, std::pair{3, 300}}) {
    FakeEndpoint p = c.host(host).Get(pid);
    EXPECT_THAT(Commands(p.log), ElementsAre("peer_quiesce", "peer_reconnect")) << pid;
    EXPECT_FALSE(p.paused);
  }
  // Done: the claim is gone.
  EXPECT_EQ(c.m(3).Status(true).cluster_moves_size(), 0);
  EXPECT_EQ(c.m(3).Status(true).inventory(), etcd.url());
  absl::StatusOr<v1::ListHostsResponse> hosts = c.m(1).ListHosts();
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  EXPECT_EQ(hosts->hosts_size(), 3);
}

// What a host publishes in the inventory does not wait for `criu check`
// (3 to 15 s on a loaded TCG host, during which the host was not listed):
// CRIU counts as not checked yet, so no move picks the host, until the
// verdict is in.
TEST(MigratorInventoryTest, AHostIsDescribedForTheInventoryBeforeItsCriuCheckEnds) {
  Cluster c("criu-later");
  absl::Notification gate, entered;
  c.host(1).check_gate = &gate;
  c.host(1).check_entered = &entered;
  v1::HostInfo checked;
  std::thread check([&] { checked = c.m(1).GetHostInfo(); });
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(30)));
  absl::Notification described;
  v1::InventoryHost early;
  std::thread describe([&] {
    early = c.m(1).DescribeForInventory();
    described.Notify();
  });
  const bool at_once = described.WaitForNotificationWithTimeout(absl::Seconds(30));
  gate.Notify();
  check.join();
  describe.join();
  ASSERT_TRUE(at_once) << "DescribeForInventory waited for criu check";
  EXPECT_FALSE(early.info().criu_ok());
  EXPECT_EQ(early.info().criu_version(), "not checked yet");
  EXPECT_EQ(early.info().devices_size(), 1);
  EXPECT_TRUE(checked.criu_ok());
  EXPECT_TRUE(c.m(1).DescribeForInventory().info().criu_ok());
}

// Once its CRIU verdict is in, the host is put again at once, not at the
// next keep-alive (a third of its lease later: the lab's host3 of the
// drain test, with a 300 s lease, stayed "not checked yet" for 100 s).
TEST(MigratorInventoryTest, TheInventoryHearsOfTheCriuVerdictAsSoonAsItIsIn) {
  testing::Etcd etcd;
  Cluster c("criu-refresh", etcd.url());
  c.Stop(1);
  c[1].inventory_ttl = absl::Seconds(300);
  c.Start(1);
  auto listed = [&]() -> std::optional<v1::InventoryHost> {
    absl::StatusOr<std::vector<v1::InventoryHost>> hosts = c[2].inventory->Hosts();
    if (hosts.ok())
      for (const v1::InventoryHost& h : *hosts)
        if (h.name() == "h1") return h;
    return std::nullopt;
  };
  std::optional<v1::InventoryHost> h1 = listed();
  ASSERT_TRUE(h1.has_value());
  EXPECT_EQ(h1->info().criu_version(), "not checked yet");
  EXPECT_FALSE(h1->info().criu_ok());
  ASSERT_TRUE(c.m(1).GetHostInfo().criu_ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while ((h1 = listed(), !h1.has_value() || !h1->info().criu_ok()) && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(h1.has_value());
  EXPECT_TRUE(h1->info().criu_ok()) << "still not checked after 30 s; the lease is 300 s";
}

// A UD peer that no migrator owns has no shim to tell where the sender
// went: the sender moves all the same (a connected one is refused, below).
TEST(MigratorInventoryTest, AUdPeerNoMigratorOwnsDoesNotHoldItsSenderBack) {
  testing::Etcd etcd;
  Cluster c("inv-udpeer", etcd.url());
  FakeEndpoint& sender = c.host(1).Add(100, VGid(1), {FakeQp{11, 4, "", 0, ""}});
  sender.ud_peer_pgids = {Gid(9)};
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  const FakeEndpoint moved = c.host(2).Get(100);
  EXPECT_TRUE(moved.alive && moved.connected && !moved.paused);
  EXPECT_FALSE(c.host(1).Exists(100));
}

// A process that only receives datagrams names none of its senders: with
// an inventory, every other live host pauses and re-points its UD
// endpoints for the move (before, host3's sender was never asked and went
// on sending to where the receiver had been).
TEST(MigratorInventoryTest, EveryHostLearnsWhereAUdReceiverWent) {
  testing::Etcd etcd;
  Cluster c("inv-udrecv", etcd.url());
  c.host(1).Add(100, VGid(1), {FakeQp{11, 4, "", 0, ""}});
  c.host(3).Add(300, VGid(3), {FakeQp{31, 4, "", 0, ""}});
  MoveRun run = Migrate(c, 100, "h2");
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_TRUE(c.host(2).Get(100).alive);
  ExpectRepointedToH2(c.host(3).Get(300));  // the sender
}

// A host asked only because it may send datagrams, whose migrator does not
// answer while its lease still lists it, is left out of the move: the
// move says so, goes on, and does not wait for it at the re-point.
TEST(MigratorInventoryTest, AListedHostThatDoesNotAnswerIsLeftOutOfAUdEndpointsMove) {
  testing::Etcd etcd;
  Cluster c("inv-udgone", etcd.url());
  c.host(1).Add(100, VGid(1), {FakeQp{11, 4, "", 0, ""}});
  // Its server gone, its registration kept: listed, unreachable.
  c[3].server->Shutdown();
  c[3].server.reset();
  std::vector<std::string> details;
  MoveRun run = MigrateWatched(c, 100, "h2", [&](const v1::Progress& p) {
    if (!p.detail().empty()) details.push_back(p.detail());
  });
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(run.report.ok()) << run.report.error();
  EXPECT_TRUE(c.host(2).Get(100).alive);
  EXPECT_FALSE(c.host(1).Exists(100));
  EXPECT_THAT(details, Contains("left out (their migrators do not answer): h3:7700"));
  for (const std::string& d : details) EXPECT_THAT(d, Not(HasSubstr("asking again"))) << d;
}

TEST(MigratorInventoryTest, APeerGidNoMigratorOwnsIsRefusedBeforeAnythingIsQuiesced) {
  testing::Etcd etcd;
  Cluster c("inv-unknown", etcd.url());
  Topology(c);
  // h3's migrator leaves the inventory: its GID has no owner.
  c.Stop(3);
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kNotFound) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("no migrator owns GID"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("nothing was quiesced"));
  EXPECT_THAT(run.phases, ElementsAre("prepare"));
  FakeEndpoint e = c.host(1).Get(100);
  EXPECT_TRUE(e.alive && !e.paused && !e.released);
  EXPECT_THAT(Commands(e.log), ElementsAre());
  EXPECT_THAT(Commands(c.host(1).Get(200).log), ElementsAre());
  EXPECT_FALSE(c.host(2).Exists(100));
}

TEST(MigratorInventoryTest, AMoveOfAnEndpointClaimedElsewhereIsRefused) {
  testing::Etcd etcd;
  Cluster c("inv-claimed", etcd.url());
  Topology(c);
  // Another host's move of the same endpoint (a restore of its checkpoint,
  // say) holds the claim.
  v1::MoveClaim other;
  other.set_subject("endpoint/ep100");
  other.set_migration_id("elsewhere-1");
  other.set_kind("restore");
  other.set_source("h3");
  other.set_destination("h3");
  ASSERT_TRUE(c[3].inventory->Claim(other).ok());
  MoveRun run = Migrate(c, 100, "h2");
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(std::string(run.status.message()),
              HasSubstr("endpoint/ep100 is being moved already: restore elsewhere-1 from h3"));
  EXPECT_THAT(Commands(c.host(1).Get(100).log), ElementsAre());
  // Once that move is over, this one goes.
  ASSERT_TRUE(c[3].inventory->Unclaim("endpoint/ep100", "elsewhere-1").ok());
  run = Migrate(c, 100, "h2");
  EXPECT_TRUE(run.status.ok()) << run.status;
}

TEST(MigratorInventoryTest, AGuestMovingToOneHostIsNotTakenInByAnotherUntilItArrives) {
  testing::Etcd etcd;
  Cluster c("inv-guest", etcd.url());
  for (int n : {2, 3}) {
    c[n].guest_nics = 2;
    c.Stop(n);
    c.Start(n);
  }
  v1::AllocateGuestNicRequest a;
  a.set_domain("vm-a");
  absl::StatusOr<v1::GuestNic> to2 = c.m(2).AllocateGuestNic(a);
  ASSERT_TRUE(to2.ok()) << to2.status();
  // A second operator's move of vm-a to h3, while the first is in flight.
  absl::StatusOr<v1::GuestNic> to3 = c.m(3).AllocateGuestNic(a);
  EXPECT_EQ(to3.status().code(), absl::StatusCode::kFailedPrecondition) << to3.status();
  EXPECT_THAT(std::string(to3.status().message()),
              HasSubstr("guest/vm-a is being moved already: vm-migrate"));
  EXPECT_EQ(c.m(3).GetHostInfo().guest_nics().in_use(), 0u);
  EXPECT_EQ(c.m(1).Status(true).cluster_moves_size(), 1);
  // The guest arrives on h2 (its hook says so): the move is over.
  v1::GuestEventRequest started;
  started.set_domain("vm-a");
  started.set_event("started");
  started.set_mac(to2->mac());
  ASSERT_TRUE(c.m(2).GuestEvent(started).ok());
  EXPECT_EQ(c.m(1).Status(true).cluster_moves_size(), 0);
  // A move that fails gives its NIC back, and the claim with it.
  v1::AllocateGuestNicRequest b;
  b.set_domain("vm-b");
  absl::StatusOr<v1::GuestNic> b2 = c.m(2).AllocateGuestNic(b);
  ASSERT_TRUE(b2.ok()) << b2.status();
  v1::GuestEventRequest stopped;
  stopped.set_domain("vm-b");
  stopped.set_event("stopped");
  ASSERT_TRUE(c.m(2).GuestEvent(stopped).ok());
  EXPECT_TRUE(c.m(3).AllocateGuestNic(b).ok());
}

}  // namespace
}  // namespace rdmavirt::migrator
