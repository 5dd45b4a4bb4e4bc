// Checkpointer over CriuDriver: a driver per call, since a driver serves
// one call at a time and moves of different processes run concurrently.
#include "migrator/checkpointer.h"
#include "migrator/criu_driver.h"
#include "migrator/log.h"

namespace rdmavirt::migrator {
namespace {

class CriuCheckpointer final : public Checkpointer {
 public:
  explicit CriuCheckpointer(std::string log_dir) : log_dir_(std::move(log_dir)) {}

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

  absl::StatusOr<pid_t> Restore(const std::string& dir, bool tcp_established,
                                bool new_terminal) override {
    std::string terminal_log;
    absl::StatusOr<pid_t> pid =
        CriuDriver(log_dir_).Restore(dir, tcp_established, new_terminal, &terminal_log);
    if (pid.ok() && !terminal_log.empty())
      Log("process %d: restored with a new terminal; its output goes to %s", *pid, terminal_log);
    return pid;
  }

 private:
  const std::string log_dir_;
};

}  // namespace

std::unique_ptr<Checkpointer> NewCriuCheckpointer(const std::string& log_dir) {
  return std::make_unique<CriuCheckpointer>(log_dir);
}

}  // namespace rdmavirt::migrator
