// The source side of a move: Migrate, Checkpoint, Restore (Operator) and
// their rollback. See migrator.h for the sequence.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/addresses.h"
#include "migrator/failpoints.h"
#include "migrator/frame.h"
#include "migrator/image_dir.h"
#include "migrator/image_stream.h"
#include "migrator/log.h"
#include "migrator/migrator.h"
#include "migrator/migrator_internal.h"
#include "migrator/record_store.h"
#include "migrator/scoped_fd.h"

namespace rdmavirt::migrator {
namespace {

template <typename Response>
using RpcFn = std::function<grpc::Status(grpc::ClientContext*, Response*)>;

template <typename Response>
absl::StatusOr<Response> Rpc(absl::Duration timeout, absl::string_view what,
                             const RpcFn<Response>& call) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  Response response;
  const grpc::Status st = call(&ctx, &response);
  if (!st.ok()) return FromGrpc(st, what);
  return response;
}

v1::Manifest MakeManifest(const std::string& id, const v1::EndpointSummary& endpoint,
                          const std::vector<v1::ImageFile>& files, const std::string& host,
                          const std::string& terminal) {
  v1::Manifest m;
  m.set_format_version(1);
  m.set_migration_id(id);
  *m.mutable_endpoint() = endpoint;
  for (const v1::ImageFile& f : files) *m.add_files() = f;
  m.set_source_host(host);
  m.set_created_at(Rfc3339(absl::Now()));
  m.set_terminal(terminal);
  return m;
}

uint64_t SumSizes(const std::vector<v1::ImageFile>& files) {
  uint64_t n = 0;
  for (const auto& f : files) n += f.size();
  return n;
}

}  // namespace

std::unique_ptr<Migrator::Move> Migrator::NewMove(const std::string& kind, pid_t pid,
                                                  const ProgressSink& sink) {
  auto m = std::make_unique<Move>();
  m->start = absl::Now();
  m->sink = sink;
  const std::string id = NewId();
  m->dir = absl::StrCat(options_.state_dir, "/migrations/", id);
  v1::MigrationReport* r = m->rec.mutable_report();
  r->set_migration_id(id);
  r->set_kind(kind);
  r->set_pid(pid);
  r->set_source(options_.host_name);
  r->set_started_at(Rfc3339(m->start));
  m->rec.set_role("source");
  m->rec.set_identity(procs_->Identity(pid));
  return m;
}

void Migrator::Persist(Move* m) {
  if (absl::Status st = WriteRecord(m->dir, m->rec); !st.ok()) {
    Log("migration %s: cannot write its record: %s", m->rec.report().migration_id(), st.ToString());
    if (m->record_error.ok())
      m->record_error = Annotate(st, "cannot write the migration record that crash recovery reads");
  }
  absl::MutexLock lock(&mu_);
  if (!m->rec.done()) in_flight_[m->rec.report().migration_id()] = m->rec.report();
}

void Migrator::SetPhase(Move* m, const std::string& phase, const std::string& detail) {
  m->rec.set_phase(phase);
  Persist(m);
  Log("migration %s (%s of pid %d): %s%s%s", m->rec.report().migration_id(), m->rec.report().kind(),
      m->rec.report().pid(), phase, detail.empty() ? "" : ": ", detail);
  if (m->sink) {
    v1::Progress p;
    p.set_migration_id(m->rec.report().migration_id());
    p.set_phase(phase);
    p.set_detail(detail);
    m->sink(p);
  }
  ReachFailpoint(absl::StrCat("phase:", phase));
}

void Migrator::SendBytes(Move* m, const std::string& phase, uint64_t done, uint64_t total) {
  if (!m->sink) return;
  v1::Progress p;
  p.set_phase(phase);
  p.set_bytes_done(done);
  p.set_bytes_total(total);
  m->sink(p);
}

void Migrator::Finish(Move* m, const absl::Status& status) {
  v1::MigrationReport* r = m->rec.mutable_report();
  r->set_ok(status.ok());
  if (!status.ok() && r->error().empty()) r->set_error(std::string(status.message()));
  r->mutable_breakdown()->set_total_us(MicrosSince(m->start));
  m->rec.set_done(true);
  m->rec.set_phase("done");
  if (absl::Status st = WriteRecord(m->dir, m->rec); !st.ok()) {
    Log("migration %s: cannot write its record: %s", r->migration_id(), st.ToString());
    r->set_error(absl::StrCat(r->error(), r->error().empty() ? "" : "; ",
                              "its record could not be marked done (", st.message(),
                              "): a restarted migrator would take the move up again"));
  }
  {
    absl::MutexLock lock(&mu_);
    in_flight_.erase(r->migration_id());
    recent_.push_front(*r);
    if (recent_.size() > 32) recent_.pop_back();
  }
  Log("migration %s: %s%s", r->migration_id(),
      r->ok() ? "done" : (r->rolled_back() ? "failed, rolled back" : "failed"),
      r->ok() ? "" : absl::StrCat(": ", r->error()));
  if (m->sink) {
    v1::Progress p;
    p.set_phase("done");
    *p.mutable_report() = *r;
    m->sink(p);
  }
}

v1::Transfer::StubInterface* Migrator::Stub(Move* m, const std::string& target) {
  auto& s = m->stubs[target];
  if (s == nullptr) s = options_.connect(target);
  return s.get();
}

absl::StatusOr<v1::ReconnectPeersResponse> Migrator::ReconnectPeersOn(
    Move* m, const std::string& target, const v1::ReconnectPeersRequest& req,
    const std::string& what) {
  const absl::Time start = absl::Now();
  for (int attempt = 1;; ++attempt) {
    v1::Transfer::StubInterface* stub;
    {
      absl::MutexLock lock(&m->peers_mu);
      stub = Stub(m, target);
    }
    absl::StatusOr<v1::ReconnectPeersResponse> r = Rpc<v1::ReconnectPeersResponse>(
        options_.rpc_timeout, what, [&](grpc::ClientContext* c, v1::ReconnectPeersResponse* out) {
          return stub->ReconnectPeers(c, req, out);
        });
    const absl::Duration waited = absl::Now() - start;
    if (r.ok() || r.status().code() != absl::StatusCode::kUnavailable ||
        waited >= options_.restart_wait) {
      if (!r.ok() && attempt > 1)
        return absl::Status(
            r.status().code(),
            absl::StrCat(r.status().message(), " (asked ", attempt, " times over ",
                         absl::FormatDuration(absl::Trunc(waited, absl::Seconds(1))), ")"));
      if (attempt > 1) Log("%s: answered at attempt %d", what, attempt);
      return r;
    }
    {
      absl::MutexLock lock(&m->peers_mu);
      if (attempt == 1)
        SetPhase(m, m->rec.phase(),
                 absl::StrCat(what, ": the migrator there does not answer (", r.status().message(),
                              "); asking again every second for up to ",
                              absl::FormatDuration(options_.restart_wait)));
      m->stubs.erase(target);  // a fresh channel: the old one backs off for long
    }
    absl::SleepFor(absl::Seconds(1));
  }
}

