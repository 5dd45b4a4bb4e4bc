// Quiesce and release: an endpoint's peers drained toward it on every host
// that has one (QuiescePeers there), then the endpoint itself quiesced and
// released, its socket closed before CRIU dumps it. See migrator.h.
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/transport/frame.h"

namespace rdmavirt::migrator {

absl::Status Migrator::QuiescePeersOf(Move* m, const v1::EndpointSummary& e, absl::Time give_up) {
  v1::QuiescePeersRequest req;
  req.set_migration_id(HolderId(m->rec));
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
  return CountQuiesced(m, targets, listed, AskToQuiesce(m, req, targets, give_up));
}

std::vector<absl::StatusOr<v1::QuiescePeersResponse>> Migrator::AskToQuiesce(
    Move* m, const v1::QuiescePeersRequest& req, const std::vector<std::string>& targets,
    absl::Time give_up) {
  // All hosts at once: each drains its peers' QPs toward the endpoint. A
  // host where a younger move holds a peer is asked again until it lets go
  // (AwaitHeld), keeping what the others paused.
  std::vector<absl::StatusOr<v1::QuiescePeersResponse>> results(targets.size(),
                                                                absl::UnknownError("not asked"));
  AllAtOnce(targets.size(), [&](size_t i) {
    do {
      if (targets[i].empty()) {
        v1::QuiescePeersRequest here = req;
        for (pid_t p : m->tree_pids) here.add_tree_pids(p);
        results[i] = QuiescePeers(here);
        continue;
      }
      v1::Transfer::StubInterface* stub = m->stubs.at(targets[i]).get();
      results[i] = Rpc<v1::QuiescePeersResponse>(
          absl::Milliseconds(options_.drain_timeout_ms) + options_.rpc_timeout,
          absl::StrCat("quiescing the peers on ", targets[i]),
          [&](grpc::ClientContext* c, v1::QuiescePeersResponse* out) {
            return stub->QuiescePeers(c, req, out);
          });
    } while (absl::IsResourceExhausted(results[i].status()) && absl::Now() < give_up);
  });
  return results;
}

absl::Status Migrator::CountQuiesced(
    Move* m, const std::vector<std::string>& targets, const std::set<std::string>& listed,
    const std::vector<absl::StatusOr<v1::QuiescePeersResponse>>& results) {
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

// Two moves may meet: P and its peer Q each moving (toward each other,
// say), or two moves whose endpoints share a peer (every endpoint with a UD
// QP is the peer of every other such endpoint's move). One endpoint is
// quiesced with its peers at a time: a move is refused (ABORTED) when its
// endpoint is paused as another move's peer, and when a peer is being
// quiesced for its own move, was restored and not yet resumed, or is
// paused as another move's peer (QuiescePeers). Refused, a move lets go of
// the peers it paused so far, holding nothing another move could wait
// for, and tries again after a random 0.5 to 2 s (two moves that met do
// not meet again in step), for up to options_.busy_wait; then it is rolled
// back. Its pre-copy stays good: the final dump takes what changed since.
// A tree holds under its first move's id (HolderId): its endpoints never
// meet each other.
absl::StatusOr<v1::EndpointSummary> Migrator::QuiesceWhenFree(Move* m) {
  const absl::Time give_up = absl::Now() + options_.busy_wait;
  absl::BitGen gen;
  for (int attempt = 1;; ++attempt) {
    m->rec.set_quiesce_attempt(attempt);
    absl::StatusOr<v1::EndpointSummary> e = QuiesceThePeers(m, give_up);
    if (e.ok() || !absl::IsAborted(e.status()) || absl::Now() >= give_up) return e;
    // A tree's further endpoint refused: the tree's first one holds its
    // peers, and only the whole tree could let go; it is rolled back.
    if (!m->rec.tree_lead().empty()) return e;
    Log("migration %s: attempt %d to quiesce met another move: %s", m->rec.report().migration_id(),
        attempt, e.status().message());
    if (absl::Status st = LetGoOfPeers(m); !st.ok()) {
      Log("migration %s: letting go of the peers it paused: %s", m->rec.report().migration_id(),
          st.ToString());
      return e;  // the rollback resumes them
    }
    if (attempt == 1)
      SetPhase(m, "quiesce",
               absl::StrCat("waiting for another move (up to ",
                            absl::FormatDuration(options_.busy_wait), "): ", e.status().message()));
    absl::SleepFor(absl::Milliseconds(absl::Uniform(gen, 500, 2000)));
  }
}

absl::Status Migrator::LetGoOfPeers(Move* m) {
  {
    absl::MutexLock lock(&mu_);
    quiescing_.erase(m->rec.report().pid());
  }
  if (m->rec.local_peers() || m->rec.peer_hosts_size() > 0) {
    if (absl::Status st = ReconnectAll(m, m->rec.endpoint().mapping(), /*resume_only=*/true);
        !st.ok())
      return st;
  }
  m->rec.set_local_peers(false);
  m->rec.clear_peer_hosts();
  m->blackout_start = absl::InfiniteFuture();
  Persist(m);
  return absl::OkStatus();
}

absl::StatusOr<v1::EndpointSummary> Migrator::QuiesceThePeers(Move* m, absl::Time give_up) {
  const pid_t pid = m->rec.report().pid();
  // A guest's suspend pauses its endpoints together, each as the others'
  // peer and then as itself (guests.cc): it is not refused for that.
  if (m->rec.report().kind() != "suspend") {
    absl::Status st = MarkQuiescing(pid, HolderId(m->rec));
    while (absl::IsResourceExhausted(st) && absl::Now() < give_up)
      st = MarkQuiescing(pid, HolderId(m->rec));
    if (!st.ok()) return absl::AbortedError(st.message());
  }
  absl::StatusOr<v1::EndpointSummary> e = Describe(pid);
  if (!e.ok()) return e.status();
  *m->rec.mutable_endpoint() = *e;
  v1::MigrationReport* r = m->rec.mutable_report();
  r->set_endpoint_id(e->endpoint_id());
  r->set_qps(e->counts().qps());
  r->set_mrs(e->counts().mrs());
  r->set_registered_bytes(e->counts().registered_bytes());
  absl::Status st = QuiescePeersOf(m, *e, give_up);
  if (absl::IsAborted(st) || absl::IsResourceExhausted(st))
    return absl::AbortedError(absl::StrCat(st.message(), "; try again when its move is done"));
  if (!st.ok()) return st;
  return e;
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
  absl::StatusOr<v1::EndpointSummary> e = QuiesceWhenFree(m);
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

}  // namespace rdmavirt::migrator
