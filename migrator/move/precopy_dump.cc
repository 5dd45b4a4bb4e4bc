// A move's source side from the pre-copy to the confirmed restore: the
// pre-dumps streamed while the process runs, the tree's endpoints quiesced
// and released, the final dump (or a post-copy's, serving its last pages),
// its transfer and the restore on the destination. See migrator.h.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "migrator/criu/image_dir.h"
#include "migrator/criu/image_stream.h"
#include "migrator/host/addresses.h"
#include "migrator/host/log.h"
#include "migrator/host/scoped_fd.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

absl::Status Migrator::RunSource(Move* m, const v1::MigrateRequest& request,
                                 const std::vector<std::unique_ptr<Move>>& members) {
  // CRIU's steps take the tree from its root; the shim's, the endpoint.
  const pid_t root = TreeRoot(m->rec);
  const std::vector<Move*> all = TreeMoves(m, members);
  absl::StatusOr<std::string> parent = PreCopy(m, request, all);
  if (!parent.ok()) return parent.status();
  v1::EndpointSummary released;  // the first endpoint's, for the manifest
  if (absl::Status st = QuiesceAndReleaseTree(m, all, &released); !st.ok()) return st;

  SetPhase(m, "dump");
  const absl::Time d0 = absl::Now();
  const std::string final_dir = m->dir + "/final";
  m->rec.set_image_dir(final_dir);
  absl::StatusOr<bool> tcp = StopForDump(m, root);
  if (!tcp.ok()) return tcp.status();
  // A post-copy's final dump goes on serving its pages after this: ended
  // before any error return (its destination will not come), and after
  // the move's completion otherwise (Conclude).
  absl::Cleanup end_lazy_dump = [&] { (void)EndLazyDump(m, /*cancel=*/true); };
  if (request.postcopy()) {
    if (absl::Status st = StartLazyDump(m, root, final_dir, *parent, *tcp); !st.ok())
      return Annotate(st, "final dump (post-copy)");
  } else {
    // Left running, and stopped: a rollback continues it.
    absl::StatusOr<DumpStats> dump =
        m->rec.has_container()
            ? DumpContainer(m->rec.container(), final_dir, /*leave_running=*/true, *tcp)
            : criu_->Dump(root, final_dir, *parent, /*leave_running=*/true,
                          /*tcp_established=*/*tcp);
    if (!dump.ok()) return Annotate(dump.status(), "final dump");
  }
  // Inside the blackout each image is read once, by the stream, which
  // hashes it as it goes: the manifest lists names and sizes, the digests
  // follow the files (image_stream.h).
  absl::StatusOr<std::vector<v1::ImageFile>> files = ListImages(final_dir);
  if (!files.ok()) return files.status();
  const v1::Manifest listed = MakeManifest(m->rec.report().migration_id(), released, *files,
                                           options_.host_name, m->rec.terminal());
  m->rec.set_dumped(true);
  m->rec.mutable_report()->mutable_breakdown()->set_final_dump_us(MicrosSince(d0));

  v1::Manifest hashed;
  if (absl::Status st = TransferFinal(m, final_dir, listed, &hashed); !st.ok()) return st;
  if (absl::Status st = WriteManifest(final_dir, hashed); !st.ok()) return st;
  if (absl::Status st = RestoreOnDestination(m); !st.ok()) return st;
  for (const std::unique_ptr<Move>& mm : members)
    if (absl::Status st = BringBackMember(mm.get()); !st.ok()) return st;
  std::move(end_lazy_dump).Cancel();
  return absl::OkStatus();
}