absl::Status Migrator::QuiescePeersOf(Move* m, const v1::EndpointSummary& e) {
  v1::QuiescePeersRequest req;
  req.set_migration_id(m->rec.report().migration_id());
  req.set_virtual_gid(e.mapping().virtual_gid());
  req.set_drain_timeout_ms(options_.drain_timeout_ms);
  for (const v1::QpSummary& q : e.qps()) req.add_virtual_qpns(q.virtual_qpn());
  // Hosts of the peers (connected ones, UD ones its address handles point
  // at, and for a UD endpoint every other host), this one first. A process
  // that shows no GID has no device open: nobody can reach it.
  std::set<std::string> remote, listed;
  if (req.virtual_gid().size() == 16) {
    absl::StatusOr<PeerHostSet> hosts = PeerHosts(e);
    if (!hosts.ok()) return hosts.status();
    remote = std::move(hosts->named);
    remote.erase("");
    listed = std::move(hosts->listed);
    remote.insert(listed.begin(), listed.end());
  }
  m->blackout_start = absl::Now();
  // Every host is in the record before any is asked: a rollback, or a
  // restarted migrator, resumes the peers of each. Peers on this host
  // ("" below): connected ones, and UD ones (found by their QP type, since
  // a UD QP names no peer).
  std::vector<std::string> targets;
  if (req.virtual_gid().size() == 16) {
    m->rec.set_local_peers(true);
    targets.push_back("");
  }
  for (const std::string& t : remote) {
    m->rec.add_peer_hosts(t);
    targets.push_back(t);
    Stub(m, t);  // made before the calls, which share `stubs`
  }
  Persist(m);
  // All hosts at once: each drains its peers' QPs toward the endpoint.
  std::vector<absl::StatusOr<v1::QuiescePeersResponse>> results(targets.size(),
                                                                absl::UnknownError("not asked"));
  AllAtOnce(targets.size(), [&](size_t i) {
    if (targets[i].empty()) {
      v1::QuiescePeersRequest here = req;
      for (pid_t p : m->tree_pids) here.add_tree_pids(p);
      results[i] = QuiescePeers(here);
      return;
    }
    v1::Transfer::StubInterface* stub = m->stubs.at(targets[i]).get();
    results[i] = Rpc<v1::QuiescePeersResponse>(
        absl::Milliseconds(options_.drain_timeout_ms) + options_.rpc_timeout,
        absl::StrCat("quiescing the peers on ", targets[i]),
        [&](grpc::ClientContext* c, v1::QuiescePeersResponse* out) {
          return stub->QuiescePeers(c, req, out);
        });
  });
  uint32_t peers = 0;
  std::set<std::string> unanswered;
  for (size_t i = 0; i < targets.size(); ++i) {
    const absl::StatusOr<v1::QuiescePeersResponse>& r = results[i];
    // A host asked only because any host may send datagrams is left out
    // when its migrator does not answer (stopped, killed while its lease
    // runs): there is no shim there it could reach either.
    if (!r.ok() && listed.contains(targets[i]) &&
        (r.status().code() == absl::StatusCode::kUnavailable ||
         r.status().code() == absl::StatusCode::kDeadlineExceeded)) {
      unanswered.insert(targets[i]);
      continue;
    }
    if (!r.ok()) return r.status();
    peers += r->pids_size();
  }
  if (!unanswered.empty()) {
    auto* kept = m->rec.mutable_peer_hosts();
    kept->erase(std::remove_if(kept->begin(), kept->end(),
                               [&](const std::string& t) { return unanswered.contains(t); }),
                kept->end());
    SetPhase(m, m->rec.phase(),
             absl::StrCat("left out (their migrators do not answer): ",
                          absl::StrJoin(unanswered, ", ")));
  }
  m->rec.mutable_report()->set_peers(peers);
  return absl::OkStatus();
}

// Two moves may meet: P and its peer Q each moving (toward each other, say).
// One endpoint is quiesced with its peers at a time, and the second move is
// refused (ABORTED, rolled back, nothing of it quiesced) rather than
// queued: its pre-copy and its view of the peers date from before the
// other move, and it is cheaper and safer to start it again once the other
// is done. A move is refused when its endpoint is paused as another move's
// peer, and when a peer is being quiesced for its own move or was restored
// and not yet resumed (QuiescePeers).
absl::StatusOr<v1::EndpointSummary> Migrator::QuiesceThePeers(Move* m) {
  const pid_t pid = m->rec.report().pid();
  // A guest's suspend pauses its endpoints together, each as the others'
  // peer and then as itself (guests.cc): it is not refused for that.
  if (m->rec.report().kind() != "suspend") {
    if (absl::Status st = MarkQuiescing(pid); !st.ok()) return st;
  }
  absl::StatusOr<v1::EndpointSummary> e = Describe(pid);
  if (!e.ok()) return e.status();
  *m->rec.mutable_endpoint() = *e;
  v1::MigrationReport* r = m->rec.mutable_report();
  r->set_endpoint_id(e->endpoint_id());
  r->set_qps(e->counts().qps());
  r->set_mrs(e->counts().mrs());
  r->set_registered_bytes(e->counts().registered_bytes());
  absl::Status st = QuiescePeersOf(m, *e);
  if (absl::IsAborted(st))
    return absl::AbortedError(absl::StrCat(st.message(), "; try again when its move is done"));
  if (!st.ok()) return st;
  return e;
}

void Migrator::DoneMoving(pid_t pid) {
  absl::MutexLock lock(&mu_);
  moving_.erase(pid);
  quiescing_.erase(pid);
}

// Marks `pid` as being quiesced for its own move (QuiescePeers then refuses
// to pause it), unless it is paused as another move's peer.
absl::Status Migrator::MarkQuiescing(pid_t pid) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, pids] : peer_sets_)
    if (pids.contains(pid))
      return absl::AbortedError(absl::StrCat("process ", pid, " is paused as a peer of migration ",
                                             id, "; try again when that move is done"));
  quiescing_.insert(pid);
  return absl::OkStatus();
}

absl::Status Migrator::QuiesceAndRelease(Move* m, v1::EndpointSummary* released) {
  if (absl::Status st = QuiesceEndpoint(m); !st.ok()) return st;
  return ReleaseEndpoint(m, released);
}

absl::Status Migrator::QuiesceEndpoint(Move* m) {
  const pid_t pid = m->rec.report().pid();
  v1::Breakdown* b = m->rec.mutable_report()->mutable_breakdown();
  SetPhase(m, "quiesce");
  if (!m->record_error.ok()) return m->record_error;
  const absl::Time q0 = absl::Now();
  absl::StatusOr<v1::EndpointSummary> e = QuiesceThePeers(m);
  if (!e.ok()) return e.status();
  if (m->blackout_start == absl::InfiniteFuture()) m->blackout_start = absl::Now();
  m->rec.set_quiesced(true);
  Persist(m);
  v1::MigratorToShim req;
  req.mutable_quiesce()->set_drain_timeout_ms(options_.drain_timeout_ms);
  absl::StatusOr<v1::Reply> qr = Command(
      pid, req, absl::Milliseconds(options_.drain_timeout_ms) + options_.rpc_timeout, "quiesce");
  if (!qr.ok()) return qr.status();
  b->set_drain_us(qr->elapsed_us());
  b->set_quiesce_us(MicrosSince(q0));
  // The summary after quiesce knows the endpoint's own GID for sure.
  *m->rec.mutable_endpoint() = qr->summary();
  m->writable_registered.clear();
  for (const v1::AddressRange& r : qr->writable_registered())
    m->writable_registered.emplace_back(r.begin(), r.end());
  return absl::OkStatus();
}

