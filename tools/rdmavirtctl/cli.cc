#include "tools/rdmavirtctl/cli.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/json_util.h"
#include "migrator/transport/certificates.h"
#include "migrator/transport/tls.h"

namespace rdmavirt::ctl {

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

uint64_t MicrosSince(absl::Time t) {
  return static_cast<uint64_t>(absl::ToInt64Microseconds(absl::Now() - t));
}

namespace {

// Why no TCP connection to `target` ("host:port", "[v6]:port") can be made
// within 5 s; "" when one can; nullopt for a target that is not host:port.
std::optional<std::string> TcpRefusal(const std::string& target) {
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos || colon == 0) return std::nullopt;
  std::string host = target.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), target.c_str() + colon + 1, &hints, &found); rc != 0)
    return absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int err = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p = {fd, POLLOUT, 0};
      socklen_t len = sizeof(err);
      if (poll(&p, 1, 5000) != 1)
        err = ETIMEDOUT;
      else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
        err = errno;
    }
    close(fd);
    if (err == 0) {
      freeaddrinfo(found);
      return std::string();
    }
    why = strerror(err);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace

int Client::Connect() {
  absl::StatusOr<migrator::TlsFiles> tls = migrator::LoadTls(tls_dir_, "cli.pem", "cli.key");
  if (!tls.ok()) {
    fprintf(stderr, "rdmavirtctl: %s\n", std::string(tls.status().message()).c_str());
    return kUnreachable;
  }
  // An expired certificate, or one of another CA, would only show as a
  // handshake that fails without a reason.
  if (absl::Status own = migrator::CheckOwnCertificate(*tls, tls_dir_ + "/cli.pem",
                                                       migrator::CertRole::kOperator, absl::Now());
      !own.ok()) {
    fprintf(stderr, "rdmavirtctl: %s\n", std::string(own.message()).c_str());
    return kUnreachable;
  }
  // No retry by gRPC itself, not even a "transparent" one: a move's RPC
  // must reach one migrator once. A Restore whose migrator was killed
  // mid-move was sent again to the restarted one, which then restored the
  // process a second time while finishing the first (its pid was taken).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  channel_ = grpc::CreateCustomChannel(target_, migrator::MutualTlsChannelCredentials(*tls), args);
  // 20 s: on a loaded TCG lab host a handshake may take over 10 s (a
  // refused one is reported after the same wait: gRPC tries again until
  // the deadline).
  if (!channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    const std::optional<std::string> tcp = TcpRefusal(target_);
    if (tcp.has_value() && tcp->empty())
      fprintf(stderr,
              "rdmavirtctl: cannot reach rdmavirt-migratord at %s: it accepts connections, but "
              "the TLS handshake did not complete within 20 s: it refused our certificate (is "
              "%s/cli.pem of its CA?), we refused its (is it signed by %s/ca.pem?), or its host "
              "is too loaded to answer in time\n",
              target_.c_str(), tls_dir_.c_str(), tls_dir_.c_str());
    else if (tcp.has_value())
      fprintf(stderr,
              "rdmavirtctl: cannot reach rdmavirt-migratord at %s: %s (is it running "
              "there?)\n",
              target_.c_str(), tcp->c_str());
    else
      fprintf(stderr,
              "rdmavirtctl: cannot reach rdmavirt-migratord at %s (is it running there, and "
              "are its certificates and those in %s of the same CA?)\n",
              target_.c_str(), tls_dir_.c_str());
    return kUnreachable;
  }
  stub_ = v1::Operator::NewStub(channel_);
  return kOk;
}

int Client::Failed(const char* what, const grpc::Status& st) {
  fprintf(stderr, "rdmavirtctl: %s: %s (%s)\n", what, st.error_message().c_str(),
          CodeName(st.error_code()));
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE &&
      channel_->GetState(false) != GRPC_CHANNEL_READY)
    return kUnreachable;
  return kFailed;
}

const char* Client::CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace rdmavirt::ctl
