// What the commands of rdmavirtctl share: exit codes, JSON output and a
// client of a host's rdmavirt-migratord (Operator service, mutual TLS).
// A Client is used from one thread at a time (the CLI's main thread); its
// failures are said on stderr and returned as exit codes.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_CLI_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_CLI_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"

namespace rdmavirt::ctl {

inline constexpr int kOk = 0, kFailed = 1, kUsage = 2, kUnreachable = 3;

// Indented, with the protos' field names.
std::string Json(const google::protobuf::Message& m);

// `m` on stdout: its Json with `json`, else as `text` shows it.
template <typename M>
void Show(bool json, const M& m, std::string (*text)(const M&)) {
  printf("%s", json ? (Json(m) + "\n").c_str() : text(m).c_str());
}

// Microseconds from `t` to now, for the reports' step times.
uint64_t MicrosSince(absl::Time t);

class Client {
 public:
  Client(std::string tls_dir, std::string target)
      : tls_dir_(std::move(tls_dir)), target_(std::move(target)) {}

  // kOk, or kUnreachable after saying why (on stderr).
  int Connect();
  v1::Operator::Stub* stub() { return stub_.get(); }
  // A unary RPC of the Operator service (&v1::Operator::Stub::Status, ...).
  template <typename Request, typename Response>
  using Rpc = grpc::Status (v1::Operator::Stub::*)(grpc::ClientContext*, const Request&, Response*);
  // Calls `rpc` after Connect; with `deadline_s` > 0 it gives up (with
  // DEADLINE_EXCEEDED) that many seconds from now.
  template <typename Request, typename Response>
  grpc::Status Call(Rpc<Request, Response> rpc, const Request& request, Response* response,
                    int deadline_s = 0) {
    grpc::ClientContext ctx;
    if (deadline_s > 0)
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
    return (stub_.get()->*rpc)(&ctx, request, response);
  }
  const std::string& target() const { return target_; }
  // A failed RPC, said on stderr: kFailed, or kUnreachable when the daemon
  // went away.
  int Failed(const char* what, const grpc::Status& st);
  static const char* CodeName(grpc::StatusCode c);

 private:
  const std::string tls_dir_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Operator::Stub> stub_;
};

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_CLI_H_