absl::Status Migrator::ReleaseEndpoint(Move* m, v1::EndpointSummary* released) {
  const pid_t pid = m->rec.report().pid();
  v1::Breakdown* b = m->rec.mutable_report()->mutable_breakdown();
  SetPhase(m, "release");
  const absl::Time r0 = absl::Now();
  v1::MigratorToShim rel;
  // Within a frame (16 MiB): 24 bytes a page.
  m->precopy_pages.Encode(m->writable_registered, kMaxFrame / 32,
                          rel.mutable_release()->mutable_known_page_addrs(),
                          rel.mutable_release()->mutable_known_page_digests());
  // Post-copy: registered memory must be whole before its re-registration.
  rel.mutable_release()->set_lock_registered(m->rec.report().postcopy());
  absl::StatusOr<v1::Reply> rr = Command(pid, rel, options_.rpc_timeout, "release");
  if (!rr.ok()) {
    // Released or not? Only an answer says; the rollback looks.
    if (!absl::IsFailedPrecondition(rr.status()) && !absl::IsInternal(rr.status()))
      m->rec.set_released(true);
    return rr.status();
  }
  m->rec.set_released(true);
  Persist(m);
  *released = rr->summary();
  v1::MigrationReport* report = m->rec.mutable_report();
  report->set_registered_pages_marked(report->registered_pages_marked() + rr->pages_marked());
  report->set_registered_pages_unchanged(report->registered_pages_unchanged() +
                                         rr->pages_unchanged());
  Log("migration %s: release of process %d: %d registered pages marked for the final dump, %d "
      "unchanged since the pre-copy (%d pages known)",
      m->rec.report().migration_id(), pid, rr->pages_marked(), rr->pages_unchanged(),
      m->precopy_pages.size());
  // CRIU must not find the socket open.
  if (absl::Status st = shims_->WaitClosed(pid, options_.close_timeout); !st.ok()) return st;
  b->set_release_us(MicrosSince(r0));
  return absl::OkStatus();
}

absl::Status Migrator::ReconnectAll(Move* m, const v1::Mapping& mapping, bool resume_only,
                                    uint32_t* held) {
  v1::ReconnectPeersRequest req;
  req.set_migration_id(m->rec.report().migration_id());
  *req.mutable_mapping() = mapping;
  req.set_resume_only(resume_only);
  // This host's peers ("") and every peer host's, all at once; the
  // destination's come last, with the resume.
  std::vector<std::string> targets;
  if (m->rec.local_peers()) targets.push_back("");
  for (const std::string& t : m->rec.peer_hosts())
    if (t != m->rec.destination() || !m->rec.confirmed()) targets.push_back(t);
  return ReconnectOn(m, targets, req, held);
}

absl::Status Migrator::ReconnectOn(Move* m, const std::vector<std::string>& targets,
                                   const v1::ReconnectPeersRequest& req, uint32_t* held) {
  if (held != nullptr) *held = 0;
  std::vector<absl::StatusOr<v1::ReconnectPeersResponse>> results(targets.size(),
                                                                  absl::UnknownError("not asked"));
  AllAtOnce(targets.size(), [&](size_t i) {
    results[i] = targets[i].empty()
                     ? ReconnectHere(req)
                     : ReconnectPeersOn(m, targets[i], req,
                                        absl::StrCat("reconnecting the peers on ", targets[i]));
  });
  std::vector<std::string> errors;
  for (const absl::StatusOr<v1::ReconnectPeersResponse>& r : results) {
    if (!r.ok()) errors.push_back(std::string(r.status().message()));
    if (r.ok() && held != nullptr) *held += r->held_pids_size();
  }
  if (errors.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrJoin(errors, "; "));
}

