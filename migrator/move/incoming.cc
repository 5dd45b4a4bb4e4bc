// The destination side of a move (Transfer): Prepare, PushImages,
// RestoreIncoming, AbortIncoming, and the final resume of the endpoint.
#include <algorithm>
#include <filesystem>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "migrator/criu/image_dir.h"
#include "migrator/criu/image_stream.h"
#include "migrator/host/addresses.h"
#include "migrator/host/log.h"
#include "migrator/host/rdma_devices.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/move/record_store.h"

namespace rdmavirt::migrator {
namespace {

bool ValidId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id)
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
  return true;
}

// Removes everything in `dir` but the record.
void RemoveImages(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().filename() != kRecordFile) std::filesystem::remove_all(e.path(), ec);
}

}  // namespace

std::string Migrator::IncomingDir(const std::string& id) const {
  return absl::StrCat(options_.state_dir, "/incoming/", id);
}

void Migrator::PersistIncoming(Incoming* in) {
  in->mu.AssertHeld();
  absl::Status st = WriteRecord(in->dir, in->rec);
  if (!st.ok()) {
    Log("incoming %s: cannot write its record: %s", in->rec.report().migration_id(), st.ToString());
    if (in->record_error.ok()) in->record_error = st;
  }
}

absl::Status Migrator::CheckCanHost() {
  const v1::HostInfo host = GetHostInfo();
  if (FirstActiveDevice(host) == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("host ", options_.host_name, " has no RDMA device with an ACTIVE port"));
  if (!host.criu_ok())
    return absl::FailedPreconditionError(absl::StrCat(
        "CRIU does not work on host ", options_.host_name, " (", host.criu_version(), ")"));
  return absl::OkStatus();
}

absl::StatusOr<v1::PrepareResponse> Migrator::Prepare(const v1::PrepareRequest& request) {
  if (!ValidId(request.migration_id()))
    return absl::InvalidArgumentError("a migration id is 1..64 letters, digits, '-' or '_'");
  if (absl::Status st = CheckCanHost(); !st.ok()) return st;
  if (request.has_container())
    if (absl::Status st = CheckContainerFits(request.container()); !st.ok()) return st;
  v1::MigrationRecord homed;
  if (absl::Status st = HomeAddresses(request, &homed); !st.ok()) return st;
  auto in = std::make_unique<Incoming>();
  in->dir = IncomingDir(request.migration_id());
  {
    absl::MutexLock lock(&mu_);
    begun_here_.insert(request.migration_id());
  }
  std::error_code ec;
  if (std::filesystem::exists(in->dir, ec))
    return absl::AlreadyExistsError(
        absl::StrCat("migration ", request.migration_id(), " was prepared here already"));
  {
    absl::MutexLock lock(&in->mu);
    v1::MigrationReport* r = in->rec.mutable_report();
    r->set_migration_id(request.migration_id());
    r->set_kind("incoming");
    r->set_pid(request.endpoint().pid());
    r->set_endpoint_id(request.endpoint().endpoint_id());
    r->set_destination(options_.host_name);
    r->set_started_at(Rfc3339(absl::Now()));
    in->rec.set_role("destination");
    in->rec.set_phase("prepared");
    *in->rec.mutable_endpoint() = request.endpoint();
    in->rec.set_image_dir(in->dir);
    *in->rec.mutable_addresses() = homed.addresses();
    if (request.has_container()) *in->rec.mutable_container() = request.container();
    // Crash recovery reads it: without it, a restored process would be
    // nobody's after a restart.
    PersistIncoming(in.get());
    if (const absl::Status st = in->record_error; !st.ok()) {
      std::filesystem::remove_all(in->dir, ec);
      return absl::Status(st.code(), absl::StrCat("cannot write the incoming record that crash "
                                                  "recovery reads: ",
                                                  st.message()));
    }
  }
  Log("incoming %s: prepared for endpoint %s (pid %d on its source)", request.migration_id(),
      request.endpoint().endpoint_id(), request.endpoint().pid());
  {
    absl::MutexLock lock(&mu_);
    incoming_[request.migration_id()] = std::move(in);
  }
  v1::PrepareResponse out;
  *out.mutable_host() = GetHostInfo();
  return out;
}

