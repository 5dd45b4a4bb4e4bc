// Containers: what a move of a container needs from its runtime, behind an
// interface so that the orchestration can be tested with a fake.
// NewPodman() runs Debian 12's podman (4.3), whose checkpoint and restore
// drive CRIU through the OCI runtime (runc; Debian's crun has no CRIU).
// A container moves as one export file: `podman container checkpoint
// --export` writes the CRIU images, the container's configuration and its
// root file system's changes into it, and `podman container restore
// --import` makes the same container (name, id, mounts, devices) from it
// on another host that has its image.
#ifndef RDMAVIRT_MIGRATOR_HOST_CONTAINERS_H_
#define RDMAVIRT_MIGRATOR_HOST_CONTAINERS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rdmavirt::migrator {

// The export file of a container's checkpoint, in a move's image
// directory or a checkpoint directory.
inline constexpr char kContainerExport[] = "container.tar";

struct ContainerInfo {
  std::string name;
  std::string id;
  std::string image;     // as it was named ("localhost/app:1")
  std::string image_id;  // what a restore needs on its host
  std::string runtime;   // the OCI runtime ("runc")
  pid_t pid = 0;         // its first process, on this host; 0 when not running
  bool running = false;
  bool host_network = false;         // in the host's network namespace
  bool terminal = false;             // started with -t
  std::vector<std::string> devices;  // device files given to it ("/dev/infiniband/uverbs0")
  std::vector<std::string> binds;    // host paths bind-mounted into it
};

class ContainerRuntime {
 public:
  virtual ~ContainerRuntime() = default;
  // Which runtime this is ("podman 4.3.1"); FAILED_PRECONDITION when it
  // cannot run here (not installed).
  virtual absl::StatusOr<std::string> Version() = 0;
  // NOT_FOUND when no container has that name (or id).
  virtual absl::StatusOr<ContainerInfo> Inspect(const std::string& name) = 0;
  // The running containers.
  virtual absl::StatusOr<std::vector<ContainerInfo>> List() = 0;
  // Whether this host has the image a restore needs.
  virtual bool HasImage(const std::string& image_id) = 0;
  // Whether `runtime` can checkpoint (runc can; crun only when built with
  // CRIU); FAILED_PRECONDITION saying why not.
  virtual absl::Status CanCheckpoint(const std::string& runtime) = 0;
  // The container checkpointed into `file` (kContainerExport); it keeps
  // running when `leave_running`, else it is stopped (left, not removed).
  // `tcp_established` as Checkpointer::Dump's. Returns the file's size.
  virtual absl::StatusOr<uint64_t> Checkpoint(const std::string& name, const std::string& file,
                                              bool leave_running, bool tcp_established) = 0;
  // Container `name` restored from `file` (its export, which names it);
  // its first process's pid here. Its processes stay as the checkpoint saw
  // them (a stopped one stays stopped).
  virtual absl::StatusOr<pid_t> Restore(const std::string& name, const std::string& file,
                                        bool tcp_established) = 0;
  // The container killed and removed; OK when there is none of that name.
  virtual absl::Status Remove(const std::string& name) = 0;
  // The pid of this host's process `pid` in its own (innermost) pid
  // namespace: `pid` for a process in this host's, 0 when it is gone.
  virtual pid_t PidInside(pid_t pid) = 0;
  // The pid here of the process among `root` and its descendants that is
  // pid `inside` in its own pid namespace; 0 when none is.
  virtual pid_t HostPid(pid_t root, pid_t inside) = 0;
};

// podman at `path` ("" for the one on PATH); each command may take up to
// `timeout`.
std::unique_ptr<ContainerRuntime> NewPodman(const std::string& path = "",
                                            absl::Duration timeout = absl::Minutes(10));

// The pid of `pid` in its innermost pid namespace (the last of NSpid); 0
// when /proc does not say. (Podman's PidInside.)
pid_t InnermostPid(pid_t pid);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_CONTAINERS_H_
