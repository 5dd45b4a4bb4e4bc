// ShimServer: the migrator's end of the shim control protocol over a Unix
// socket (protos/rdmavirt/v1/control.proto).
//
// A shim connects and says Hello; the server admits it only when the
// socket's peer credentials (SO_PEERCRED) are those of the process the
// Hello names and its uid is root or the migrator's own, and the Hello is
// well formed and of a version it speaks. The Hello names the process as
// it sees itself: a process in a pid namespace of its own (a container's)
// gives its pid there, which must be the innermost of the peer's pids
// (NSpid in /proc/PID/status). The server knows every shim by its pid in
// the migrator's namespace, and gives that pid in the summaries the shim
// replies with. Anything else (a frame over 16 MiB, a truncated or
// unparsable frame, a wrong version, a pid mismatch) closes the
// connection, with the reason in the log.
//
// One thread accepts, one thread per connection reads; Call() may be used
// from any thread. Resume markers live in DIR/resume/NAME (ResumeMarkerName), DIR being the
// socket's directory.
#ifndef RDMAVIRT_MIGRATOR_TRANSPORT_SHIM_SERVER_H_
#define RDMAVIRT_MIGRATOR_TRANSPORT_SHIM_SERVER_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "migrator/transport/shim_channel.h"

namespace rdmavirt::migrator {

// The name of the resume marker that the released shim of `pid` (a pid of
// this host) waits for: its pid namespace's inode and its pid in there,
// "4026531836-1234" (a process in a container is pid 1 of its own).
std::string ResumeMarkerName(pid_t pid);

class ShimServer final : public ShimChannel {
 public:
  struct Options {
    std::string socket_path = "/run/rdmavirt/migratord.sock";
    // How long a new connection may take to say Hello.
    absl::Duration hello_timeout = absl::Seconds(5);
  };

  // Creates the socket's directory and DIR/resume, replaces a stale socket
  // file, listens, and starts accepting. UNAVAILABLE when the socket cannot
  // be bound (another migrator listens there: FAILED_PRECONDITION).
  static absl::StatusOr<std::unique_ptr<ShimServer>> Start(Options options);

  // Stops accepting, closes every connection, joins every thread.
  ~ShimServer() override;

  ShimServer(const ShimServer&) = delete;
  ShimServer& operator=(const ShimServer&) = delete;

  const std::string& resume_dir() const { return resume_dir_; }

  std::vector<ShimInfo> Connected() override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::Reply> Call(pid_t pid, v1::MigratorToShim request,
                                 absl::Duration timeout) override;
  absl::Status WaitClosed(pid_t pid, absl::Duration timeout) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ShimInfo> WaitHello(pid_t pid, v1::EndpointPhase phase,
                                     absl::Duration timeout) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetResumeMarker(pid_t pid, bool present) override;

  // Connections admitted and refused so far (tests, logs).
  int admitted() const { return admitted_.load(); }
  int refused() const { return refused_.load(); }

 private:
  struct Conn;
  struct Reader {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  ShimServer(Options options, int listen_fd, int wake_fd);
  void AcceptLoop() ABSL_LOCKS_EXCLUDED(mu_);
  void Serve(std::shared_ptr<Conn> conn, Reader* reader) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads and checks the Hello; false (with the reason logged) to refuse.
  bool Admit(Conn* conn);
  void ReapReaders() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const std::string resume_dir_;
  const int listen_fd_;
  const int wake_fd_;  // eventfd: wakes the accept loop to stop
  std::thread acceptor_;
  std::atomic<int> admitted_{0};
  std::atomic<int> refused_{0};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_request_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<pid_t, std::shared_ptr<Conn>> by_pid_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Conn>> all_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Reader>> readers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_TRANSPORT_SHIM_SERVER_H_