absl::StatusOr<v1::PushImagesResponse> Migrator::PushImages(
    const std::function<bool(v1::ImageChunk*)>& next) {
  v1::ImageChunk first;
  if (!next(&first)) return absl::InvalidArgumentError("an empty image stream");
  absl::StatusOr<std::shared_ptr<Incoming>> found = FindIncoming(first.migration_id());
  if (!found.ok()) return found.status();
  const std::shared_ptr<Incoming> in = *std::move(found);
  {
    absl::MutexLock lock(&in->mu);
    if (in->aborted || (in->rec.phase() != "prepared" && in->rec.phase() != "receiving"))
      return absl::FailedPreconditionError(absl::StrCat("migration ", first.migration_id(), " is ",
                                                        in->aborted ? "aborted" : in->rec.phase()));
    if (in->streaming)
      return absl::FailedPreconditionError(
          absl::StrCat("migration ", first.migration_id(), " is receiving another stream"));
    if (first.pre_dump() && first.iteration() != in->last_iteration + 1)
      return absl::InvalidArgumentError(
          absl::StrCat("pre-dump iteration ", first.iteration(), " after ", in->last_iteration));
    in->streaming = true;
  }
  // Written without the lock: an abort meanwhile marks the move aborted
  // and deletes its images at once; the stream stops at its next chunk and
  // deletes what it wrote after that.
  auto aborted = [&] {
    absl::MutexLock lock(&in->mu);
    return in->aborted;
  };
  absl::Status st;
  ImageReceiver rx(in->dir);
  st = rx.Begin(first);
  v1::ImageChunk c;
  while (st.ok() && next(&c)) {
    if (aborted()) {
      st = absl::AbortedError(absl::StrCat("migration ", first.migration_id(), " was aborted"));
    } else if (c.migration_id() != first.migration_id() || (c.has_manifest() && !c.trailer())) {
      st = absl::InvalidArgumentError("an image stream carries one migration's manifest");
    } else {
      st = rx.Add(c);
    }
  }
  if (st.ok()) st = rx.Finish();
  absl::MutexLock lock(&in->mu);
  in->streaming = false;
  if (st.ok() && in->aborted)
    st = absl::AbortedError(absl::StrCat("migration ", first.migration_id(), " was aborted"));
  if (!st.ok()) {
    if (in->aborted) RemoveImages(in->dir);
    return st;
  }
  // CRIU's `parent` links travel as parent.path files (criu_driver.h);
  // CriuDriver::Restore re-creates the links from them.
  if (first.pre_dump()) in->last_iteration = first.iteration();
  in->rec.set_phase("receiving");
  in->rec.mutable_report()->set_bytes_moved(in->rec.report().bytes_moved() + rx.bytes());
  if (first.manifest().has_endpoint() && !first.pre_dump())
    *in->rec.mutable_endpoint() = first.manifest().endpoint();
  PersistIncoming(in.get());
  v1::PushImagesResponse out;
  out.set_bytes_received(rx.bytes());
  return out;
}

std::map<pid_t, std::string> Migrator::IdentitiesOf(const std::string& dir) {
  std::map<pid_t, std::string> out;
  absl::StatusOr<std::vector<pid_t>> pids = criu_->DumpedPids(dir);
  if (!pids.ok()) {
    Log("restore from %s: the tree's pids are unknown (%s)", dir, pids.status().ToString());
    return out;
  }
  for (pid_t p : *pids) out[p] = procs_->Identity(p);
  return out;
}

void Migrator::KillHalfRestored(const std::map<pid_t, std::string>& before) {
  // CRIU kills what it restored when the restore fails, unless it dies
  // itself (killed, crashed): the processes it had made are left then.
  for (const auto& [p, identity] : before) {
    const std::string now = procs_->Identity(p);
    if (now.empty() || now == identity) continue;  // none, or what ran there before
    Log("process %d: left by the failed restore; killed", p);
    if (absl::Status st = KillCopy(p, "half-restored process"); !st.ok()) Log("%s", st.ToString());
  }
}