absl::Status Migrator::RunSource(Move* m, const v1::MigrateRequest& request,
                                 const std::vector<std::unique_ptr<Move>>& members) {
  // CRIU's steps take the tree from its root; the shim's, the endpoint.
  const pid_t root = TreeRoot(m->rec);
  const std::string id = m->rec.report().migration_id();
  v1::MigrationReport* r = m->rec.mutable_report();
  v1::Breakdown* b = r->mutable_breakdown();
  v1::Transfer::StubInterface* dest = Stub(m, m->rec.destination());

  // Pre-copy, the process running.
  SetPhase(m, "precopy");
  const absl::Time p0 = absl::Now();
  const uint32_t max_iter = request.max_precopy_iterations() ? request.max_precopy_iterations()
                                                             : options_.max_precopy_iterations;
  std::string parent;
  const std::vector<Move*> all = TreeMoves(m, members);
  for (Move* x : all) x->rec.mutable_report()->set_postcopy(request.postcopy());
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
    // Names and sizes: the stream hashes the files as it sends them.
    absl::StatusOr<std::vector<v1::ImageFile>> files = ListImages(dir);
    if (!files.ok()) return files.status();
    const v1::Manifest manifest =
        MakeManifest(id, m->rec.endpoint(), *files, options_.host_name, m->rec.terminal());
    SetPhase(m, "precopy", absl::StrCat("iteration ", k, ": ", SumSizes(*files), " bytes"));
    const uint64_t before = r->bytes_moved();
    absl::StatusOr<uint64_t> sent =
        SendImages(dest, id, dir, manifest, true, k, options_.transfer_timeout,
                   [&](uint64_t done, uint64_t total) {
                     SendBytes(m, "precopy", before + done, before + total);
                   });
    if (!sent.ok()) return Annotate(sent.status(), absl::StrCat("sending pre-dump ", k));
    r->set_bytes_moved(r->bytes_moved() + *sent);
    r->add_precopy_bytes(*sent);
    r->set_precopy_iterations(k);
    parent = dir;
    // What each endpoint's registered pages were as sent: the release
    // leaves out of the final dump those that have not changed since.
    for (Move* x : all) {
      const pid_t pid = x->rec.report().pid();
      absl::Status st =
          x->precopy_pages.AddPreDump(dir, pid, static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
      if (!st.ok())
        Log("migration %s: the pages of process %d in pre-dump %d are not known (%s); its "
            "release marks every registered page for the final dump",
            id, pid, k, st.ToString());
    }
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
  b->set_precopy_us(MicrosSince(p0));

  // Each endpoint quiesced and released in turn; a linked tree's all
  // quiesced first, since one still running sends to the others, whose QPs
  // must be there to take it until its own drain is done.
  v1::EndpointSummary released;  // the first endpoint's, for the manifest
  auto of_tree = [m](const absl::Status& st, const Move* x) {
    return x == m ? st
                  : Annotate(st, absl::StrCat("process ", x->rec.report().pid(), " of the tree"));
  };
  auto release = [&](Move* x) {
    v1::EndpointSummary member_released;
    absl::Status st = of_tree(ReleaseEndpoint(x, x == m ? &released : &member_released), x);
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

  SetPhase(m, "dump");
  const absl::Time d0 = absl::Now();
  const std::string final_dir = m->dir + "/final";
  m->rec.set_image_dir(final_dir);
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
  // A post-copy's final dump goes on serving its pages after this: ended
  // before any error return (its destination will not come), and after
  // the move's completion otherwise (Conclude).
  absl::Cleanup end_lazy_dump = [&] { (void)EndLazyDump(m, /*cancel=*/true); };
  if (request.postcopy()) {
    if (absl::Status st = StartLazyDump(m, root, final_dir, parent, tcp); !st.ok())
      return Annotate(st, "final dump (post-copy)");
  } else {
    absl::StatusOr<DumpStats> dump =
        criu_->Dump(root, final_dir, parent, /*leave_running=*/true, /*tcp_established=*/tcp);
    if (!dump.ok()) return Annotate(dump.status(), "final dump");
  }
  // Inside the blackout each image is read once, by the stream, which
  // hashes it as it goes: the manifest lists names and sizes, the digests
  // follow the files (image_stream.h).
  absl::StatusOr<std::vector<v1::ImageFile>> files = ListImages(final_dir);
  if (!files.ok()) return files.status();
  const v1::Manifest listed =
      MakeManifest(id, released, *files, options_.host_name, m->rec.terminal());
  m->rec.set_dumped(true);
  b->set_final_dump_us(MicrosSince(d0));

  v1::Manifest hashed;
  if (absl::Status st = TransferFinal(m, final_dir, listed, &hashed); !st.ok()) return st;
  if (absl::Status st = WriteManifest(final_dir, hashed); !st.ok()) return st;
  if (absl::Status st = RestoreOnDestination(m); !st.ok()) return st;
  for (const std::unique_ptr<Move>& mm : members)
    if (absl::Status st = BringBackMember(mm.get()); !st.ok()) return st;
  std::move(end_lazy_dump).Cancel();
  return absl::OkStatus();
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
    absl::StatusOr<DumpStats> d = criu_->LazyDump(root, dir, parent, tcp, m->lazy_serve, [m] {
      absl::MutexLock lock(&m->lazy_mu);
      m->lazy_written = true;
    });
    absl::MutexLock lock(&m->lazy_mu);
    m->lazy_status = d.status();
    m->lazy_done = absl::Now();
    m->lazy_ended = true;
  });
  absl::MutexLock lock(&m->lazy_mu);
  m->lazy_mu.Await(absl::Condition(
      +[](Move* x)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(x->lazy_mu) { return x->lazy_written || x->lazy_ended; },
      m));
  return m->lazy_written ? absl::OkStatus() : m->lazy_status;
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

namespace {

// Whether a QP of one of `all` is connected to one of them, itself
// included.
bool ConnectedAmong(const std::vector<v1::EndpointSummary>& all) {
  for (const v1::EndpointSummary& to : all) {
    if (to.mapping().virtual_gid().empty()) continue;
    std::set<uint32_t> qpns;
    for (const v1::QpSummary& q : to.qps()) qpns.insert(q.virtual_qpn());
    for (const v1::EndpointSummary& from : all)
      for (const v1::QpSummary& q : from.qps())
        if (q.remote_virtual_gid() == to.mapping().virtual_gid() &&
            qpns.contains(q.remote_virtual_qpn()))
          return true;
  }
  return false;
}

}  // namespace

absl::Status Migrator::MakeMembers(Move* lead, const std::vector<pid_t>& endpoints,
                                   std::vector<std::unique_ptr<Move>>* members) {
  std::vector<v1::EndpointSummary> all = {lead->rec.endpoint()};
  for (size_t i = 1; i < endpoints.size(); ++i) {
    absl::StatusOr<v1::EndpointSummary> e = Describe(endpoints[i]);
    if (!e.ok()) return e.status();
    if (absl::Status st = CheckPeersLocatable(*e); !st.ok()) return st;
    all.push_back(*std::move(e));
  }
  lead->linked = ConnectedAmong(all);
  lead->tree_pids = endpoints;
  const v1::MigrationReport& lr = lead->rec.report();
  for (size_t i = 1; i < endpoints.size(); ++i) {
    std::unique_ptr<Move> mm = NewMove("migrate", endpoints[i], nullptr);
    mm->tree_pids = endpoints;
    mm->rec.set_tree_root(TreeRoot(lead->rec));
    mm->rec.set_tree_lead(lr.migration_id());
    mm->rec.set_destination(lead->rec.destination());
    *mm->rec.mutable_endpoint() = all[i];
    v1::MigrationReport* r = mm->rec.mutable_report();
    r->set_tree_root(TreeRoot(lead->rec));
    r->set_destination(lr.destination());
    r->set_endpoint_id(all[i].endpoint_id());
    lead->rec.mutable_report()->add_tree_endpoints(endpoints[i]);
    Persist(mm.get());
    members->push_back(std::move(mm));
  }
  Persist(lead);
  return lead->record_error;
}

// A further endpoint of a tree its first move (tree_lead) restored on the
// destination: its process is there (CRIU gave it its pid back), released;
// brought back there, paused, like the first.
absl::Status Migrator::BringBackMember(Move* member) {
  SetPhase(member, "restore", member->rec.destination());
  if (!member->record_error.ok()) return member->record_error;
  v1::RestoreIncomingRequest rq;
  rq.set_migration_id(member->rec.tree_lead());
  rq.set_endpoint_pid(member->rec.report().pid());
  v1::Transfer::StubInterface* dest = Stub(member, member->rec.destination());
  const absl::Time r0 = absl::Now();
  absl::StatusOr<v1::RestoreIncomingResponse> back = Rpc<v1::RestoreIncomingResponse>(
      options_.hello_timeout + options_.rpc_timeout * 2,
      absl::StrCat("bringing back process ", member->rec.report().pid(), " on ",
                   member->rec.destination()),
      [&](grpc::ClientContext* c, v1::RestoreIncomingResponse* out) {
        return dest->RestoreIncoming(c, rq, out);
      });
  if (!back.ok()) return back.status();
  member->rec.mutable_report()->mutable_breakdown()->set_rdma_restore_us(MicrosSince(r0));
  member->rec.set_confirmed(true);
  member->rec.set_restored_pid(back->pid());
  *member->rec.mutable_new_mapping() = back->endpoint().mapping();
  Persist(member);
  return absl::OkStatus();
}

absl::Status Migrator::PrepareDestination(Move* m, const v1::PrepareRequest& prep,
                                          const char* untouched) {
  const std::string target = m->rec.destination();
  v1::Transfer::StubInterface* stub = Stub(m, target);
  absl::StatusOr<v1::PrepareResponse> ready = Rpc<v1::PrepareResponse>(
      std::min(options_.rpc_timeout, absl::Seconds(15)), absl::StrCat("destination ", target),
      [&](grpc::ClientContext* c, v1::PrepareResponse* out) {
        return stub->Prepare(c, prep, out);
      });
  if (!ready.ok()) {
    const absl::Status& st = ready.status();
    if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st))
      return absl::UnavailableError(absl::StrCat("destination ", target,
                                                 " is unreachable (no rdmavirt-migratord answers "
                                                 "there over mutual TLS); ",
                                                 untouched, ": ", st.message()));
    return Annotate(st, untouched);
  }
  m->prepared = true;
  m->rec.mutable_report()->set_destination(
      ready->host().hostname().empty() ? target
                                       : absl::StrCat(ready->host().hostname(), " (", target, ")"));
  return absl::OkStatus();
}

