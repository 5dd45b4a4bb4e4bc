// What a shim sends the migrator, through the real server
// (migrator/transport/shim_server.cc: Admit's checks of the Hello, then the loop that
// parses replies; migrator/transport/frame.cc underneath): each input is one
// connection to a ShimServer listening in a scratch directory.
//
// Input: a first byte of options, then the bytes the "shim" writes before
// it closes its end. Option bit 0: a real Hello of this process goes first
// (shim/migration/control.cc EncodeHello, the shim's own encoder), so that the
// fuzzed bytes also reach the admitted connection's loop; bit 1: the Hello
// says RELEASED; bit 2 (with bit 0): the server sends a describe request
// (ShimServer::Call) that this shim reads with the shim's decoder and
// answers with a real reply after the fuzzed bytes.
//
// Properties: no crash, leak or undefined behaviour; the server closes
// every connection once its shim has closed (no reader left waiting); a
// real Hello is admitted; a Call ends with the reply to its own id or
// UNAVAILABLE, never another reply, never a timeout.
#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "migrator/transport/frame.h"
#include "migrator/transport/shim_server.h"
#include "rdmavirt/v1/control.pb.h"
#include "shim/migration/control.h"
#include "tests/fuzz/fuzz_util.h"

namespace rdmavirt::fuzz {
namespace {

constexpr absl::Duration kCallTimeout = absl::Seconds(10);
constexpr int kSocketTimeoutSeconds = 10;

struct Server {
  ScratchDir dir{"shim_server"};
  std::unique_ptr<migrator::ShimServer> server;
};

Server& TheServer() {
  static Server* s = [] {
    auto* s = new Server;
    migrator::ShimServer::Options o;
    o.socket_path = s->dir.path() + "/migratord.sock";
    o.hello_timeout = absl::Seconds(kSocketTimeoutSeconds);
    absl::StatusOr<std::unique_ptr<migrator::ShimServer>> started = migrator::ShimServer::Start(o);
    Check(started.ok(), "ShimServer::Start in a scratch directory");
    s->server = *std::move(started);
    return s;
  }();
  return *s;
}

int Connect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  Check(fd >= 0, "socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  Check(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0,
        "connecting to the ShimServer");
  timeval tv{kSocketTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

// The server may close first (a refusal): what it did not read is lost.
void Send(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's SIGALRM
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

std::string Framed(const std::string& payload) { return JoinMessages({payload}); }

// Waits until the server has counted the connection and dropped it.
void WaitSettled(migrator::ShimServer& s, int before) {
  const absl::Time deadline = absl::Now() + absl::Seconds(kSocketTimeoutSeconds);
  while (s.admitted() + s.refused() == before || !s.Connected().empty()) {
    Check(absl::Now() < deadline, "the server kept a closed shim's connection");
    absl::SleepFor(absl::Microseconds(50));
  }
}

// Bit 2: a describe request answered after the fuzzed bytes.
void CallAndAnswer(migrator::ShimServer& s, int fd, std::string_view fuzzed) {
  const absl::Time deadline = absl::Now() + absl::Seconds(kSocketTimeoutSeconds);
  while (s.Connected().empty()) {
    Check(absl::Now() < deadline, "a real shim's Hello was not admitted");
    absl::SleepFor(absl::Microseconds(50));
  }
  absl::StatusOr<v1::Reply> result;
  std::thread call([&] {
    v1::MigratorToShim describe;
    describe.mutable_describe();
    result = s.Call(getpid(), describe, kCallTimeout);
  });
  absl::StatusOr<std::string> request = migrator::ReadFrame(fd);
  Check(request.ok(), "the shim did not receive the server's request");
  shim::ControlRequest req;
  std::string why;
  Check(shim::DecodeRequest(*request, &req, &why), "the shim cannot decode the server's request");
  Check(req.kind == shim::ControlRequest::Kind::kDescribe, "the server sent another command");
  Send(fd, fuzzed);
  shim::EndpointView view;
  view.device = "fake0";
  Send(fd, Framed(shim::EncodeReply(req.id, {}, view, "fuzz-endpoint", getpid(), 1, 0)));
  shutdown(fd, SHUT_WR);
  call.join();
  Check(result.ok() || absl::IsUnavailable(result.status()),
        "a Call that did not end with its reply or UNAVAILABLE");
}

}  // namespace
}  // namespace rdmavirt::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  rdmavirt::fuzz::TheServer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  migrator::ShimServer& s = *fuzz::TheServer().server;
  const uint8_t options = size > 0 ? data[0] : 0;
  const std::string_view fuzzed =
      size > 0 ? std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1) : "";
  const bool hello = options & 1;
  const int admitted = s.admitted();
  const int before = admitted + s.refused();
  const int fd = fuzz::Connect(fuzz::TheServer().dir.path() + "/migratord.sock");
  if (hello)
    fuzz::Send(fd, fuzz::Framed(shim::EncodeHello(getpid(), "fuzz-endpoint", options & 2, "fuzz")));
  if (hello && (options & 4)) {
    fuzz::CallAndAnswer(s, fd, fuzzed);
  } else {
    fuzz::Send(fd, fuzzed);
    shutdown(fd, SHUT_WR);
  }
  // The server closes its end once it has read ours to the end.
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0 || (n < 0 && errno == EINTR)) {
  }
  // ECONNRESET: it closed with bytes of ours unread (a refusal).
  fuzz::Check(n == 0 || errno == ECONNRESET,
              std::string("the server did not close a connection whose shim had closed: ") +
                  (n > 0 ? "it sent more" : strerror(errno)));
  close(fd);
  fuzz::WaitSettled(s, before);
  if (hello) fuzz::Check(s.admitted() == admitted + 1, "a real shim's Hello was refused");
  return 0;
}