absl::StatusOr<std::string> Migrator::PreCopy(Move* m, const v1::MigrateRequest& request,
                                              const std::vector<Move*>& all) {
  const pid_t root = TreeRoot(m->rec);
  const std::string id = m->rec.report().migration_id();
  SetPhase(m, "precopy");
  const absl::Time p0 = absl::Now();
  const uint32_t max_iter = request.max_precopy_iterations() ? request.max_precopy_iterations()
                                                             : options_.max_precopy_iterations;
  std::string parent;
  for (Move* x : all) x->rec.mutable_report()->set_postcopy(request.postcopy());
  if (m->rec.has_container()) {
    // Podman pre-checkpoints only with CRIU's memory tracking, which
    // cannot pre-dump a process with the device mapped either.
    SetPhase(m, "precopy", "none: the container's runtime dumps it whole");
    return parent;
  }
  uint64_t last_round = 0;
  int flat_rounds = 0;  // in a row, each more than 9/10 of the one before
  for (uint32_t k = 1; k <= std::min(max_iter, kMaxPreDumpIterations); ++k) {
    const std::string dir = absl::StrCat(m->dir, "/pre-", k);
    absl::StatusOr<DumpStats> d = criu_->PreDump(root, dir, parent);
    if (!d.ok()) {
      // CRIU 3.17 cannot pre-dump a process while the HCA's pages are
      // mapped into it ("Can't handle non-regular mapping"): pre-copy is
      // an optimization, so the final dump, after the release, does it all.
      Log("migration %s: pre-dump %d failed, continuing without pre-copy: %s", id, k,
          d.status().ToString());
      SetPhase(m, "precopy", "skipped: CRIU cannot pre-dump a process with the device mapped");
      break;
    }
    if (absl::Status st = SendPreDump(m, k, dir); !st.ok()) return st;
    parent = dir;
    NotePreDumpPages(all, k, dir);
    if (d->image_bytes < options_.precopy_small_bytes) break;
    // Not converging: twice in a row the process dirtied about as much as
    // the round before carried (less than a tenth fewer bytes), so another
    // round would not make the final dump smaller. Once may be a slow
    // round (a busy host or link), after which the next shrinks again.
    flat_rounds = k > 1 && d->image_bytes * 10 > last_round * 9 ? flat_rounds + 1 : 0;
    if (flat_rounds == 2) {
      Log("migration %s: pre-copy stops after round %d: %d bytes after %d", id, k, d->image_bytes,
          last_round);
      break;
    }
    last_round = d->image_bytes;
  }
  m->rec.mutable_report()->mutable_breakdown()->set_precopy_us(MicrosSince(p0));
  return parent;
}

absl::Status Migrator::SendPreDump(Move* m, uint32_t k, const std::string& dir) {
  const std::string id = m->rec.report().migration_id();
  v1::MigrationReport* r = m->rec.mutable_report();
  // Names and sizes: the stream hashes the files as it sends them.
  absl::StatusOr<std::vector<v1::ImageFile>> files = ListImages(dir);
  if (!files.ok()) return files.status();
  const v1::Manifest manifest =
      MakeManifest(id, m->rec.endpoint(), *files, options_.host_name, m->rec.terminal());
  SetPhase(m, "precopy", absl::StrCat("iteration ", k, ": ", SumSizes(*files), " bytes"));
  const uint64_t before = r->bytes_moved();
  absl::StatusOr<uint64_t> sent =
      SendImages(Stub(m, m->rec.destination()), id, dir, manifest, true, k,
                 options_.transfer_timeout, [&](uint64_t done, uint64_t total) {
                   SendBytes(m, "precopy", before + done, before + total);
                 });
  if (!sent.ok()) return Annotate(sent.status(), absl::StrCat("sending pre-dump ", k));
  r->set_bytes_moved(r->bytes_moved() + *sent);
  r->add_precopy_bytes(*sent);
  r->set_precopy_iterations(k);
  return absl::OkStatus();
}