absl::Status Migrator::TransferFinal(Move* m, const std::string& dir, const v1::Manifest& manifest,
                                     v1::Manifest* hashed) {
  v1::MigrationReport* r = m->rec.mutable_report();
  uint64_t total = 0;
  for (const v1::ImageFile& f : manifest.files()) total += f.size();
  SetPhase(m, "transfer", absl::StrCat(total, " bytes"));
  const absl::Time t0 = absl::Now();
  const uint64_t before = r->bytes_moved();
  absl::StatusOr<uint64_t> sent = SendImages(
      Stub(m, m->rec.destination()), r->migration_id(), dir, manifest, false, 0,
      options_.transfer_timeout,
      [&](uint64_t done, uint64_t total) {
        SendBytes(m, "transfer", before + done, before + total);
      },
      hashed);
  if (!sent.ok()) return Annotate(sent.status(), "sending the final dump");
  r->set_bytes_moved(r->bytes_moved() + *sent);
  r->set_final_bytes(*sent);
  r->mutable_breakdown()->set_transfer_us(MicrosSince(t0));
  return absl::OkStatus();
}

absl::Status Migrator::RestoreOnDestination(Move* m) {
  v1::Breakdown* b = m->rec.mutable_report()->mutable_breakdown();
  SetPhase(m, "restore", m->rec.destination());
  // Past the destination's restore only a record says where the process
  // runs: without one the move goes back while it still can.
  if (!m->record_error.ok()) return m->record_error;
  m->restore_asked = true;
  v1::RestoreIncomingRequest rq;
  rq.set_migration_id(m->rec.report().migration_id());
  if (m->lazy_dump.joinable())
    rq.set_lazy_pages_from(HostPort{m->lazy_serve.address, m->lazy_serve.port}.Target());
  v1::Transfer::StubInterface* dest = Stub(m, m->rec.destination());
  absl::StatusOr<v1::RestoreIncomingResponse> restored = Rpc<v1::RestoreIncomingResponse>(
      options_.hello_timeout + options_.rpc_timeout * 4,
      absl::StrCat("restoring on ", m->rec.destination()),
      [&](grpc::ClientContext* c, v1::RestoreIncomingResponse* out) {
        return dest->RestoreIncoming(c, rq, out);
      });
  if (!restored.ok()) return restored.status();
  m->lazy_restored = absl::Now();
  b->set_criu_restore_us(restored->criu_restore_us());
  b->set_rdma_restore_us(restored->rdma_restore_us());
  m->rec.set_confirmed(true);
  m->rec.set_restored_pid(restored->pid());
  *m->rec.mutable_new_mapping() = restored->endpoint().mapping();
  Persist(m);
  return absl::OkStatus();
}

absl::Status Migrator::CompleteForward(Move* m) {
  v1::MigrationReport* r = m->rec.mutable_report();
  SetPhase(m, "reconnect");
  const absl::Time c0 = absl::Now();
  absl::Status peers = ReconnectAll(m, m->rec.new_mapping(), false);
  // Last: the destination re-points its own peers of the endpoint, then
  // resumes the endpoint, whose queued posts may now reach everyone.
  v1::ReconnectPeersRequest req;
  req.set_migration_id(r->migration_id());
  *req.mutable_mapping() = m->rec.new_mapping();
  req.set_resume_endpoint(true);
  if (!m->rec.tree_lead().empty()) req.set_endpoint_pid(r->pid());
  absl::StatusOr<v1::ReconnectPeersResponse> resumed =
      ReconnectPeersOn(m, m->rec.destination(), req,
                       absl::StrCat("resuming the endpoint on ", m->rec.destination()));
  return Conclude(m, c0, peers, resumed.status());
}

absl::Status Migrator::Conclude(Move* m, absl::Time c0, const absl::Status& peers,
                                const absl::Status& resumed) {
  v1::MigrationReport* r = m->rec.mutable_report();
  r->mutable_breakdown()->set_reconnect_us(MicrosSince(c0));
  r->mutable_breakdown()->set_blackout_us(MicrosSince(m->blackout_start));
  // Post-copy: the source copy serves the destination's last pages until
  // they have all gone; past the restore nothing can bring it back.
  absl::Status pages = absl::OkStatus();
  if (m->lazy_dump.joinable()) {
    SetPhase(m, "postcopy", absl::StrCat(m->rec.destination(), " takes the last pages"));
    pages = EndLazyDump(m, /*cancel=*/false);
    if (!pages.ok())
      pages = Annotate(
          pages, absl::StrCat("post-copy: the process is lost (its copy on ", m->rec.destination(),
                              " is killed there without its pages; the one here "
                              "cannot go on, its peers follow the other)"));
  }
  SetPhase(m, "cleanup");
  // A restore elsewhere left no copy here; a move left one, stopped.
  const absl::Status killed =
      m->rec.stopped() ? KillCopy(TreeRoot(m->rec), "stopped source copy") : absl::OkStatus();
  if (r->kind() == "restore") r->set_pid(m->rec.restored_pid());
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(m->dir, ec))
    if (e.is_directory()) std::filesystem::remove_all(e.path(), ec);
  absl::Status st = peers;
  if (!resumed.ok()) st = resumed;
  if (!pages.ok()) st = pages;
  if (!killed.ok()) st = killed;
  if (!m->member_errors.empty())
    st = absl::UnavailableError(
        absl::StrCat("further endpoints of the tree: ", absl::StrJoin(m->member_errors, "; "),
                     st.ok() ? "" : absl::StrCat("; ", st.message())));
  if (!st.ok()) r->set_error(absl::StrCat("the endpoint moved, but: ", st.message()));
  Finish(m, st);
  return st;
}

std::vector<Migrator::Move*> Migrator::TreeMoves(
    Move* lead, const std::vector<std::unique_ptr<Move>>& members) {
  std::vector<Move*> all = {lead};
  for (const std::unique_ptr<Move>& mm : members) all.push_back(mm.get());
  return all;
}

v1::ReconnectPeersRequest Migrator::TreeRequest(Move* lead,
                                                const std::vector<std::unique_ptr<Move>>& members,
                                                const std::vector<v1::Mapping>& mappings) {
  v1::ReconnectPeersRequest req;
  req.set_migration_id(lead->rec.report().migration_id());
  *req.mutable_mapping() = mappings.front();
  for (size_t i = 1; i < mappings.size(); ++i) *req.add_more_mappings() = mappings[i];
  for (const std::unique_ptr<Move>& mm : members)
    req.add_more_migration_ids(mm->rec.report().migration_id());
  return req;
}

std::vector<std::string> Migrator::TreePeerHosts(const std::vector<Move*>& moves,
                                                 const std::string& skip) {
  std::set<std::string> hosts;
  bool local = false;
  for (Move* x : moves) {
    local = local || x->rec.local_peers();
    for (const std::string& t : x->rec.peer_hosts())
      if (t != skip) hosts.insert(t);
  }
  std::vector<std::string> out;
  if (local && !skip.empty()) out.push_back("");
  out.insert(out.end(), hosts.begin(), hosts.end());
  return out;
}

