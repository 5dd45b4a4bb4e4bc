// ProcessControl: the signals a migration sends to the process it moves,
// behind an interface so that tests can use fake pids. Safe for concurrent
// use.
#ifndef RDMAVIRT_MIGRATOR_HOST_PROCESS_CONTROL_H_
#define RDMAVIRT_MIGRATOR_HOST_PROCESS_CONTROL_H_

#include <sys/types.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace rdmavirt::migrator {

class ProcessControl {
 public:
  virtual ~ProcessControl() = default;
  virtual bool Exists(pid_t pid) = 0;
  // What tells this process from any other that had or will have its pid:
  // "BOOT_ID:START" (the kernel's boot id, the process's start time in
  // clock ticks since boot); "" when no process has the pid. A record
  // keeps it, so that a migrator that restarts (after a reboot, or long
  // after the move) never signals a stranger that was given the pid.
  virtual std::string Identity(pid_t pid) = 0;
  // Its children, their children and so on (not `pid`), parents before
  // their children: what CRIU dumps and restores with it.
  virtual std::vector<pid_t> Descendants(pid_t pid) = 0;
  // Stop, Continue and Kill act on the process and its descendants, the
  // tree a dump takes: a child left running on the source would run twice.
  // SIGSTOP, and wait until every process of the tree is stopped.
  virtual absl::Status Stop(pid_t pid) = 0;
  // SIGCONT.
  virtual absl::Status Continue(pid_t pid) = 0;
  // SIGKILL, and wait (bounded) until every process of the tree is gone.
  // OK if it was gone already.
  virtual absl::Status Kill(pid_t pid) = 0;
  // The pseudo-terminals whose master side (an open /dev/ptmx) the
  // process holds, by index (N of /dev/pts/N).
  virtual std::set<int> PtyMasters(pid_t pid) = 0;
  // The terminals the process holds, each once: its open files' ("/dev/pts/3",
  // "/dev/tty", "/dev/ttyS0"), then its controlling terminal if none of them
  // is it ("/dev/pts/N" for a pseudo-terminal, else "a controlling terminal
  // (device M:N)"); empty when it holds none. Not counted: /dev/ptmx, and
  // /dev/pts/N with N in `masters_in_tree` (a pseudo-terminal whose both
  // sides move with the tree, as an MPI daemon and the ranks whose output
  // it reads through one).
  virtual std::vector<std::string> Terminals(pid_t pid, const std::set<int>& masters_in_tree) = 0;
  // The device files the process holds open that CRIU cannot dump as
  // they are, each once: its RDMA devices (under /dev/infiniband:
  // "/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"), which the
  // shim's release closes, and any character device CRIU has no dump for
  // ("/dev/fuse (10:229)"): CRIU takes memory devices (/dev/null...),
  // terminals, tun and autofs only.
  virtual std::vector<std::string> DeviceFiles(pid_t pid) = 0;
  // Its parent's pid; 0 when it is gone.
  virtual pid_t Parent(pid_t pid) = 0;
  // Its command name (/proc/PID/comm: "orted"); "" when it is gone.
  virtual std::string Program(pid_t pid) = 0;
  // The local IPv4 addresses (host order) of the TCP sockets it holds
  // open, bound or connected (not the any-address), each once.
  virtual std::set<uint32_t> TcpAddresses(pid_t pid) = 0;
};

// kill(2) and /proc.
std::unique_ptr<ProcessControl> NewProcessControl();

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_PROCESS_CONTROL_H_
