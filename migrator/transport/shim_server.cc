#include "migrator/transport/shim_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "migrator/host/containers.h"
#include "migrator/host/log.h"
#include "migrator/transport/frame.h"

namespace rdmavirt::migrator {

struct ShimServer::Conn {
  explicit Conn(int fd) : fd(fd) {}
  ~Conn() { close(fd); }
  const int fd;
  ucred cred{};
  ShimInfo info;
  absl::Mutex call_mu;  // one request at a time on this connection
  // Guarded by the server's mu_ (every access is in a ShimServer method
  // that holds it). Not ABSL_GUARDED_BY: the analysis cannot name another
  // object's lock from a member of this struct.
  bool closed = false;
  uint64_t waiting_id = 0;
  std::optional<v1::Reply> reply;
};

namespace {

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void SetReceiveTimeout(int fd, absl::Duration d) {
  timeval tv = absl::ToTimeval(d);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

}  // namespace

std::string ResumeMarkerName(pid_t pid) {
  // The shim's own view (control.cc): its pid namespace's inode, and its
  // pid in there, the innermost of NSpid.
  struct stat ns;
  const uint64_t inode =
      stat(absl::StrCat("/proc/", pid, "/ns/pid").c_str(), &ns) == 0 ? ns.st_ino : 0;
  const pid_t inner = InnermostPid(pid);
  return absl::StrCat(inode, "-", inner > 0 ? inner : pid);
}

absl::StatusOr<std::unique_ptr<ShimServer>> ShimServer::Start(Options options) {
  const std::string dir = Dirname(options.socket_path);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating ", dir, ": ", ec.message()));
  std::filesystem::create_directories(dir + "/resume", ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating ", dir, "/resume: ", ec.message()));

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.socket_path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", options.socket_path));
  memcpy(addr.sun_path, options.socket_path.c_str(), options.socket_path.size() + 1);

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket(AF_UNIX)");
  // A socket file left by a migrator that died: replace it, unless one
  // still answers there.
  struct stat st;
  if (lstat(options.socket_path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat(options.socket_path, " exists and is not a socket"));
    }
    const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live =
        probe >= 0 && connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) close(probe);
    if (live) {
      close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat("another migrator listens on ", options.socket_path));
    }
    unlink(options.socket_path.c_str());
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("bind ", options.socket_path, ": ", strerror(err)));
  }
  // Anyone may connect; SO_PEERCRED decides who is admitted.
  chmod(options.socket_path.c_str(), 0666);
  if (listen(fd, 64) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("listen: ", strerror(err)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    close(fd);
    return absl::ErrnoToStatus(errno, "eventfd");
  }
  std::unique_ptr<ShimServer> server(new ShimServer(std::move(options), fd, wake));
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

ShimServer::ShimServer(Options options, int listen_fd, int wake_fd)
    : options_(std::move(options)),
      resume_dir_(Dirname(options_.socket_path) + "/resume"),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd) {}

ShimServer::~ShimServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (const auto& c : all_) shutdown(c->fd, SHUT_RDWR);
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  acceptor_.join();
  std::vector<std::unique_ptr<Reader>> readers;
  {
    absl::MutexLock lock(&mu_);
    readers.swap(readers_);
  }
  for (auto& r : readers) r->thread.join();
  close(listen_fd_);
  close(wake_fd_);
  unlink(options_.socket_path.c_str());
}

void ShimServer::ReapReaders() {
  for (auto it = readers_.begin(); it != readers_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      it = readers_.erase(it);
    } else {
      ++it;
    }
  }
}

void ShimServer::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      Log("shim socket: poll: %s", strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
        Log("shim socket: accept: %s", strerror(errno));
      continue;
    }
    auto conn = std::make_shared<Conn>(fd);
    absl::MutexLock lock(&mu_);
    if (stopping_) return;  // conn closes with its last reference
    ReapReaders();
    all_.push_back(conn);
    auto reader = std::make_unique<Reader>();
    Reader* r = reader.get();
    r->thread = std::thread([this, conn, r] { Serve(conn, r); });
    readers_.push_back(std::move(reader));
  }
}