void Migrator::CompleteLinked(Move* lead, const std::vector<std::unique_ptr<Move>>& members) {
  const std::vector<Move*> all = TreeMoves(lead, members);
  std::vector<v1::Mapping> mappings;
  for (Move* x : all) mappings.push_back(x->rec.new_mapping());
  for (Move* x : all) SetPhase(x, "reconnect");
  const absl::Time c0 = absl::Now();
  const v1::ReconnectPeersRequest req = TreeRequest(lead, members, mappings);
  // Every peer host at once, each peer re-pointed at all the endpoints in
  // one step; the destination last: the endpoints at each other, its own
  // peers, then the endpoints resumed.
  const std::string dest = lead->rec.destination();
  const absl::Status peers = ReconnectOn(lead, TreePeerHosts(all, dest), req);
  v1::ReconnectPeersRequest last = req;
  last.set_resume_endpoint(true);
  for (Move* x : all) last.add_tree_pids(x->rec.report().pid());
  const absl::Status resumed =
      ReconnectPeersOn(lead, dest, last, absl::StrCat("resuming the tree's endpoints on ", dest))
          .status();
  for (const std::unique_ptr<Move>& mm : members) {
    if (absl::Status done = Conclude(mm.get(), c0, peers, resumed); !done.ok())
      lead->member_errors.push_back(
          absl::StrCat("process ", mm->rec.report().pid(), ": ", done.message()));
  }
  (void)Conclude(lead, c0, peers, resumed);
}

void Migrator::RollBackLinked(Move* lead, const std::vector<std::unique_ptr<Move>>& members,
                              const absl::Status& cause) {
  const std::vector<Move*> all = TreeMoves(lead, members);
  bool released = false;
  for (Move* x : all) released = released || x->rec.released();
  if (!released) {
    // Every endpoint kept its QPs: each one's rollback resumes it and its
    // peers as they were.
    for (Move* x : all) RollBack(x, cause);
    return;
  }
  std::vector<v1::Mapping> mappings;
  bool back = true;
  for (Move* x : all) {
    std::optional<v1::Mapping> now;
    RollBack(x, cause, &now);
    if (now.has_value()) {
      mappings.push_back(*now);
    } else {
      back = false;
    }
  }
  std::vector<std::string> problems;
  if (!back) {
    // One that is not back: the others and every peer stay paused rather
    // than post to QPs that are gone (as for one endpoint); said below.
    problems.push_back("not every endpoint of the tree is back: they and their peers stay paused");
  } else {
    const v1::ReconnectPeersRequest req = TreeRequest(lead, members, mappings);
    if (absl::Status st = ReconnectOn(lead, TreePeerHosts(all, ""), req); !st.ok())
      problems.push_back(std::string(st.message()));
    // Here: the endpoints at each other, this host's peers, then the
    // endpoints resumed.
    v1::ReconnectPeersRequest here = req;
    here.set_resume_endpoint(true);
    here.set_endpoint_pid(lead->rec.report().pid());
    for (Move* x : all) here.add_tree_pids(x->rec.report().pid());
    if (absl::StatusOr<v1::ReconnectPeersResponse> r = ReconnectHere(here); !r.ok())
      problems.push_back(std::string(r.status().message()));
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    v1::MigrationReport* r = (*it)->rec.mutable_report();
    if (!problems.empty()) {
      r->set_rolled_back(false);
      r->set_error(
          absl::StrCat(r->error(), " (rollback of the tree: ", absl::StrJoin(problems, "; "), ")"));
    }
    Finish(*it, cause);
  }
}

// A copy of a moved process that must not stay: the source's stopped copy
// once the process runs on the destination, or a destination's restored
// copy once its move is aborted. A kill that does not take (a task stuck in
// the kernel) is tried again, then said: a report must not claim one copy
// while two exist.
bool Migrator::SameProcess(pid_t pid, const std::string& identity) {
  if (pid <= 0) return false;
  return identity.empty() ? procs_->Exists(pid) : procs_->Identity(pid) == identity;
}

absl::Status Migrator::KillCopy(pid_t pid, const char* which) {
  absl::Status st;
  for (int attempt = 0; attempt < 3; ++attempt) {
    st = procs_->Kill(pid);
    if (st.ok() || !procs_->Exists(pid)) return absl::OkStatus();
    Log("killing the %s (pid %d, attempt %d): %s", which, pid, attempt + 1, st.ToString());
  }
  return absl::InternalError(absl::StrCat(
      "the ", which, " (pid ", pid, ") could not be killed and stays stopped: ", st.message()));
}

// Asks the destination of a prepared move to drop it (kill what it
// restored, delete the images). A destination that does not answer may
// hold a restored copy, paused: it resumes only on this host's word, which
// will not come; still, the failure is said, never dropped.
absl::Status Migrator::AbortOnDestination(Move* m) {
  if (!m->prepared) return absl::OkStatus();
  v1::AbortIncomingRequest a;
  a.set_migration_id(m->rec.report().migration_id());
  v1::Transfer::StubInterface* dest = Stub(m, m->rec.destination());
  absl::StatusOr<v1::AbortIncomingResponse> ar = Rpc<v1::AbortIncomingResponse>(
      options_.rpc_timeout, absl::StrCat("aborting on ", m->rec.destination()),
      [&](grpc::ClientContext* c, v1::AbortIncomingResponse* out) {
        return dest->AbortIncoming(c, a, out);
      });
  if (ar.ok()) return absl::OkStatus();
  Log("migration %s: %s", m->rec.report().migration_id(), ar.status().ToString());
  return absl::Status(
      ar.status().code(),
      absl::StrCat(ar.status().message(),
                   m->restore_asked
                       ? " (a restored copy may remain there, paused, until the move is aborted "
                         "there)"
                       : " (what it received stays there until its migrator restarts)"));
}

