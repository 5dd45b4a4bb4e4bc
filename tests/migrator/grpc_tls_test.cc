// The migrator's gRPC services over real TCP on 127.0.0.1 with mutual TLS:
// certificates from tools/rdmavirt-certs; a client with a certificate of
// the CA gets through, one without a certificate or with another CA's does
// not; a host's certificate does not open the Operator service, nor an
// operator's the Transfer service; an expired certificate is refused.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "migrator/move/migrator.h"
#include "migrator/transport/grpc_service.h"
#include "migrator/transport/tls.h"
#include "tests/migrator/fake_host.h"
#include "tests/migrator/test_certs.h"

namespace rdmavirt::migrator {
namespace {

std::string MakeCerts(const std::string& name) {
  const std::string dir = testing::MakeTestCerts(absl::StrCat("grpc-tls-", name));
  std::filesystem::copy_file(dir + "/host1.pem", dir + "/host.pem");
  std::filesystem::copy_file(dir + "/host1.key", dir + "/host.key");
  return dir;
}

class GrpcTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    certs_ = MakeCerts("a");
    other_ca_ = MakeCerts("b");
    absl::StatusOr<TlsFiles> tls = LoadTls(certs_, "host.pem", "host.key");
    ASSERT_TRUE(tls.ok()) << tls.status();
    Migrator::Options o;
    o.host_name = "tls-host";
    o.state_dir = certs_ + "/state";
    o.connect = [](const std::string&) { return nullptr; };
    o.list_devices = [] { return std::vector<v1::RdmaDevice>(); };
    o.shims_return_within = absl::ZeroDuration();
    migrator_ = std::make_unique<Migrator>(o, &host_, &host_, &host_);
    migrator_->Recover();  // as the daemon does: a step of an unknown move waits for it
    op_ = std::make_unique<OperatorService>(migrator_.get());
    transfer_ = std::make_unique<TransferService>(migrator_.get());
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", MutualTlsServerCredentials(*tls), &port_);
    b.RegisterService(op_.get());
    b.RegisterService(transfer_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    // The migrator's state directory is in certs_.
    op_.reset();
    transfer_.reset();
    migrator_.reset();
    testing::RemoveTestCerts(certs_);
    testing::RemoveTestCerts(other_ca_);
  }

  grpc::Status HostInfo(std::shared_ptr<grpc::ChannelCredentials> creds, v1::HostInfo* out) {
    auto stub =
        v1::Operator::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), creds));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub->GetHostInfo(&ctx, v1::HostInfoRequest(), out);
  }

  std::string certs_, other_ca_;
  testing::FakeHost host_{1};
  std::unique_ptr<Migrator> migrator_;
  std::unique_ptr<OperatorService> op_;
  std::unique_ptr<TransferService> transfer_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(GrpcTlsTest, ClientWithACertificateOfTheCaGetsThrough) {
  absl::StatusOr<TlsFiles> cli = LoadTls(certs_, "cli.pem", "cli.key");
  ASSERT_TRUE(cli.ok()) << cli.status();
  v1::HostInfo info;
  grpc::Status st = HostInfo(MutualTlsChannelCredentials(*cli), &info);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(info.hostname(), "tls-host");
  EXPECT_TRUE(info.criu_ok());
}

TEST_F(GrpcTlsTest, ClientWithoutACertificateIsRefused) {
  absl::StatusOr<TlsFiles> cli = LoadTls(certs_, "cli.pem", "cli.key");
  ASSERT_TRUE(cli.ok());
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = cli->ca;  // trusts the server, shows nothing
  v1::HostInfo info;
  grpc::Status st = HostInfo(grpc::SslCredentials(o), &info);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcTlsTest, ClientOfAnotherCaIsRefused) {
  absl::StatusOr<TlsFiles> other = LoadTls(other_ca_, "cli.pem", "cli.key");
  ASSERT_TRUE(other.ok());
  absl::StatusOr<TlsFiles> mine = LoadTls(certs_, "cli.pem", "cli.key");
  other->ca = mine->ca;  // trusts our server, but its certificate is not ours
  v1::HostInfo info;
  EXPECT_FALSE(HostInfo(MutualTlsChannelCredentials(*other), &info).ok());
}

TEST_F(GrpcTlsTest, PlaintextIsRefused) {
  v1::HostInfo info;
  EXPECT_FALSE(HostInfo(grpc::InsecureChannelCredentials(), &info).ok());
}

std::shared_ptr<grpc::ChannelCredentials> Creds(const std::string& dir, const std::string& name) {
  absl::StatusOr<TlsFiles> f = LoadTls(dir, name + ".pem", name + ".key");
  EXPECT_TRUE(f.ok()) << f.status();
  return MutualTlsChannelCredentials(f.ok() ? *f : TlsFiles());
}

TEST_F(GrpcTlsTest, AHostCertificateDoesNotOpenTheOperatorService) {
  v1::HostInfo info;
  grpc::Status st = HostInfo(Creds(certs_, "host1"), &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(),
            "the Operator service takes an operator's certificate (the CLI's) and CN=host1 is a "
            "host's");
  EXPECT_EQ(info.hostname(), "");
}

TEST_F(GrpcTlsTest, AnOperatorCertificateDoesNotOpenTheTransferService) {
  auto abort_as = [&](const std::string& who) {
    auto stub = v1::Transfer::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), Creds(certs_, who)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::AbortIncomingRequest req;
    req.set_migration_id("m-1");
    v1::AbortIncomingResponse out;
    return stub->AbortIncoming(&ctx, req, &out);
  };
  grpc::Status st = abort_as("cli");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(),
            "the Transfer service takes a host's certificate (a migrator's) and CN=cli is an "
            "operator's");
  // The same call with a host's certificate reaches the migrator (which
  // knows no such move).
  EXPECT_NE(abort_as("host1").error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(GrpcTlsTest, AnExpiredClientCertificateIsRefused) {
  v1::HostInfo info;
  grpc::Status st = HostInfo(Creds(certs_, "expired"), &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(info.hostname(), "");
}

TEST_F(GrpcTlsTest, ACertificateWithoutRoleIsRefused) {
  v1::HostInfo info;
  grpc::Status st = HostInfo(Creds(certs_, "noeku"), &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(),
            "CN=noeku has no extendedKeyUsage, so it is neither a host's "
            "nor an operator's");
}

TEST(TlsFilesTest, MissingFilesAreNamed) {
  absl::StatusOr<TlsFiles> f = LoadTls("/nonexistent-dir", "host.pem", "host.key");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(f.status().message().find("/nonexistent-dir/ca.pem"), std::string::npos);
}

}  // namespace
}  // namespace rdmavirt::migrator
