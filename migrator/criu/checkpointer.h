// Checkpointer: the CRIU operations a migration needs, behind an interface
// so that the orchestration can be tested with a fake (a real dump needs a
// kernel with CRIU support). NewCriuCheckpointer() wraps CriuDriver
// (criu_driver.h). Implementations are safe for concurrent use on
// different processes.
#ifndef RDMAVIRT_MIGRATOR_CRIU_CHECKPOINTER_H_
#define RDMAVIRT_MIGRATOR_CRIU_CHECKPOINTER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmavirt::migrator {

struct DumpStats {
  uint64_t elapsed_us = 0;
  uint64_t image_bytes = 0;
};

// Post-copy: where a lazy dump serves the pages it did not write (CRIU's
// page server, over CRIU's own mutual TLS with the host's certificate).
struct LazyPages {
  std::string address;  // the source's, as the destination reaches it
  int port = 0;
};

// Post-copy: the CRIU process that serves the last pages (a source's lazy
// dump) or takes them (a destination's lazy-pages daemon). It outlives a
// restart of the migrator, and writes its exit status to `status_file`
// when it ends ("0": every page went): the next run learns from there how
// the post-copy ended (SpawnFds::exit_status_file).
struct PostCopyHelper {
  pid_t pid = 0;
  std::string status_file;
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
  // The final dump of a post-copy move, of a stopped process: writes every
  // image but the memory pages not in `parent`'s chain, calls
  // `written(helper)` once those images are complete (`helper`: the CRIU
  // process serving the pages), then serves the pages at `serve` until the
  // destination's restore has taken them all, and only then returns. On an
  // error, before or after `written`, the process is left as it was.
  virtual absl::StatusOr<DumpStats> LazyDump(
      pid_t pid, const std::string& dir, const std::string& parent, bool tcp_established,
      const LazyPages& serve, const std::function<void(const PostCopyHelper&)>& written) = 0;
  // Ends a LazyDump of this host that waits for its destination at
  // `serve`: the dump fails.
  virtual void CancelLazyDump(const LazyPages& serve) = 0;
  // Restores the dump in `dir` (pre-dump parents reachable through its
  // `parent` link); the restored process is detached from the caller.
  // `tcp_established` as the dump had it. `new_terminal`: the tree held a
  // pseudo-terminal that stayed behind; its processes get a new one here,
  // in a session of their own, whose output goes to a log
  // (CriuDriver::Restore). `lazy_from`, if not null: the dump was a
  // LazyDump serving its pages there; they come in as the process touches
  // them, and the rest after, while it runs, taken by `*helper` (filled
  // in); a process whose pages cannot all come is killed. The restore
  // fails if that helper has already failed when it returns.
  virtual absl::StatusOr<pid_t> Restore(const std::string& dir, bool tcp_established,
                                        bool new_terminal, const LazyPages* lazy_from,
                                        PostCopyHelper* helper) = 0;
  // The pids of the processes dumped into `dir`, which a restore gives
  // back: what a restore that failed part way may have left behind.
  virtual absl::StatusOr<std::vector<pid_t>> DumpedPids(const std::string& dir) = 0;
};

// CRIU through CriuDriver; logs go to `log_dir`. CRIU's TLS for post-copy
// uses `tls_dir`'s ca.pem, host.pem and host.key.
std::unique_ptr<Checkpointer> NewCriuCheckpointer(const std::string& log_dir,
                                                  const std::string& tls_dir);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CRIU_CHECKPOINTER_H_