void Migrator::RollBack(Move* m, const absl::Status& cause, std::optional<v1::Mapping>* paused) {
  v1::MigrationReport* r = m->rec.mutable_report();
  const pid_t pid = r->pid();
  r->set_error(std::string(cause.message()));
  SetPhase(m, "rollback", std::string(cause.message()));
  std::vector<std::string> problems;
  if (absl::Status st = AbortOnDestination(m); !st.ok())
    problems.push_back(std::string(st.message()));
  bool back = true;
  bool peers_done = false;
  if (m->rec.addresses_moved()) {
    if (absl::Status st = AddAddresses(m->rec); !st.ok()) {
      problems.push_back(absl::StrCat("adding the service addresses back: ", st.message()));
    } else {
      m->rec.set_addresses_moved(false);
      Persist(m);
    }
  }
  if (m->rec.stopped()) {
    if (absl::Status st = procs_->Continue(TreeRoot(m->rec)); !st.ok())
      problems.push_back(st.ToString());
  }
  // Released, or maybe not (its answer was lost): a shim still connected
  // and running was not.
  bool connected_running = false;
  for (const ShimInfo& s : shims_->Connected())
    if (s.pid == pid && s.phase == v1::ENDPOINT_PHASE_RUNNING) connected_running = true;
  if (m->rec.released() && !connected_running) {
    absl::StatusOr<v1::EndpointSummary> e = BringBack(pid, FirstActiveDeviceName(), {});
    if (!e.ok()) {
      // Its peers stay suspended: resumed, they would post to a QP that
      // is gone. The report says so.
      back = false;
      problems.push_back(absl::StrCat("restoring on the source: ", e.status().message()));
    } else {
      m->rec.set_released(false);
      Persist(m);
      peers_done = true;
      if (paused != nullptr) {
        *paused = e->mapping();
      } else {
        if (absl::Status st = ReconnectAll(m, e->mapping(), false); !st.ok())
          problems.push_back(std::string(st.message()));
        v1::MigratorToShim res;
        res.mutable_resume();
        absl::StatusOr<v1::Reply> rr = Command(pid, res, options_.rpc_timeout, "resume");
        if (!rr.ok()) problems.push_back(std::string(rr.status().message()));
      }
    }
  } else if (paused != nullptr) {
    // Its QPs are as they were (quiesced, or not even that): re-pointed
    // with the tree's all the same.
    *paused = m->rec.endpoint().mapping();
    peers_done = true;
  } else if (m->rec.quiesced()) {
    v1::MigratorToShim res;
    res.mutable_resume();
    absl::StatusOr<v1::Reply> rr = Command(pid, res, options_.rpc_timeout, "resume");
    if (!rr.ok()) {
      back = false;
      problems.push_back(std::string(rr.status().message()));
    }
  }
  // A restore's peers were paused by the checkpoint, not by this move:
  // they stay paused for the next restore.
  if (back && !peers_done && r->kind() != "restore" &&
      (m->rec.local_peers() || m->rec.peer_hosts_size() > 0)) {
    // The endpoint kept its QPs: its peers resume as they were.
    if (absl::Status st = ReconnectAll(m, m->rec.endpoint().mapping(), true); !st.ok())
      problems.push_back(std::string(st.message()));
  }
  r->set_rolled_back(back);
  if (!problems.empty())
    r->set_error(absl::StrCat(cause.message(), " (rollback: ", absl::StrJoin(problems, "; "), ")"));
  r->mutable_breakdown()->set_blackout_us(
      m->blackout_start == absl::InfiniteFuture() ? 0 : MicrosSince(m->blackout_start));
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(m->dir, ec))
    if (e.is_directory()) std::filesystem::remove_all(e.path(), ec);
  if (paused == nullptr) Finish(m, cause);
}