void Migrator::NotePreDumpPages(const std::vector<Move*>& all, uint32_t k, const std::string& dir) {
  // What each endpoint's registered pages were as sent: the release
  // leaves out of the final dump those that have not changed since.
  for (Move* x : all) {
    const pid_t pid = x->rec.report().pid();
    absl::Status st =
        x->precopy_pages.AddPreDump(dir, pid, static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
    if (!st.ok())
      Log("migration %s: the pages of process %d in pre-dump %d are not known (%s); its "
          "release marks every registered page for the final dump",
          all.front()->rec.report().migration_id(), pid, k, st.ToString());
  }
}

absl::Status Migrator::QuiesceAndReleaseTree(Move* m, const std::vector<Move*>& all,
                                             v1::EndpointSummary* released) {
  // Each endpoint quiesced and released in turn; a linked tree's all
  // quiesced first, since one still running sends to the others, whose QPs
  // must be there to take it until its own drain is done.
  v1::MigrationReport* r = m->rec.mutable_report();
  auto of_tree = [m](const absl::Status& st, const Move* x) {
    return x == m ? st
                  : Annotate(st, absl::StrCat("process ", x->rec.report().pid(), " of the tree"));
  };
  auto release = [&](Move* x) {
    v1::EndpointSummary member_released;
    absl::Status st = of_tree(ReleaseEndpoint(x, x == m ? released : &member_released), x);
    if (x != m) {  // the tree's counts in its first move's report
      const v1::MigrationReport& xr = x->rec.report();
      r->set_registered_pages_marked(r->registered_pages_marked() + xr.registered_pages_marked());
      r->set_registered_pages_unchanged(r->registered_pages_unchanged() +
                                        xr.registered_pages_unchanged());
    }
    return st;
  };
  for (Move* x : all) {
    if (absl::Status st = of_tree(QuiesceEndpoint(x), x); !st.ok()) return st;
    if (m->linked) continue;
    if (absl::Status st = release(x); !st.ok()) return st;
  }
  if (m->linked) {
    for (Move* x : all)
      if (absl::Status st = release(x); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Migrator::StopForDump(Move* m, pid_t root) {
  // Stopped before the dump, so that nothing it does after (its output to a
  // file, most often) makes the image disagree with the files CRIU will find
  // at restore; stopped, not killed, so that a rollback needs no CRIU
  // restore. CRIU restores a stopped task stopped; the destination resumes
  // it (RestoreFromDir).
  absl::Status stopped = procs_->Stop(root);
  m->rec.set_stopped(stopped.ok());
  Persist(m);
  if (!stopped.ok()) return stopped;
  // Its service addresses leave with it (service_address.h): from here on
  // its TCP connections are frozen as the dump sees them.
  const bool tcp = m->rec.addresses_size() > 0;
  if (tcp) {
    m->rec.set_addresses_moved(true);
    Persist(m);
    if (absl::Status st = RemoveAddresses(m->rec); !st.ok())
      return Annotate(st, "removing the service addresses");
  }
  return tcp;
}

namespace {

// A TCP port free on every address of this host now (the kernel's pick
// among the ephemeral ones); CRIU binds it a moment later.
absl::StatusOr<int> FreeTcpPort() {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  socklen_t len = sizeof(any);
  if (fd.get() < 0 || bind(fd.get(), reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0 ||
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&any), &len) != 0)
    return absl::ErrnoToStatus(errno, "no free TCP port");
  return ntohs(any.sin_port);
}

}  // namespace

absl::Status Migrator::StartLazyDump(Move* m, pid_t root, const std::string& dir,
                                     const std::string& parent, bool tcp) {
  absl::StatusOr<HostPort> dest = ParseHostPort(m->rec.destination());
  if (!dest.ok()) return dest.status();
  absl::StatusOr<std::string> address = options_.address_toward(dest->host);
  if (!address.ok()) return address.status();
  absl::StatusOr<int> port = FreeTcpPort();
  if (!port.ok()) return port.status();
  m->lazy_serve = LazyPages{*address, *port};
  SetPhase(m, "dump", absl::StrCat("post-copy: its last pages served on ", *address, ":", *port));
  m->lazy_dump = std::thread([this, m, root, dir, parent, tcp] {
    absl::StatusOr<DumpStats> d =
        criu_->LazyDump(root, dir, parent, tcp, m->lazy_serve, [m](const PostCopyHelper& h) {
          absl::MutexLock lock(&m->lazy_mu);
          m->lazy_written = true;
          m->lazy_helper = h;
        });
    absl::MutexLock lock(&m->lazy_mu);
    m->lazy_status = d.status();
    m->lazy_done = absl::Now();
    m->lazy_ended = true;
  });
  PostCopyHelper helper;
  {
    absl::MutexLock lock(&m->lazy_mu);
    m->lazy_mu.Await(absl::Condition(
        +[](Move* x)
             ABSL_EXCLUSIVE_LOCKS_REQUIRED(x->lazy_mu) { return x->lazy_written || x->lazy_ended; },
        m));
    if (!m->lazy_written) return m->lazy_status;
    helper = m->lazy_helper;
  }
  // A restarted migrator finds it here (postcopy.cc).
  *m->rec.mutable_postcopy() = RecordHelper(helper);
  Persist(m);
  return absl::OkStatus();
}

absl::Status Migrator::EndLazyDump(Move* m, bool cancel) {
  if (!m->lazy_dump.joinable()) return absl::OkStatus();
  if (cancel) criu_->CancelLazyDump(m->lazy_serve);
  m->lazy_dump.join();
  absl::MutexLock lock(&m->lazy_mu);
  if (m->lazy_restored != absl::InfiniteFuture())
    m->rec.mutable_report()->mutable_breakdown()->set_postcopy_us(
        absl::ToInt64Microseconds(m->lazy_done - m->lazy_restored));
  return m->lazy_status;
}

}  // namespace rdmavirt::migrator
