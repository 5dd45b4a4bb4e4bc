// Checkpoint and Restore (Operator): a process dumped into a directory of
// this host (left running or not), and a checkpoint restored here or, as
// the second half of a move, on another host. See migrator.h.
#include <algorithm>
#include <filesystem>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "migrator/criu/image_dir.h"
#include "migrator/host/addresses.h"
#include "migrator/host/containers.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

absl::Status Migrator::ValidateCheckpointDir(const std::string& dir) {
  if (dir.empty() || dir.front() != '/')
    return absl::InvalidArgumentError(absl::StrCat("\"", dir, "\" is not an absolute path"));
  std::error_code ec;
  if (std::filesystem::exists(dir, ec)) {
    if (!std::filesystem::is_directory(dir, ec))
      return absl::FailedPreconditionError(absl::StrCat(dir, " exists and is not a directory"));
    if (!std::filesystem::is_empty(dir, ec))
      return absl::FailedPreconditionError(absl::StrCat(dir, " exists and is not empty"));
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status Migrator::Checkpoint(const v1::CheckpointRequest& request, const ProgressSink& sink) {
  pid_t pid = request.pid();
  pid_t root = pid;
  std::optional<v1::Container> container;
  if (!request.container().empty()) {
    // A container is dumped whole by its runtime; its process under the
    // shim is the endpoint.
    absl::StatusOr<v1::Container> c = MovableContainer(request.container(), &root);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::vector<pid_t>> endpoints = EndpointsOfTree(root);
    if (!endpoints.ok()) return endpoints.status();
    if (endpoints->size() > 1)
      return absl::FailedPreconditionError(
          absl::StrCat("container ", c->name(), " has ", endpoints->size(),
                       " processes under the shim: a container is checkpointed with one"));
    pid = endpoints->front();
    c->set_endpoint_pid_inside(options_.containers->PidInside(pid));
    container = *std::move(c);
  }
  if (absl::Status st = CheckShim(pid); !st.ok()) return st;
  absl::StatusOr<std::string> terminal = container.has_value() ? std::string() : TreeTerminal(pid);
  if (!terminal.ok()) return terminal.status();
  if (absl::Status st = CheckTreeDevices(root, {pid}); !st.ok()) return st;
  if (absl::Status st = ValidateCheckpointDir(request.dir()); !st.ok()) return st;
  if (absl::Status st = MarkMoving(pid); !st.ok()) return st;
  absl::Cleanup unbusy = [&] { DoneMoving(pid); };
  std::unique_ptr<Move> m = NewMove("checkpoint", pid, sink);
  m->rec.mutable_report()->set_destination(request.dir());
  m->rec.set_image_dir(request.dir());
  m->rec.set_terminal(*terminal);
  v1::MigrationReport* r = m->rec.mutable_report();
  if (container.has_value()) {
    *m->rec.mutable_container() = *container;
    r->set_container(container->name());
  }

  v1::EndpointSummary released;
  absl::Status st = QuiesceAndRelease(m.get(), &released);
  if (st.ok()) st = DumpCheckpoint(m.get(), request, released);
  if (!st.ok()) {
    if (!request.leave_running() && !procs_->Exists(pid)) {
      // CRIU took the process down with it; nothing to roll back to here.
      r->set_rolled_back(false);
      Finish(m.get(), st);
      return st;
    }
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(request.dir(), ec))
      std::filesystem::remove_all(e.path(), ec);
    RollBack(m.get(), st);
    return st;
  }
  if (!request.leave_running()) {
    // The process is gone; its peers stay suspended until a restore. A
    // container's runtime keeps it, stopped: removed, so that its name is
    // free for the restore.
    if (container.has_value())
      if (absl::Status gone = RemoveContainerCopy(*container, "checkpointed container"); !gone.ok())
        r->set_error(std::string(gone.message()));
    r->mutable_breakdown()->set_blackout_us(MicrosSince(m->blackout_start));
    Finish(m.get(), absl::OkStatus());
    return absl::OkStatus();
  }
  return ResumeInPlace(m.get());
}

absl::Status Migrator::DumpCheckpoint(Move* m, const v1::CheckpointRequest& request,
                                      const v1::EndpointSummary& released) {
  v1::MigrationReport* r = m->rec.mutable_report();
  SetPhase(m, "dump", request.dir());
  const absl::Time d0 = absl::Now();
  absl::Status st;
  absl::StatusOr<DumpStats> dump =
      m->rec.has_container()
          ? DumpContainer(m->rec.container(), request.dir(), request.leave_running(), false)
          : criu_->Dump(request.pid(), request.dir(), "", request.leave_running(), false);
  if (!dump.ok()) st = Annotate(dump.status(), "dump");
  if (st.ok()) {
    absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(request.dir());
    if (!files.ok())
      st = files.status();
    else {
      v1::Manifest manifest =
          MakeManifest(r->migration_id(), released, *files, options_.host_name, m->rec.terminal());
      if (m->rec.has_container()) *manifest.mutable_container() = m->rec.container();
      st = WriteManifest(request.dir(), manifest);
      r->set_bytes_moved(SumSizes(*files));
    }
  }
  r->mutable_breakdown()->set_final_dump_us(MicrosSince(d0));
  if (st.ok()) m->rec.set_dumped(true);
  return st;
}

absl::Status Migrator::ResumeInPlace(Move* m) {
  const pid_t pid = m->rec.report().pid();
  SetPhase(m, "restore", "on this host");
  const absl::Time r0 = absl::Now();
  absl::StatusOr<v1::EndpointSummary> e = BringBack(pid, FirstActiveDeviceName(), {});
  if (!e.ok()) {
    // The checkpoint is good; the process is not running. Say so.
    const absl::Status st =
        Annotate(e.status(), "checkpoint written, but restoring the process in place failed");
    Finish(m, st);
    return st;
  }
  m->rec.mutable_report()->mutable_breakdown()->set_rdma_restore_us(MicrosSince(r0));
  m->rec.set_released(false);
  SetPhase(m, "reconnect");
  const absl::Time c0 = absl::Now();
  const absl::Status st = ResumeAfter(pid, ReconnectAll(m, e->mapping(), false));
  FinishReconnected(m, c0, st);
  return st;
}

absl::Status Migrator::Restore(const v1::RestoreRequest& request, const ProgressSink& sink) {
  if (request.dir().empty() || request.dir().front() != '/')
    return absl::InvalidArgumentError(
        absl::StrCat("\"", request.dir(), "\" is not an absolute path"));
  std::optional<HostPort> on;
  if (!request.on().empty()) {
    absl::StatusOr<HostPort> hp = ParseHostPort(request.on(), options_.port);
    if (!hp.ok()) return Annotate(hp.status(), "--on");
    if (!IsLocalAddress(hp->host) || hp->port != options_.port) on = *hp;
  }
  // Nothing is created before the images are known to be whole.
  absl::StatusOr<v1::Manifest> manifest = ReadManifest(request.dir());
  if (!manifest.ok())
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", request.dir(), " has no readable manifest: ", manifest.status().message()));
  if (absl::Status st = VerifyImages(request.dir(), *manifest); !st.ok())
    return absl::DataLossError(
        absl::StrCat("checkpoint ", request.dir(), " is corrupted or incomplete: ", st.message()));
  std::unique_ptr<Move> m = NewMove("restore", manifest->endpoint().pid(), sink);
  v1::MigrationReport* r = m->rec.mutable_report();
  r->set_endpoint_id(manifest->endpoint().endpoint_id());
  r->set_qps(manifest->endpoint().counts().qps());
  r->set_mrs(manifest->endpoint().counts().mrs());
  r->set_registered_bytes(manifest->endpoint().counts().registered_bytes());
  *m->rec.mutable_endpoint() = manifest->endpoint();
  m->rec.set_image_dir(request.dir());
  if (manifest->has_container()) {
    *m->rec.mutable_container() = manifest->container();
    r->set_container(manifest->container().name());
    if (!on.has_value())
      if (absl::Status st = CheckContainerFits(manifest->container()); !st.ok()) {
        st = Annotate(st, "nothing was restored");
        Finish(m.get(), st);
        return st;
      }
  }
  m->blackout_start = absl::Now();
  if (absl::Status st = RecordPeerHosts(m.get(), manifest->endpoint()); !st.ok()) {
    st = Annotate(st, "nothing was restored");
    Finish(m.get(), st);
    return st;
  }
  r->set_destination(on.has_value() ? on->Target() : options_.host_name);
  if (absl::Status st = ClaimMove(m.get()); !st.ok()) {
    st = Annotate(st, "nothing was restored");
    Finish(m.get(), st);
    return st;
  }
  absl::Cleanup unclaim = [&] { UnclaimMove(m.get()); };
  if (on.has_value()) return RestoreElsewhere(m.get(), request.dir(), *manifest, on->Target());
  return RestoreHere(m.get(), request.dir(), *manifest);
}

absl::Status Migrator::RecordPeerHosts(Move* m, const v1::EndpointSummary& endpoint) {
  // The peers stayed suspended since the checkpoint (or resumed, if their
  // hosts restarted; they are re-pointed either way).
  absl::StatusOr<PeerHostSet> hosts = PeerHosts(endpoint);
  if (!hosts.ok()) return hosts.status();
  hosts->named.insert(hosts->listed.begin(), hosts->listed.end());
  for (const std::string& t : hosts->named) {
    if (t.empty())
      m->rec.set_local_peers(true);
    else if (std::find(m->rec.peer_hosts().begin(), m->rec.peer_hosts().end(), t) ==
             m->rec.peer_hosts().end())
      m->rec.add_peer_hosts(t);
  }
  m->rec.mutable_report()->set_peers(m->rec.peer_hosts_size() + (m->rec.local_peers() ? 1 : 0));
  return absl::OkStatus();
}

absl::Status Migrator::RestoreElsewhere(Move* m, const std::string& dir,
                                        const v1::Manifest& manifest, const std::string& target) {
  // The second half of a move: prepare, transfer, restore and resume as
  // Migrate does, and a failure rolled back by the same RollBack.
  v1::MigrationReport* r = m->rec.mutable_report();
  m->rec.set_destination(target);
  r->set_destination(target);
  SetPhase(m, "prepare", target);
  v1::PrepareRequest prep;
  prep.set_migration_id(r->migration_id());
  *prep.mutable_endpoint() = manifest.endpoint();
  if (manifest.has_container()) *prep.mutable_container() = manifest.container();
  absl::Status st = PrepareDestination(m, prep, "nothing was restored");
  if (!st.ok()) {
    Finish(m, st);
    return st;
  }
  v1::Manifest sent = manifest;
  sent.set_migration_id(r->migration_id());
  st = TransferFinal(m, dir, sent);
  if (st.ok()) st = RestoreOnDestination(m);
  if (!st.ok()) {
    RollBack(m, st);
    return st;
  }
  return CompleteForward(m);
}

absl::Status Migrator::RestoreHere(Move* m, const std::string& dir, const v1::Manifest& manifest) {
  v1::MigrationReport* r = m->rec.mutable_report();
  v1::Breakdown* b = r->mutable_breakdown();
  r->set_destination(options_.host_name);
  SetPhase(m, "restore", "on this host");
  v1::RestoreIncomingResponse out;
  absl::StatusOr<pid_t> pid = RestoreFromDir(
      dir, /*tcp_established=*/false, !manifest.terminal().empty(),
      /*lazy_from=*/nullptr, /*postcopy=*/nullptr, manifest.endpoint().pid(), NoteRestored(m), {},
      &out, manifest.has_container() ? &manifest.container() : nullptr);
  if (!pid.ok()) {
    Finish(m, pid.status());
    return pid.status();
  }
  r->set_pid(out.pid());
  b->set_criu_restore_us(out.criu_restore_us());
  b->set_rdma_restore_us(out.rdma_restore_us());

  SetPhase(m, "reconnect");
  const absl::Time c0 = absl::Now();
  const absl::Status st = ResumeAfter(r->pid(), ReconnectAll(m, out.endpoint().mapping(), false));
  FinishReconnected(m, c0, st);
  return st;
}

}  // namespace rdmavirt::migrator