absl::StatusOr<pid_t> Migrator::RestoreFromDir(const std::string& dir, bool tcp_established,
                                               bool new_terminal, const LazyPages* lazy_from,
                                               v1::PostCopyHelper* postcopy, pid_t endpoint_pid,
                                               const std::function<void(pid_t)>& restored,
                                               const std::vector<v1::Mapping>& peers,
                                               v1::RestoreIncomingResponse* out,
                                               const v1::Container* container) {
  const absl::Time c0 = absl::Now();
  PostCopyHelper helper;
  // What already runs under the tree's pids, for a restore that fails.
  const std::map<pid_t, std::string> before =
      container != nullptr ? std::map<pid_t, std::string>() : IdentitiesOf(dir);
  absl::StatusOr<pid_t> pid =
      container != nullptr ? RestoreContainer(dir, *container, tcp_established, &endpoint_pid)
                           : criu_->Restore(dir, tcp_established, new_terminal, lazy_from, &helper);
  if (!pid.ok()) {
    KillHalfRestored(before);
    return Annotate(pid.status(), container != nullptr ? "container restore" : "CRIU restore");
  }
  if (postcopy != nullptr && helper.pid > 0) *postcopy = RecordHelper(helper);
  restored(*pid);
  // A live move dumps its process stopped, and CRIU restores it so; a
  // checkpoint's process was running. Either way it runs from here on.
  auto kill_copy = [&] {
    return container != nullptr ? RemoveContainerCopy(*container, "restored copy")
                                : KillCopy(*pid, "restored copy");
  };
  if (absl::Status st = procs_->Continue(*pid); !st.ok()) {
    const absl::Status k = kill_copy();
    return Annotate(st, absl::StrCat("continuing restored process ", *pid,
                                     k.ok() ? "" : absl::StrCat(" (", k.message(), ")")));
  }
  out->set_criu_restore_us(MicrosSince(c0));
  const absl::Time r0 = absl::Now();
  const pid_t endpoint = endpoint_pid > 0 ? endpoint_pid : *pid;
  absl::StatusOr<v1::EndpointSummary> e =
      endpoint == *pid || procs_->Exists(endpoint)
          ? BringBack(endpoint, FirstActiveDeviceName(), peers)
          : absl::NotFoundError(
                absl::StrCat("process ", endpoint, " is not among the processes CRIU restored"));
  if (!e.ok()) {
    // No half-made process stays behind, or the error says it does.
    const absl::Status k = kill_copy();
    return Annotate(e.status(),
                    absl::StrCat("bringing back the endpoint of restored process ", endpoint,
                                 k.ok() ? "" : absl::StrCat(" (", k.message(), ")")));
  }
  out->set_rdma_restore_us(MicrosSince(r0));
  out->set_pid(endpoint);
  *out->mutable_endpoint() = *std::move(e);
  return *pid;
}

absl::StatusOr<std::shared_ptr<Migrator::Incoming>> Migrator::FindIncoming(const std::string& id,
                                                                           bool take) {
  absl::MutexLock lock(&mu_);
  if (!incoming_.contains(id))
    if (absl::Status st = AwaitRecovery(id); !st.ok()) return st;
  auto it = incoming_.find(id);
  if (it == incoming_.end())
    return absl::NotFoundError(absl::StrCat("no migration ", id, " was prepared here"));
  std::shared_ptr<Incoming> in = it->second;
  if (take) incoming_.erase(it);
  return in;
}

