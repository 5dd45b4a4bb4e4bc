// Checkpointer: the CRIU operations a migration needs, behind an interface
// so that the orchestration can be tested with a fake (a real dump needs a
// kernel with CRIU support). NewCriuCheckpointer() wraps CriuDriver
// (criu_driver.h). Implementations are safe for concurrent use on
// different processes.
#ifndef RDMAVIRT_MIGRATOR_CHECKPOINTER_H_
#define RDMAVIRT_MIGRATOR_CHECKPOINTER_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmavirt::migrator {

struct DumpStats {
  uint64_t elapsed_us = 0;
  uint64_t image_bytes = 0;
};

class Checkpointer {
 public:
  virtual ~Checkpointer() = default;
  // Whether dumps and restores work on this host (`criu check`);
  // FAILED_PRECONDITION with CRIU's reason when they do not.
  virtual absl::Status Check() = 0;
  // A pre-dump of memory into `dir` while the process runs; `parent` is ""
  // or the previous iteration's directory (absolute).
  virtual absl::StatusOr<DumpStats> PreDump(pid_t pid, const std::string& dir,
                                            const std::string& parent) = 0;
  // The final dump; the process keeps running when `leave_running`.
  // `tcp_established` dumps its established TCP connections (only when
  // their addresses move with it) instead of refusing them.
  virtual absl::StatusOr<DumpStats> Dump(pid_t pid, const std::string& dir,
                                         const std::string& parent, bool leave_running,
                                         bool tcp_established) = 0;
  // Restores the dump in `dir` (pre-dump parents reachable through its
  // `parent` link); the restored process is detached from the caller.
  // `tcp_established` as the dump had it. `new_terminal`: the tree held a
  // pseudo-terminal that stayed behind; its processes get a new one here,
  // in a session of their own, whose output goes to a log
  // (CriuDriver::Restore).
  virtual absl::StatusOr<pid_t> Restore(const std::string& dir, bool tcp_established,
                                        bool new_terminal) = 0;
};

// CRIU through CriuDriver; logs go to `log_dir`.
std::unique_ptr<Checkpointer> NewCriuCheckpointer(const std::string& log_dir);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CHECKPOINTER_H_
