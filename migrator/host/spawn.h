// SpawnProgram: a child program started the way the migrator starts every
// helper (CRIU, its terminal keeper, podman): its standard input from
// /dev/null, its output to /dev/null or to a descriptor, optionally one
// more descriptor as its fd 3, and no signal of the daemon's mask blocked
// (the daemon blocks its stop signals; a child must not inherit that).
// With `exit_status_file`, the program runs under /bin/sh, which writes
// its exit status there when it ends: a helper that outlives a restart of
// the daemon (CRIU's post-copy page server and lazy-pages daemon) still
// tells the next run how it ended. The pid returned is then that shell's,
// the leader of a process group of its own (kill -PID reaches both).
// Header-only: the CRIU driver and the host's code share it without one
// library depending on the other.
#ifndef RDMAVIRT_MIGRATOR_HOST_SPAWN_H_
#define RDMAVIRT_MIGRATOR_HOST_SPAWN_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace rdmavirt::migrator {

struct SpawnFds {
  int output = -1;                    // its stdout and stderr; -1: /dev/null
  int as_fd3 = -1;                    // given to it as fd 3 (dup2 clears close-on-exec); -1: none
  bool search_path = false;           // args[0] looked up on PATH, else a path
  std::string exit_status_file = {};  // "": none
};

// The shell's script for SpawnFds::exit_status_file: the program's status
// ("0", "1", ... or 128+signal) written whole (renamed into place).
inline constexpr char kExitStatusScript[] =
    "\"$@\"; s=$?; echo $s > \"$0.part\" && mv -f \"$0.part\" \"$0\"; exit $s";

// The exit status a SpawnFds::exit_status_file holds: empty if there is
// none yet (the program runs, or its shell was killed first).
inline std::optional<int> ReadExitStatus(const std::string& file) {
  FILE* f = fopen(file.c_str(), "re");
  if (f == nullptr) return std::nullopt;
  int status = -1;
  const bool read = fscanf(f, "%d", &status) == 1;
  fclose(f);
  if (!read) return std::nullopt;
  return status;
}

inline absl::StatusOr<pid_t> SpawnProgram(const std::vector<std::string>& args,
                                          const SpawnFds& fds = {}) {
  std::vector<std::string> wrapped;
  if (!fds.exit_status_file.empty()) {
    if (fds.search_path)
      return absl::InvalidArgumentError("an exit status file needs the program's path");
    wrapped = {"/bin/sh", "-c", kExitStatusScript, fds.exit_status_file};
    wrapped.insert(wrapped.end(), args.begin(), args.end());
  }
  const std::vector<std::string>& run = wrapped.empty() ? args : wrapped;
  std::vector<char*> argv;
  for (const std::string& a : run) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  absl::Cleanup fa_done = [&] { posix_spawn_file_actions_destroy(&fa); };
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", fds.output >= 0 ? O_RDONLY : O_RDWR, 0);
  const int out = fds.output >= 0 ? fds.output : 0;
  posix_spawn_file_actions_adddup2(&fa, out, 1);
  posix_spawn_file_actions_adddup2(&fa, out, 2);
  if (fds.as_fd3 >= 0) posix_spawn_file_actions_adddup2(&fa, fds.as_fd3, 3);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  absl::Cleanup attr_done = [&] { posix_spawnattr_destroy(&attr); };
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  short flags = POSIX_SPAWN_SETSIGMASK;
  if (!wrapped.empty()) {
    posix_spawnattr_setpgroup(&attr, 0);
    flags |= POSIX_SPAWN_SETPGROUP;
  }
  posix_spawnattr_setflags(&attr, flags);
  pid_t pid = 0;
  const int err = fds.search_path
                      ? posix_spawnp(&pid, args[0].c_str(), &fa, &attr, argv.data(), environ)
                      : posix_spawn(&pid, run[0].c_str(), &fa, &attr, argv.data(), environ);
  if (err != 0) return absl::ErrnoToStatus(err, absl::StrCat("cannot start ", args[0]));
  return pid;
}

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_SPAWN_H_
