// CriuDriver: checkpoint and restore of a process tree through CRIU.
//
// The migrator calls it to pre-dump a running endpoint (memory only, the
// process keeps running), to dump it for good, and to restore a dumped tree
// on this host. Each call runs its own `criu swrk` (libcriu's criu_local_*
// API, so calls do not share options) and writes its own log file into the
// driver's log directory; every error carries the tail of that log.
//
// Thread-compatible: one call at a time per object. Distinct objects may
// be used from distinct threads (libcriu keeps the errno CRIU answers with
// in one global, so concurrent failures may be classified from the log
// text alone).
//
// Restore trusts its images: CRIU 3.17's restorer spins forever on a
// truncated pages file. Check a directory with VerifyImages (image_dir.h)
// before restoring from it.
//
// The caller must not reap children it did not start: libcriu forks
// `criu swrk` and waits for it with waitpid() (a SIGCHLD handler that
// reaps every child makes that wait, and so the call's cleanup, race).
//
// Images layout: every dump writes into its own directory. A pre-dump or
// dump with a parent writes CRIU's `parent` symlink (to the parent
// relative to dir) and also `parent.path`, a regular file holding the same
// relative path. Transfers carry regular files only (ScanImages refuses
// symlinks), so Restore() re-creates a missing `parent` link from
// `parent.path` at each level of the chain before CRIU reads it.
#ifndef RDMAVIRT_MIGRATOR_CRIU_CRIU_DRIVER_H_
#define RDMAVIRT_MIGRATOR_CRIU_CRIU_DRIVER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "migrator/criu/checkpointer.h"

namespace rdmavirt::migrator {

// The file that records a dump's parent (see the layout above).
inline constexpr char kParentPathFile[] = "parent.path";

struct CriuResult {
  uint64_t elapsed_us = 0;   // wall time of the CRIU call
  uint64_t image_bytes = 0;  // bytes of the files written in dir
};

struct LazyRestored {
  pid_t pid = 0;           // the restored root
  pid_t pages_daemon = 0;  // `criu lazy-pages` under its status shell, to be waited for
  std::string daemon_log;
  std::string daemon_status;  // where its exit status goes (SpawnFds::exit_status_file)
};

// Drives CRIU through libcriu, and post-copy through CRIU's command line
// (LazyDump, LazyRestore). Thread-compatible (one call at a time per object).
//
// Errors (each message names the call, the pid or directory, the log file
// and ends with the log's last lines):
//   NOT_FOUND            the pid does not exist; Restore: dir or its images missing
//   FAILED_PRECONDITION  CRIU cannot run here or refuses the process as it is
//                        (a device or socket it cannot dump, no memory tracking)
//   ALREADY_EXISTS       Restore: a pid of the tree is in use on this host;
//                        PreDump/Dump: dir already holds a dump
//   DATA_LOSS            Restore: the images do not parse
//   INVALID_ARGUMENT     a relative dir, a parent that is not a directory,
//                        a pid whose tree holds the caller
//   INTERNAL             anything else CRIU reported
class CriuDriver {
 public:
  // log_dir: where CRIU's logs go (a file per call, named after the call:
  // `dump-PID-TIME.log`, `restore-TIME.log`, ...). Created if missing.
  explicit CriuDriver(std::string log_dir);

  // criu's own check (`criu check`) plus memory tracking (soft-dirty),
  // which PreDump needs. FAILED_PRECONDITION with the log's last lines
  // when either fails.
  absl::Status Check();

  // Pre-dump with memory tracking: the process keeps running. `parent` is
  // "" for the first iteration, else the previous iteration's dir
  // (absolute; passed to CRIU relative to dir). dir is created if missing
  // and must not already hold a dump.
  absl::StatusOr<CriuResult> PreDump(pid_t pid, const std::string& dir, const std::string& parent);

  // Final dump (tracking memory against `parent` if not empty, so only the
  // pages dirtied since the parent are written). leave_running keeps the
  // process running after the dump; otherwise it is killed once dumped.
  // tcp_established dumps established TCP connections (their sockets in
  // repair mode, the network locked with nftables meanwhile) instead of
  // refusing them: only for a process whose addresses move with it.
  absl::StatusOr<CriuResult> Dump(pid_t pid, const std::string& dir, const std::string& parent,
                                  bool leave_running, bool tcp_established = false);

  // Restores the tree dumped in dir (with its parent chain present at the
  // same relative paths); returns the restored root pid. The restored tree
  // is detached from the caller: CRIU restores it under its own `criu
  // swrk` child, which exits, so the tree is re-parented to init (or the
  // nearest subreaper) and keeps its own session; it keeps running if the
  // caller exits or is killed.
  // tcp_established restores the connections a dump made with it holds;
  // their local addresses must be on this host.
  // new_terminal: the tree held a pseudo-terminal whose master side stayed
  // where it was dumped. CRIU then runs under rdmavirt-terminal, in a
  // session of its own whose controlling terminal is a new pseudo-terminal,
  // which the restored processes get in place of the old one (their
  // standard files, their controlling terminal, their foreground group);
  // the restored root is that session's, and rdmavirt-terminal's child.
  // What they write to it goes to the file named in
  // *restored_terminal_log (`LOG-DIR/terminal-PID.log`).
  absl::StatusOr<pid_t> Restore(const std::string& dir, bool tcp_established = false,
                                bool new_terminal = false,
                                std::string* restored_terminal_log = nullptr);

  // Post-copy (Checkpointer::LazyDump), through CRIU's command line:
  // `criu dump --lazy-pages`, its page server at `serve` over CRIU's TLS
  // with tls_dir's ca.pem, host.pem and host.key. `written` is called once
  // CRIU listens there, which it does only after writing every image, with
  // that CRIU (under a shell that writes its exit status beside its log).
  absl::StatusOr<CriuResult> LazyDump(pid_t pid, const std::string& dir, const std::string& parent,
                                      bool tcp_established, const LazyPages& serve,
                                      const std::string& tls_dir,
                                      const std::function<void(const PostCopyHelper&)>& written);
  // Connects to a LazyDump's page server and hangs up: that dump fails.
  static void CancelLazyDump(const LazyPages& serve);
  // Restores a LazyDump's images: starts `criu lazy-pages` (the pages
  // from `from`, over CRIU's TLS) in a work dir of its own under the log
  // dir, then `criu restore --lazy-pages` beside it. Returns once the
  // process runs; the daemon goes on until every page is in, and the
  // caller waits for it (LazyRestored::pages_daemon, a child of the
  // caller's, whose exit status also goes to LazyRestored::daemon_status).
  absl::StatusOr<LazyRestored> LazyRestore(const std::string& dir, bool tcp_established,
                                           const LazyPages& from, const std::string& tls_dir);

  const std::string& log_dir() const { return log_dir_; }

 private:
  std::string log_dir_;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CRIU_CRIU_DRIVER_H_
