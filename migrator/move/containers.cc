// A container's move: what differs from a process tree's. The container's
// runtime (ContainerRuntime, Podman) dumps, restores and removes it by
// name, its export file the only image; everything else (the quiesce and
// release of its processes under the shim, the transfer, the peers
// re-pointed, the rollback) is a tree's move whose root is the container's
// first process. What cannot move is refused before anything is quiesced,
// on the source (no runtime, a runtime without CRIU, a terminal, more than
// one endpoint) and on the destination (no image, a device or a mounted
// path it does not have, a container of that name). See migrator.h.
#include "migrator/host/containers.h"

#include <sys/stat.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

absl::StatusOr<v1::Container> Migrator::MovableContainer(const std::string& name, pid_t* root) {
  if (options_.containers == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("this migrator (", options_.host_name, ") has no container runtime"));
  absl::StatusOr<ContainerInfo> c = options_.containers->Inspect(name);
  if (!c.ok()) return c.status();
  if (!c->running)
    return absl::FailedPreconditionError(absl::StrCat("container ", c->name, " is not running"));
  if (absl::Status st = options_.containers->CanCheckpoint(c->runtime); !st.ok())
    return Annotate(st, absl::StrCat("container ", c->name));
  if (c->terminal)
    return absl::FailedPreconditionError(
        absl::StrCat("container ", c->name, " has a terminal (-t): its checkpoint cannot take it"));
  v1::Container out;
  out.set_name(c->name);
  out.set_id(c->id);
  out.set_image(c->image);
  out.set_image_id(c->image_id);
  out.set_runtime(c->runtime);
  for (const std::string& d : c->devices) out.add_devices(d);
  for (const std::string& b : c->binds) out.add_binds(b);
  *root = c->pid;
  return out;
}

absl::Status Migrator::CheckContainerFits(const v1::Container& c) {
  if (options_.containers == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("host ", options_.host_name, " has no container runtime"));
  if (!options_.containers->HasImage(c.image_id()))
    return absl::FailedPreconditionError(
        absl::StrCat("host ", options_.host_name, " has no image ", c.image_id().substr(0, 12),
                     " (", c.image(), ") of container ", c.name(), ": pull or load it there"));
  std::vector<std::string> missing;
  for (const std::string& p : c.devices()) {
    struct stat st;
    if (stat(p.c_str(), &st) != 0 || !S_ISCHR(st.st_mode)) missing.push_back(p);
  }
  for (const std::string& p : c.binds()) {
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) missing.push_back(p);
  }
  if (!missing.empty())
    return absl::FailedPreconditionError(absl::StrCat("host ", options_.host_name, " has no ",
                                                      absl::StrJoin(missing, ", "),
                                                      ", which container ", c.name(), " is given"));
  if (absl::StatusOr<ContainerInfo> there = options_.containers->Inspect(c.name()); there.ok())
    return absl::AlreadyExistsError(
        absl::StrCat("host ", options_.host_name, " has a container named ", c.name(), " already"));
  if (absl::Status st = options_.containers->CanCheckpoint(c.runtime()); !st.ok())
    return Annotate(st, absl::StrCat("host ", options_.host_name));
  return absl::OkStatus();
}

absl::StatusOr<DumpStats> Migrator::DumpContainer(const v1::Container& c, const std::string& dir,
                                                  bool leave_running, bool tcp) {
  const absl::Time t0 = absl::Now();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating ", dir, ": ", ec.message()));
  absl::StatusOr<uint64_t> bytes = options_.containers->Checkpoint(
      c.name(), absl::StrCat(dir, "/", kContainerExport), leave_running, tcp);
  if (!bytes.ok()) return bytes.status();
  DumpStats out;
  out.elapsed_us = static_cast<uint64_t>(absl::ToInt64Microseconds(absl::Now() - t0));
  out.image_bytes = *bytes;
  return out;
}

absl::StatusOr<pid_t> Migrator::RestoreContainer(const std::string& dir, const v1::Container& c,
                                                 bool tcp, pid_t* endpoint) {
  if (options_.containers == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("host ", options_.host_name, " has no container runtime"));
  absl::StatusOr<pid_t> root =
      options_.containers->Restore(c.name(), absl::StrCat(dir, "/", kContainerExport), tcp);
  if (!root.ok()) return root.status();
  *endpoint = options_.containers->HostPid(*root, c.endpoint_pid_inside());
  if (*endpoint == 0) {
    (void)options_.containers->Remove(c.name());
    return absl::NotFoundError(absl::StrCat("container ", c.name(),
                                            " was restored without its pid ",
                                            c.endpoint_pid_inside(), " under the shim"));
  }
  Log("container %s restored: its first process is %d here, its endpoint %d", c.name(), *root,
      *endpoint);
  return *root;
}

absl::Status Migrator::RemoveContainerCopy(const v1::Container& c, const char* which) {
  if (options_.containers == nullptr)
    return absl::InternalError(absl::StrCat("no container runtime to remove the ", which));
  absl::Status st = options_.containers->Remove(c.name());
  if (!st.ok())
    return Annotate(st, absl::StrCat("removing the ", which, " of container ", c.name()));
  return absl::OkStatus();
}

}  // namespace rdmavirt::migrator
