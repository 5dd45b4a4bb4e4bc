// Checkpointer over CriuDriver: a driver per call, since a driver serves
// one call at a time and moves of different processes run concurrently.
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <thread>

#include "absl/strings/str_cat.h"
#include "migrator/criu/checkpointer.h"
#include "migrator/criu/criu_driver.h"
#include "migrator/criu/criu_images.h"
#include "migrator/host/log.h"

namespace rdmavirt::migrator {
namespace {

bool Succeeded(int wait_status) { return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0; }

std::string DescribeStatus(int wait_status) {
  if (WIFSIGNALED(wait_status)) return absl::StrCat("killed by signal ", WTERMSIG(wait_status));
  return absl::StrCat("exit status ", WEXITSTATUS(wait_status));
}

class CriuCheckpointer final : public Checkpointer {
 public:
  CriuCheckpointer(std::string log_dir, std::string tls_dir)
      : log_dir_(std::move(log_dir)), tls_dir_(std::move(tls_dir)) {}

  absl::Status Check() override { return CriuDriver(log_dir_).Check(); }

  absl::StatusOr<DumpStats> PreDump(pid_t pid, const std::string& dir,
                                    const std::string& parent) override {
    absl::StatusOr<CriuResult> r = CriuDriver(log_dir_).PreDump(pid, dir, parent);
    if (!r.ok()) return r.status();
    return DumpStats{r->elapsed_us, r->image_bytes};
  }

  absl::StatusOr<DumpStats> Dump(pid_t pid, const std::string& dir, const std::string& parent,
                                 bool leave_running, bool tcp_established) override {
    absl::StatusOr<CriuResult> r =
        CriuDriver(log_dir_).Dump(pid, dir, parent, leave_running, tcp_established);
    if (!r.ok()) return r.status();
    return DumpStats{r->elapsed_us, r->image_bytes};
  }

  absl::StatusOr<DumpStats> LazyDump(
      pid_t pid, const std::string& dir, const std::string& parent, bool tcp_established,
      const LazyPages& serve, const std::function<void(const PostCopyHelper&)>& written) override {
    absl::StatusOr<CriuResult> r =
        CriuDriver(log_dir_).LazyDump(pid, dir, parent, tcp_established, serve, tls_dir_, written);
    if (!r.ok()) return r.status();
    return DumpStats{r->elapsed_us, r->image_bytes};
  }

  void CancelLazyDump(const LazyPages& serve) override { CriuDriver::CancelLazyDump(serve); }

  absl::StatusOr<pid_t> Restore(const std::string& dir, bool tcp_established, bool new_terminal,
                                const LazyPages* lazy_from, PostCopyHelper* helper) override {
    if (lazy_from != nullptr) {
      if (new_terminal)
        return absl::FailedPreconditionError(
            "a process that held a terminal cannot be restored with post-copy");
      absl::StatusOr<LazyRestored> r =
          CriuDriver(log_dir_).LazyRestore(dir, tcp_established, *lazy_from, tls_dir_);
      if (!r.ok()) return r.status();
      // A daemon that died during the restore leaves a process whose
      // pages cannot all come: killed, and the restore failed (the source
      // still has its copy).
      int status = 0;
      const bool ended = waitpid(r->pages_daemon, &status, WNOHANG) == r->pages_daemon;
      if (ended && !Succeeded(status)) {
        kill(r->pid, SIGKILL);
        return absl::UnavailableError(
            absl::StrCat("CRIU's lazy-pages daemon ended (", DescribeStatus(status),
                         ") before the restore with post-copy returned; the restored process ",
                         r->pid, " is killed (", r->daemon_log, ")"));
      }
      if (helper != nullptr) *helper = PostCopyHelper{r->pages_daemon, r->daemon_status};
      if (ended) {
        Log("process %d: post-copy done, every page is in", r->pid);
        return r->pid;
      }
      // The daemon fills the pages the process has not touched yet; a
      // process whose pages cannot all come is lost, and killed rather
      // than left to fault on the missing ones.
      std::thread([r = *r] {
        int status = 0;
        while (waitpid(r.pages_daemon, &status, 0) < 0 && errno == EINTR) {
        }
        if (Succeeded(status)) {
          Log("process %d: post-copy done, every page is in", r.pid);
          return;
        }
        Log("process %d: post-copy failed (CRIU's lazy-pages daemon: %s, %s); the process is "
            "killed: its pages cannot all come",
            r.pid, DescribeStatus(status), r.daemon_log);
        kill(r.pid, SIGKILL);
      }).detach();
      return r->pid;
    }
    std::string terminal_log;
    absl::StatusOr<pid_t> pid =
        CriuDriver(log_dir_).Restore(dir, tcp_established, new_terminal, &terminal_log);
    if (pid.ok() && !terminal_log.empty())
      Log("process %d: restored with a new terminal; its output goes to %s", *pid, terminal_log);
    return pid;
  }

  absl::StatusOr<std::vector<pid_t>> DumpedPids(const std::string& dir) override {
    return DumpedTreePids(dir);
  }

 private:
  const std::string log_dir_;
  const std::string tls_dir_;
};

}  // namespace

std::unique_ptr<Checkpointer> NewCriuCheckpointer(const std::string& log_dir,
                                                  const std::string& tls_dir) {
  return std::make_unique<CriuCheckpointer>(log_dir, tls_dir);
}

}  // namespace rdmavirt::migrator