bool ShimServer::Admit(Conn* c) {
  socklen_t len = sizeof(c->cred);
  if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) != 0) {
    Log("shim socket: refused a connection: SO_PEERCRED: %s", strerror(errno));
    return false;
  }
  const std::string who = absl::StrCat("pid ", c->cred.pid, " uid ", c->cred.uid);
  SetReceiveTimeout(c->fd, options_.hello_timeout);
  absl::StatusOr<std::string> frame = ReadFrame(c->fd);
  SetReceiveTimeout(c->fd, absl::ZeroDuration());
  if (!frame.ok()) {
    Log("shim socket: refused %s: no Hello: %s", who, frame.status().ToString());
    return false;
  }
  v1::ShimToMigrator msg;
  if (!msg.ParseFromString(*frame)) {
    Log("shim socket: refused %s: its first message does not parse", who);
    return false;
  }
  if (!msg.has_hello() || msg.request_id() != 0) {
    Log("shim socket: refused %s: its first message is not a Hello", who);
    return false;
  }
  const v1::Hello& h = msg.hello();
  if (h.version() != v1::CONTROL_VERSION_V1) {
    Log("shim socket: refused %s: control protocol version %d (this migrator speaks %d)", who,
        static_cast<int>(h.version()), static_cast<int>(v1::CONTROL_VERSION_V1));
    return false;
  }
  // A process in a pid namespace of its own (a container's) knows its
  // pid there only.
  if (h.pid() != c->cred.pid && (h.pid() <= 0 || h.pid() != InnermostPid(c->cred.pid))) {
    Log("shim socket: refused %s: its Hello speaks for pid %d", who, h.pid());
    return false;
  }
  if (c->cred.uid != 0 && c->cred.uid != geteuid()) {
    Log("shim socket: refused %s: only root or uid %d may be migrated by this migrator", who,
        static_cast<int>(geteuid()));
    return false;
  }
  if (h.phase() != v1::ENDPOINT_PHASE_RUNNING && h.phase() != v1::ENDPOINT_PHASE_RELEASED) {
    Log("shim socket: refused %s: Hello without a phase", who);
    return false;
  }
  if (h.endpoint_id().empty() || h.endpoint_id().size() > 256 || h.program().size() > 256) {
    Log("shim socket: refused %s: Hello with a malformed endpoint id or program", who);
    return false;
  }
  c->info.pid = c->cred.pid;
  if (h.pid() != c->cred.pid) {
    Log("shim socket: %s is pid %d in its own pid namespace", who, h.pid());
  }
  c->info.endpoint_id = h.endpoint_id();
  c->info.program = h.program();
  c->info.phase = h.phase();
  return true;
}

void ShimServer::Serve(std::shared_ptr<Conn> c, Reader* reader) {
  if (!Admit(c.get())) {
    ++refused_;
    shutdown(c->fd, SHUT_RDWR);
    absl::MutexLock lock(&mu_);
    c->closed = true;
    std::erase(all_, c);
    reader->done = true;
    return;
  }
  ++admitted_;
  Log("shim: pid %d (%s, endpoint %s) connected, %s", c->info.pid, c->info.program,
      c->info.endpoint_id, v1::EndpointPhase_Name(c->info.phase));
  {
    absl::MutexLock lock(&mu_);
    auto& slot = by_pid_[c->info.pid];
    // The same process again (it reconnects after a release, or after
    // our restart): the newest connection speaks for it.
    if (slot != nullptr) shutdown(slot->fd, SHUT_RDWR);
    slot = c;
  }
  std::string why;
  for (;;) {
    absl::StatusOr<std::string> frame = ReadFrame(c->fd);
    if (!frame.ok()) {
      if (!absl::IsOutOfRange(frame.status())) why = frame.status().ToString();
      break;
    }
    v1::ShimToMigrator msg;
    if (!msg.ParseFromString(*frame) || !msg.has_reply()) {
      why = msg.has_hello() ? "a second Hello" : "a message that is not a reply";
      break;
    }
    absl::MutexLock lock(&mu_);
    // The phase its Hello gave changes with the steps (a restored process
    // says RELEASED, then runs): every reply carries the current one.
    if (msg.reply().has_summary() &&
        msg.reply().summary().phase() != v1::ENDPOINT_PHASE_UNSPECIFIED)
      c->info.phase = msg.reply().summary().phase();
    // The shim says its pid as it sees it; the migrator speaks of it by
    // its pid here.
    if (msg.reply().has_summary()) msg.mutable_reply()->mutable_summary()->set_pid(c->info.pid);
    if (msg.request_id() != 0 && msg.request_id() == c->waiting_id) {
      c->reply = std::move(*msg.mutable_reply());
      c->waiting_id = 0;
    } else {
      Log("shim: pid %d: dropped a reply to request %d, not the one awaited", c->info.pid,
          static_cast<int>(msg.request_id()));
    }
  }
  if (why.empty()) {
    Log("shim: pid %d disconnected", c->info.pid);
  } else {
    Log("shim: pid %d: closing its connection: %s", c->info.pid, why);
  }
  shutdown(c->fd, SHUT_RDWR);
  absl::MutexLock lock(&mu_);
  c->closed = true;
  auto it = by_pid_.find(c->info.pid);
  if (it != by_pid_.end() && it->second == c) by_pid_.erase(it);
  std::erase(all_, c);
  reader->done = true;
}