absl::StatusOr<v1::RestoreIncomingResponse> Migrator::RestoreMember(
    const v1::RestoreIncomingRequest& request) {
  const std::string& id = request.migration_id();
  const pid_t pid = request.endpoint_pid();
  absl::StatusOr<std::shared_ptr<Incoming>> found = FindIncoming(id);
  if (!found.ok()) return found.status();
  const std::shared_ptr<Incoming> in = *std::move(found);
  {
    absl::MutexLock lock(&in->mu);
    if (in->rec.phase() != "restored")
      return absl::FailedPreconditionError(
          absl::StrCat("migration ", id, " is ", in->rec.phase(), ", not restored"));
    const std::vector<pid_t> tree = procs_->Descendants(in->rec.restored_pid());
    if (pid <= 0 || std::find(tree.begin(), tree.end(), pid) == tree.end())
      return absl::FailedPreconditionError(
          absl::StrCat("process ", pid, " is not in the tree migration ", id, " restored here"));
  }
  // Brought back without `in->mu`: an abort meanwhile kills the tree, and
  // this fails for it.
  const absl::Time r0 = absl::Now();
  std::vector<v1::Mapping> peers(request.peers().begin(), request.peers().end());
  absl::StatusOr<v1::EndpointSummary> e = BringBack(pid, FirstActiveDeviceName(), peers);
  if (!e.ok())
    return Annotate(e.status(),
                    absl::StrCat("bringing back the endpoint of restored process ", pid));
  {
    absl::MutexLock arriving(&mu_);
    arriving_.insert(pid);
  }
  v1::RestoreIncomingResponse out;
  out.set_pid(pid);
  out.set_rdma_restore_us(MicrosSince(r0));
  *out.mutable_endpoint() = *std::move(e);
  Log("incoming %s: process %d of the restored tree back on %s", id, pid, out.endpoint().device());
  return out;
}

absl::StatusOr<v1::RestoreIncomingResponse> Migrator::RestoreIncoming(
    const v1::RestoreIncomingRequest& request) {
  if (request.endpoint_pid() != 0) return RestoreMember(request);
  const std::string& id = request.migration_id();
  absl::StatusOr<std::shared_ptr<Incoming>> found = FindIncoming(id);
  if (!found.ok()) return found.status();
  const std::shared_ptr<Incoming> in = *std::move(found);
  const std::string final_dir = in->dir + "/final";
  absl::StatusOr<v1::MigrationRecord> started = StartRestoring(in.get(), id, final_dir);
  if (!started.ok()) return started.status();
  const v1::MigrationRecord rec = *std::move(started);
  // Its service addresses first: CRIU binds its sockets to them.
  const bool tcp = rec.addresses_size() > 0;
  absl::Status st = tcp ? AddAddresses(rec) : absl::OkStatus();
  if (!st.ok()) st = Annotate(st, "adding the service addresses");
  std::vector<v1::Mapping> peers(request.peers().begin(), request.peers().end());
  // Post-copy: the pages the final dump left out, from the source.
  std::optional<LazyPages> lazy;
  if (!request.lazy_pages_from().empty() && st.ok()) {
    absl::StatusOr<HostPort> from = ParseHostPort(request.lazy_pages_from(), 0);
    if (!from.ok() || from->port <= 0)
      st = absl::InvalidArgumentError(
          absl::StrCat("lazy_pages_from: not host:port: \"", request.lazy_pages_from(), "\""));
    else
      lazy = LazyPages{from->host, from->port};
  }
  v1::RestoreIncomingResponse out;
  v1::PostCopyHelper postcopy;
  absl::StatusOr<pid_t> pid = absl::UnknownError("not restored");
  if (!st.ok())
    pid = st;
  else
    pid = RestoreFromDir(
        final_dir, tcp, !rec.terminal().empty(), lazy ? &*lazy : nullptr, &postcopy,
        rec.report().pid(),
        [&](pid_t p) {
          absl::MutexLock lock(&in->mu);
          if (in->aborted) return;  // the record says aborted; killed below
          in->rec.set_restored_pid(p);
          in->rec.set_restored_identity(procs_->Identity(p));
          // A restarted migrator watches its pages come (WatchPostCopy).
          if (postcopy.pid() > 0) *in->rec.mutable_postcopy() = postcopy;
          PersistIncoming(in.get());
        },
        peers, &out, rec.has_container() ? &rec.container() : nullptr);
  if (absl::Status ended = EndRestoring(in.get(), id, rec, tcp && st.ok(), pid, out); !ended.ok())
    return ended;
  return out;
}

