#include "migrator/process_control.h"

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rdmavirt::migrator {
namespace {

// The state letter of /proc/PID/stat ('T' stopped, 'Z' zombie); 0 if gone.
char State(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return 0;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return 0;
  return line[paren + 2];
}

class RealProcessControl final : public ProcessControl {
 public:
  bool Exists(pid_t pid) override {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    const char s = State(pid);
    return s != 0 && s != 'Z' && s != 'X';
  }

  absl::Status Stop(pid_t pid) override {
    if (kill(pid, SIGSTOP) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("SIGSTOP ", pid));
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (State(pid) != 'T' && State(pid) != 't') {
      if (absl::Now() > deadline)
        return absl::DeadlineExceededError(absl::StrCat("process ", pid, " did not stop"));
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::OkStatus();
  }

  absl::Status Continue(pid_t pid) override {
    if (kill(pid, SIGCONT) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("SIGCONT ", pid));
    return absl::OkStatus();
  }

  absl::Status Kill(pid_t pid) override {
    if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("no pid ", pid));
    if (kill(pid, SIGKILL) != 0) {
      if (errno == ESRCH) return absl::OkStatus();
      return absl::ErrnoToStatus(errno, absl::StrCat("SIGKILL ", pid));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Exists(pid)) {
      // Our own child (a test's, or a restore that stayed attached).
      waitpid(pid, nullptr, WNOHANG);
      if (absl::Now() > deadline)
        return absl::DeadlineExceededError(absl::StrCat("process ", pid, " did not die"));
      absl::SleepFor(absl::Milliseconds(2));
    }
    waitpid(pid, nullptr, WNOHANG);
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<ProcessControl> NewProcessControl() {
  return std::make_unique<RealProcessControl>();
}

}  // namespace rdmavirt::migrator
