// Certificates and keys given on the command line (--tls-dir): what
// rdmavirt-migratord and rdmavirtctl load (migrator/transport/tls.cc LoadTls) and
// hand to gRPC as mutual-TLS credentials (MutualTlsServerCredentials,
// MutualTlsChannelCredentials), used as main.cc uses them: a server
// listens with them and a client with them calls it, so that gRPC and
// OpenSSL parse the PEM and check the chain in a handshake.
//
// Input: messages (fuzz_util.h SplitMessages): ca.pem, host.pem, host.key.
// gRPC and OpenSSL are Debian's, not instrumented: coverage guides the
// fuzzer through LoadTls only; the rest is exercised, not explored.
//
// Properties: no crash, leak or undefined behaviour; LoadTls refuses with
// FAILED_PRECONDITION naming the file, and accepts only PEM-looking files;
// a server that cannot use the files does not start, rather than abort.
#include <stdlib.h>

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "grpcpp/grpcpp.h"
#include "migrator/transport/tls.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  setenv("GRPC_VERBOSITY", "NONE", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  using fuzz::Check;
  const std::vector<std::string_view> files = fuzz::SplitMessages(data, size, 3);
  fuzz::ScratchDir dir("tls_pem");
  const char* const names[] = {"ca.pem", "host.pem", "host.key"};
  for (size_t i = 0; i < files.size(); ++i) {
    std::ofstream out(dir.path() + "/" + names[i], std::ios::binary);
    out.write(files[i].data(), static_cast<std::streamsize>(files[i].size()));
  }
  absl::StatusOr<migrator::TlsFiles> tls = migrator::LoadTls(dir.path(), "host.pem", "host.key");
  if (!tls.ok()) {
    Check(absl::IsFailedPrecondition(tls.status()), "LoadTls: not FAILED_PRECONDITION");
    Check(absl::StrContains(tls.status().message(), dir.path()),
          "LoadTls: a refusal that does not name the file");
    return 0;
  }
  for (const std::string* pem : {&tls->ca, &tls->cert, &tls->key})
    Check(absl::StrContains(*pem, "-----BEGIN "), "LoadTls accepted a file that is not PEM");

  const std::string target = "unix:" + dir.path() + "/tls.sock";
  grpc::ServerBuilder b;
  int bound = 0;
  b.AddListeningPort(target, migrator::MutualTlsServerCredentials(*tls), &bound);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (server == nullptr) return 0;
  if (bound != 0) {
    // The lab's certificates name host1 (tools/rdmavirt-certs lab).
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("host1");
    auto stub = v1::Operator::NewStub(
        grpc::CreateCustomChannel(target, migrator::MutualTlsChannelCredentials(*tls), args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::HostInfo info;
    (void)stub->GetHostInfo(&ctx, v1::HostInfoRequest(), &info);
  }
  server->Shutdown(std::chrono::system_clock::now());
  return 0;
}