absl::StatusOr<v1::MigrationRecord> Migrator::StartRestoring(Incoming* in, const std::string& id,
                                                             const std::string& final_dir) {
  absl::MutexLock lock(&in->mu);
  if (in->rec.phase() != "receiving")
    return absl::FailedPreconditionError(absl::StrCat("migration ", id, " is ", in->rec.phase()));
  if (in->streaming)
    return absl::FailedPreconditionError(
        absl::StrCat("migration ", id, " is still receiving an image stream"));
  // Verified as it arrived (ImageReceiver::Finish); its manifest must be there.
  absl::StatusOr<v1::Manifest> manifest = ReadManifest(final_dir);
  if (!manifest.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("no complete final dump received: ", manifest.status().message()));
  if (!in->record_error.ok())
    return absl::FailedPreconditionError(absl::StrCat(
        "not restored: the incoming record cannot be written (", in->record_error.message(), ")"));
  in->rec.set_phase("restoring");
  in->rec.set_terminal(manifest->terminal());
  in->rec.set_addresses_moved(in->rec.addresses_size() > 0);
  PersistIncoming(in);
  return in->rec;
}

absl::Status Migrator::EndRestoring(Incoming* in, const std::string& id,
                                    const v1::MigrationRecord& rec, bool addresses_added,
                                    const absl::StatusOr<pid_t>& pid,
                                    const v1::RestoreIncomingResponse& out) {
  absl::MutexLock lock(&in->mu);
  if (in->aborted) {
    // The abort cleaned up what it found; what the restore made since goes too.
    if (pid.ok() && rec.has_container())
      (void)RemoveContainerCopy(rec.container(), "restored copy");
    else if (pid.ok() && procs_->Exists(*pid))
      (void)procs_->Kill(*pid);
    if (addresses_added) (void)RemoveAddresses(rec);
    Log("incoming %s: aborted by the source during the restore", id);
    return absl::AbortedError(absl::StrCat("migration ", id, " was aborted during the restore"));
  }
  if (!pid.ok()) {
    if (addresses_added) {
      if (absl::Status rm = RemoveAddresses(in->rec); !rm.ok())
        Log("incoming %s: %s", id, rm.ToString());
      else
        in->rec.set_addresses_moved(false);
    } else {
      in->rec.set_addresses_moved(false);
    }
    in->rec.set_restored_pid(0);
    in->rec.clear_restored_identity();
    in->rec.set_phase("receiving");
    PersistIncoming(in);
    Log("incoming %s: restore failed: %s", id, pid.status().ToString());
    return pid.status();
  }
  in->rec.set_phase("restored");
  in->rec.set_confirmed(true);
  // A container's processes have other pids here: its endpoint is found
  // by this one from now on (ResumeMoved).
  if (in->rec.has_container()) in->rec.mutable_report()->set_pid(out.pid());
  {
    // Restored, paused until its source resumes it: not anyone's peer to
    // quiesce yet (QuiescePeers refuses it until then).
    absl::MutexLock arriving(&mu_);
    arriving_.insert(out.pid());
  }
  *in->rec.mutable_new_mapping() = out.endpoint().mapping();
  v1::Breakdown* b = in->rec.mutable_report()->mutable_breakdown();
  b->set_criu_restore_us(out.criu_restore_us());
  b->set_rdma_restore_us(out.rdma_restore_us());
  PersistIncoming(in);
  Log("incoming %s: restored as process %d on %s", id, *pid, out.endpoint().device());
  return absl::OkStatus();
}

absl::Status Migrator::AbortIncoming(const v1::AbortIncomingRequest& request) {
  absl::StatusOr<std::shared_ptr<Incoming>> found =
      FindIncoming(request.migration_id(), /*take=*/true);
  if (absl::IsNotFound(found.status())) return absl::OkStatus();  // nothing (left) here
  if (!found.ok()) return found.status();
  const std::shared_ptr<Incoming> in = *std::move(found);
  absl::MutexLock lock(&in->mu);
  // A restore in flight finds this and kills what it restores from here on.
  in->aborted = true;
  {
    absl::MutexLock arriving(&mu_);
    arriving_.erase(in->rec.report().pid());
  }
  return DropIncoming(in.get(), "aborted by the source");
}

