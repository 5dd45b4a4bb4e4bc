#include "tests/fuzz/migrator_fixture.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "tests/fuzz/fuzz_util.h"

namespace rdmavirt::fuzz {
namespace {

using migrator::testing::FakeQp;
using migrator::testing::Gid;

// Implements nothing: every call on it ends UNIMPLEMENTED, at once.
class Unimplemented final : public v1::Transfer::Service {};

grpc::Server& DeadEnd() {
  static grpc::Server* server = [] {
    grpc::ServerBuilder b;
    b.RegisterService(new Unimplemented);  // lives as long as the server
    std::unique_ptr<grpc::Server> s = b.BuildAndStart();
    Check(s != nullptr, "starting an in-process gRPC server");
    return s.release();
  }();
  return *server;
}

}  // namespace

std::string MigratorFixture::VirtualGid(int n) {
  std::string g(16, '\0');
  g[0] = static_cast<char>(0xfe);
  g[1] = static_cast<char>(0x80);
  g[15] = static_cast<char>(n);
  return g;
}

MigratorFixture::MigratorFixture(const std::string& state_dir) {
  host_.Add(kPid, VirtualGid(1), {FakeQp{11, 2, VirtualGid(2), 21, Gid(kHost)}});
  host_.Add(kPeerPid, VirtualGid(2), {FakeQp{21, 2, VirtualGid(1), 11, Gid(kHost)}});
  host_.Add(kRemotePeerPid, VirtualGid(3), {FakeQp{31, 2, VirtualGid(9), 91, Gid(kOtherHost)}});
  migrator::Migrator::Options o;
  o.host_name = absl::StrCat("h", kHost);
  o.state_dir = state_dir;
  o.version = "fuzz";
  o.hello_timeout = absl::Milliseconds(20);
  o.close_timeout = absl::Milliseconds(20);
  o.rpc_timeout = absl::Seconds(2);
  o.transfer_timeout = absl::Seconds(2);
  o.drain_timeout_ms = 5;
  o.locate_peer = [](const std::string& gid) -> std::string {
    if (gid == Gid(kHost)) return "";
    return absl::StrCat("h", static_cast<int>(gid.size() == 16 ? gid[15] : 0), ":7700");
  };
  o.connect = [](const std::string&) -> std::unique_ptr<v1::Transfer::StubInterface> {
    return v1::Transfer::NewStub(DeadEnd().InProcessChannel(grpc::ChannelArguments()));
  };
  o.list_devices = [] {
    v1::RdmaDevice d;
    d.set_name("fake0");
    v1::RdmaPort* p = d.add_ports();
    p->set_port_num(1);
    p->set_state("ACTIVE");
    return std::vector<v1::RdmaDevice>{d};
  };
  o.guest_nic_bridge = "br0";
  o.guest_nic_first = "10.9.2.1/16";
  o.guest_nic_capacity = 4;
  o.addresses = &host_;
  o.shims_return_within = absl::ZeroDuration();  // the fake host's shims never left
  migrator_ = std::make_unique<migrator::Migrator>(o, &host_, &host_, &host_);
  // As the daemon does at start: until then, a step of an unknown move
  // waits for it.
  migrator_->Recover();
}

}  // namespace rdmavirt::fuzz