absl::Status Migrator::Migrate(const v1::MigrateRequest& request, const ProgressSink& sink) {
  // The process named moves with its descendants (what CRIU dumps); the
  // one among them under the shim is the endpoint.
  const pid_t root = request.pid();
  if (root <= 0) return absl::InvalidArgumentError(absl::StrCat("invalid pid ", root));
  absl::StatusOr<HostPort> dest = ParseHostPort(request.destination(), options_.port);
  if (!dest.ok()) return Annotate(dest.status(), "destination");
  // First: a process in the middle of its move has no shim to ask.
  {
    absl::MutexLock lock(&mu_);
    if (!moving_.insert(root).second)
      return absl::FailedPreconditionError(absl::StrCat("process ", root, " is already moving"));
  }
  absl::Cleanup unbusy = [&] { DoneMoving(root); };
  absl::StatusOr<std::vector<pid_t>> endpoints = EndpointsOfTree(root);
  if (!endpoints.ok()) return endpoints.status();
  const pid_t pid = endpoints->front();
  std::vector<pid_t> busy;  // the endpoints, besides the root
  absl::Cleanup unbusy_endpoints = [&] {
    for (pid_t p : busy) DoneMoving(p);
  };
  {
    absl::MutexLock lock(&mu_);
    for (pid_t e : *endpoints) {
      if (e == root) continue;
      if (!moving_.insert(e).second)
        return absl::FailedPreconditionError(absl::StrCat("process ", e, " is already moving"));
      busy.push_back(e);
    }
  }
  absl::StatusOr<std::string> terminal = TreeTerminal(root);
  if (!terminal.ok()) return terminal.status();
  if (absl::Status st = CheckTreeRdmaFiles(root, *endpoints); !st.ok()) return st;
  std::unique_ptr<Move> m = NewMove("migrate", pid, sink);
  m->rec.set_terminal(*terminal);
  if (pid != root) {
    m->rec.set_tree_root(root);
    m->rec.mutable_report()->set_tree_root(root);
  }
  const std::string target = dest->Target();
  m->rec.set_destination(target);
  m->rec.mutable_report()->set_destination(target);
  if (absl::Status st = LocateAddresses(request, &m->rec); !st.ok()) {
    st = Annotate(st, "nothing was quiesced");
    Finish(m.get(), st);
    return st;
  }

  // Nothing is touched until the destination said yes.
  SetPhase(m.get(), "prepare", target);
  absl::StatusOr<v1::EndpointSummary> e = Describe(pid);
  if (!m->record_error.ok()) e = m->record_error;
  if (!e.ok()) {
    const absl::Status st = Annotate(e.status(), "nothing was quiesced");
    Finish(m.get(), st);
    return st;
  }
  *m->rec.mutable_endpoint() = *e;
  m->rec.mutable_report()->set_endpoint_id(e->endpoint_id());
  absl::Status known = CheckPeersLocatable(*e);
  // One move per further endpoint of the tree, around this one.
  std::vector<std::unique_ptr<Move>> members;
  if (known.ok() && endpoints->size() > 1) known = MakeMembers(m.get(), *endpoints, &members);
  if (known.ok() && members.empty()) m->linked = ConnectedAmong({*e});
  if (known.ok()) known = ClaimMove(m.get());
  if (!known.ok()) {
    known = Annotate(known, "nothing was quiesced");
    for (const std::unique_ptr<Move>& mm : members) Finish(mm.get(), known);
    Finish(m.get(), known);
    return known;
  }
  absl::Cleanup unclaim = [&] { UnclaimMove(m.get()); };
  v1::PrepareRequest prep;
  prep.set_migration_id(m->rec.report().migration_id());
  *prep.mutable_endpoint() = *e;
  // With the prefix this host has for them.
  for (const std::string& a : m->rec.report().addresses()) prep.add_addresses(a);
  if (absl::Status st = PrepareDestination(m.get(), prep, "nothing was quiesced"); !st.ok()) {
    m->rec.mutable_report()->set_rolled_back(false);
    for (const std::unique_ptr<Move>& mm : members) Finish(mm.get(), st);
    Finish(m.get(), st);
    return st;
  }

  absl::Status st = RunSource(m.get(), request, members);
  if (!st.ok()) {
    // The tree first (continued on the source, the first endpoint back),
    // then each further endpoint, which needs its process running.
    if (m->linked) {
      RollBackLinked(m.get(), members, st);
      return st;
    }
    RollBack(m.get(), st);
    for (const std::unique_ptr<Move>& mm : members) RollBack(mm.get(), st);
    return st;
  }
  if (m->linked) {
    CompleteLinked(m.get(), members);
    return absl::OkStatus();
  }
  // Done: what went wrong after the restore (a peer not re-pointed) is in
  // the report, and the move is not undone for it. The further endpoints
  // are resumed first: the first one's completion ends the destination's
  // record of the tree.
  for (const std::unique_ptr<Move>& mm : members) {
    if (absl::Status done = CompleteForward(mm.get()); !done.ok())
      m->member_errors.push_back(
          absl::StrCat("process ", mm->rec.report().pid(), ": ", done.message()));
  }
  (void)CompleteForward(m.get());
  return absl::OkStatus();
}

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
  const pid_t pid = request.pid();
  if (absl::Status st = CheckShim(pid); !st.ok()) return st;
  absl::StatusOr<std::string> terminal = TreeTerminal(pid);
  if (!terminal.ok()) return terminal.status();
  if (absl::Status st = CheckTreeRdmaFiles(pid, {pid}); !st.ok()) return st;
  if (absl::Status st = ValidateCheckpointDir(request.dir()); !st.ok()) return st;
  {
    absl::MutexLock lock(&mu_);
    if (!moving_.insert(pid).second)
      return absl::FailedPreconditionError(absl::StrCat("process ", pid, " is already moving"));
  }
  absl::Cleanup unbusy = [&] { DoneMoving(pid); };
  std::unique_ptr<Move> m = NewMove("checkpoint", pid, sink);
  m->rec.mutable_report()->set_destination(request.dir());
  m->rec.set_image_dir(request.dir());
  m->rec.set_terminal(*terminal);
  v1::MigrationReport* r = m->rec.mutable_report();
  v1::Breakdown* b = r->mutable_breakdown();

  v1::EndpointSummary released;
  absl::Status st = QuiesceAndRelease(m.get(), &released);
  if (st.ok()) {
    SetPhase(m.get(), "dump", request.dir());
    const absl::Time d0 = absl::Now();
    absl::StatusOr<DumpStats> dump =
        criu_->Dump(pid, request.dir(), "", request.leave_running(), false);
    if (!dump.ok()) st = Annotate(dump.status(), "dump");
    if (st.ok()) {
      absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(request.dir());
      if (!files.ok())
        st = files.status();
      else {
        st = WriteManifest(request.dir(), MakeManifest(r->migration_id(), released, *files,
                                                       options_.host_name, m->rec.terminal()));
        r->set_bytes_moved(SumSizes(*files));
      }
    }
    b->set_final_dump_us(MicrosSince(d0));
    if (st.ok()) m->rec.set_dumped(true);
  }
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
    // The process is gone; its peers stay suspended until a restore.
    r->mutable_breakdown()->set_blackout_us(MicrosSince(m->blackout_start));
    Finish(m.get(), absl::OkStatus());
    return absl::OkStatus();
  }
  SetPhase(m.get(), "restore", "on this host");
  const absl::Time r0 = absl::Now();
  absl::StatusOr<v1::EndpointSummary> e = BringBack(pid, FirstActiveDeviceName(), {});
  if (!e.ok()) {
    // The checkpoint is good; the process is not running. Say so.
    st = Annotate(e.status(), "checkpoint written, but restoring the process in place failed");
    Finish(m.get(), st);
    return st;
  }
  b->set_rdma_restore_us(MicrosSince(r0));
  m->rec.set_released(false);
  SetPhase(m.get(), "reconnect");
  const absl::Time c0 = absl::Now();
  st = ReconnectAll(m.get(), e->mapping(), false);
  v1::MigratorToShim res;
  res.mutable_resume();
  absl::StatusOr<v1::Reply> rr = Command(pid, res, options_.rpc_timeout, "resume");
  if (st.ok() && !rr.ok()) st = rr.status();
  b->set_reconnect_us(MicrosSince(c0));
  b->set_blackout_us(MicrosSince(m->blackout_start));
  Finish(m.get(), st);
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
  v1::Breakdown* b = r->mutable_breakdown();
  r->set_endpoint_id(manifest->endpoint().endpoint_id());
  r->set_qps(manifest->endpoint().counts().qps());
  r->set_mrs(manifest->endpoint().counts().mrs());
  r->set_registered_bytes(manifest->endpoint().counts().registered_bytes());
  *m->rec.mutable_endpoint() = manifest->endpoint();
  m->rec.set_image_dir(request.dir());
  m->blackout_start = absl::Now();
  // The peers stayed suspended since the checkpoint (or resumed, if their
  // hosts restarted; they are re-pointed either way).
  absl::StatusOr<PeerHostSet> hosts = PeerHosts(manifest->endpoint());
  if (!hosts.ok()) {
    const absl::Status st = Annotate(hosts.status(), "nothing was restored");
    Finish(m.get(), st);
    return st;
  }
  hosts->named.insert(hosts->listed.begin(), hosts->listed.end());
  for (const std::string& t : hosts->named) {
    if (t.empty())
      m->rec.set_local_peers(true);
    else if (std::find(m->rec.peer_hosts().begin(), m->rec.peer_hosts().end(), t) ==
             m->rec.peer_hosts().end())
      m->rec.add_peer_hosts(t);
  }
  r->set_peers(m->rec.peer_hosts_size() + (m->rec.local_peers() ? 1 : 0));
  r->set_destination(on.has_value() ? on->Target() : options_.host_name);
  if (absl::Status st = ClaimMove(m.get()); !st.ok()) {
    st = Annotate(st, "nothing was restored");
    Finish(m.get(), st);
    return st;
  }
  absl::Cleanup unclaim = [&] { UnclaimMove(m.get()); };

  if (on.has_value()) {
    // The second half of a move: prepare, transfer, restore and resume as
    // Migrate does, and a failure rolled back by the same RollBack.
    m->rec.set_destination(on->Target());
    r->set_destination(on->Target());
    SetPhase(m.get(), "prepare", on->Target());
    v1::PrepareRequest prep;
    prep.set_migration_id(r->migration_id());
    *prep.mutable_endpoint() = manifest->endpoint();
    absl::Status st = PrepareDestination(m.get(), prep, "nothing was restored");
    if (!st.ok()) {
      Finish(m.get(), st);
      return st;
    }
    v1::Manifest sent = *manifest;
    sent.set_migration_id(r->migration_id());
    st = TransferFinal(m.get(), request.dir(), sent);
    if (st.ok()) st = RestoreOnDestination(m.get());
    if (!st.ok()) {
      RollBack(m.get(), st);
      return st;
    }
    return CompleteForward(m.get());
  }

  r->set_destination(options_.host_name);
  SetPhase(m.get(), "restore", "on this host");
  v1::RestoreIncomingResponse out;
  absl::StatusOr<pid_t> pid = RestoreFromDir(
      request.dir(), /*tcp_established=*/false, !manifest->terminal().empty(),
      /*lazy_from=*/nullptr, manifest->endpoint().pid(),
      [&](pid_t p) {
        m->rec.set_restored_pid(p);
        m->rec.set_restored_identity(procs_->Identity(p));
        Persist(m.get());
      },
      {}, &out);
  if (!pid.ok()) {
    Finish(m.get(), pid.status());
    return pid.status();
  }
  r->set_pid(out.pid());
  b->set_criu_restore_us(out.criu_restore_us());
  b->set_rdma_restore_us(out.rdma_restore_us());

  SetPhase(m.get(), "reconnect");
  const absl::Time c0 = absl::Now();
  absl::Status st = ReconnectAll(m.get(), out.endpoint().mapping(), false);
  v1::MigratorToShim res;
  res.mutable_resume();
  absl::StatusOr<v1::Reply> rr = Command(r->pid(), res, options_.rpc_timeout, "resume");
  if (st.ok() && !rr.ok()) st = rr.status();
  b->set_reconnect_us(MicrosSince(c0));
  b->set_blackout_us(MicrosSince(m->blackout_start));
  Finish(m.get(), st);
  return st;
}

}  // namespace rdmavirt::migrator