absl::Status Migrator::DropIncoming(Incoming* in, const std::string& why) {
  in->mu.AssertHeld();
  const std::string id = in->rec.report().migration_id();
  const pid_t pid = in->rec.restored_pid();
  std::vector<std::string> problems;
  std::string killed;
  if (in->rec.has_container() && pid > 0) {
    if (absl::Status st = RemoveContainerCopy(in->rec.container(), "restored copy"); !st.ok())
      problems.push_back(std::string(st.message()));
    else
      killed = absl::StrCat("; restored container ", in->rec.container().name(), " removed");
  } else if (SameProcess(pid, in->rec.restored_identity())) {
    if (absl::Status st = KillCopy(pid, "restored copy"); !st.ok())
      problems.push_back(std::string(st.message()));
    else
      killed = absl::StrCat("; restored process ", pid, " killed");
  } else if (pid > 0) {
    killed = absl::StrCat("; restored process ", pid, " was gone",
                          procs_->Exists(pid) ? " (its pid names another process now)" : "");
  }
  if (in->rec.addresses_moved()) {
    // The source takes them back: they must not be on two hosts.
    if (absl::Status st = RemoveAddresses(in->rec); !st.ok())
      problems.push_back(absl::StrCat("removing the service addresses: ", st.message()));
    else
      in->rec.set_addresses_moved(false);
  }
  RemoveImages(in->dir);
  in->rec.set_done(true);
  in->rec.set_phase("aborted");
  in->rec.mutable_report()->set_error(
      problems.empty() ? why + killed : absl::StrCat(why, "; but ", absl::StrJoin(problems, "; ")));
  PersistIncoming(in);
  Log("incoming %s: %s", id, in->rec.report().error());
  if (problems.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("migration ", id, " aborted on ", options_.host_name,
                                          ", but ", absl::StrJoin(problems, "; ")));
}

absl::Status Migrator::ResumeMoved(const v1::ReconnectPeersRequest& request) {
  // Asked by a remote host once this one recovered (ReconnectPeers), or
  // by this host for a tree it moves: no wait for recovery here.
  std::shared_ptr<Incoming> in;
  {
    absl::MutexLock lock(&mu_);
    auto it = incoming_.find(request.migration_id());
    if (it != incoming_.end()) {
      in = std::move(it->second);
      incoming_.erase(it);
    }
  }
  pid_t pid = request.endpoint_pid();
  if (pid == 0 && in != nullptr) {
    absl::MutexLock lock(&in->mu);
    // The restored tree's process under the shim (its pid as on the source).
    if (in->rec.restored_pid() != 0) pid = in->rec.report().pid();
  }
  if (pid == 0) {
    // A restarted migrator: find the endpoint by its virtual GID.
    const std::vector<ShimInfo> shims = shims_->Connected();
    const std::vector<absl::StatusOr<v1::EndpointSummary>> described = DescribeAll(shims);
    for (size_t i = 0; i < shims.size(); ++i)
      if (described[i].ok() &&
          described[i]->mapping().virtual_gid() == request.mapping().virtual_gid())
        pid = shims[i].pid;
  }
  if (pid == 0)
    return absl::NotFoundError(
        absl::StrCat("no endpoint ", request.migration_id(), " to resume on ", options_.host_name));
  const absl::Status r = ResumeEndpoint(pid);
  {
    absl::MutexLock arriving(&mu_);
    arriving_.erase(pid);
  }
  if (in != nullptr) {
    absl::MutexLock lock(&in->mu);
    RemoveImages(in->dir);
    in->rec.set_done(true);
    in->rec.set_phase("done");
    in->rec.mutable_report()->set_ok(r.ok());
    if (!r.ok()) in->rec.mutable_report()->set_error(std::string(r.message()));
    PersistIncoming(in.get());
  }
  Log("incoming %s: process %d resumed%s", request.migration_id(), pid,
      r.ok() ? "" : absl::StrCat(" (failed: ", r.message(), ")"));
  return r;
}

}  // namespace rdmavirt::migrator