std::vector<ShimInfo> ShimServer::Connected() {
  absl::MutexLock lock(&mu_);
  std::vector<ShimInfo> out;
  for (const auto& [pid, c] : by_pid_) out.push_back(c->info);
  return out;
}

absl::StatusOr<v1::Reply> ShimServer::Call(pid_t pid, v1::MigratorToShim request,
                                           absl::Duration timeout) {
  std::shared_ptr<Conn> c;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_pid_.find(pid);
    if (it == by_pid_.end())
      return absl::NotFoundError(absl::StrCat("no shim of process ", pid, " is connected"));
    c = it->second;
  }
  absl::MutexLock call(&c->call_mu);
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (c->closed)
      return absl::UnavailableError(absl::StrCat("the shim of process ", pid, " disconnected"));
    id = ++next_request_id_;
    c->waiting_id = id;
    c->reply.reset();
  }
  request.set_request_id(id);
  if (absl::Status st = WriteFrame(c->fd, request.SerializeAsString()); !st.ok()) {
    absl::MutexLock lock(&mu_);
    c->waiting_id = 0;
    return absl::UnavailableError(
        absl::StrCat("sending to the shim of process ", pid, ": ", st.message()));
  }
  absl::MutexLock lock(&mu_);
  Conn* raw = c.get();
  const bool done =
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](Conn* c) { return c->reply.has_value() || c->closed; }, raw),
                           timeout);
  if (c->reply.has_value()) {
    v1::Reply reply = std::move(*c->reply);
    c->reply.reset();
    return reply;
  }
  c->waiting_id = 0;
  if (!done)
    return absl::DeadlineExceededError(absl::StrCat(
        "the shim of process ", pid, " did not answer within ", absl::FormatDuration(timeout)));
  return absl::UnavailableError(
      absl::StrCat("the shim of process ", pid, " disconnected before answering"));
}

absl::Status ShimServer::WaitClosed(pid_t pid, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  struct Arg {
    ShimServer* s;
    pid_t pid;
  } arg{this, pid};
  const bool ok = mu_.AwaitWithTimeout(
      absl::Condition(
          +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !a->s->by_pid_.contains(a->pid); },
          &arg),
      timeout);
  if (!ok)
    return absl::DeadlineExceededError(absl::StrCat("the shim of process ", pid,
                                                    " kept its connection open for ",
                                                    absl::FormatDuration(timeout)));
  return absl::OkStatus();
}

absl::StatusOr<ShimInfo> ShimServer::WaitHello(pid_t pid, v1::EndpointPhase phase,
                                               absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  struct Arg {
    ShimServer* s;
    pid_t pid;
    v1::EndpointPhase phase;
  } arg{this, pid, phase};
  const bool ok = mu_.AwaitWithTimeout(absl::Condition(
                                           +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                             auto it = a->s->by_pid_.find(a->pid);
                                             return it != a->s->by_pid_.end() &&
                                                    it->second->info.phase == a->phase;
                                           },
                                           &arg),
                                       timeout);
  if (!ok)
    return absl::DeadlineExceededError(
        absl::StrCat("the shim of process ", pid, " did not say Hello (",
                     v1::EndpointPhase_Name(phase), ") within ", absl::FormatDuration(timeout)));
  return by_pid_[pid]->info;
}

absl::Status ShimServer::SetResumeMarker(pid_t pid, bool present) {
  const std::string path = absl::StrCat(resume_dir_, "/", ResumeMarkerName(pid));
  if (!present) {
    if (unlink(path.c_str()) != 0 && errno != ENOENT)
      return absl::ErrnoToStatus(errno, absl::StrCat("removing ", path));
    return absl::OkStatus();
  }
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("creating ", path));
  close(fd);
  return absl::OkStatus();
}

}  // namespace rdmavirt::migrator
