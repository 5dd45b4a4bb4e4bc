// Reconnect: a moved (or rolled-back) endpoint's peers re-pointed at where
// it is now, on this host (ReconnectHere) and on every other host that has
// one (ReconnectPeers there, asked again while a restarting migrator does
// not answer). See migrator.h.
#include <map>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/addresses.h"
#include "migrator/host/failpoints.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

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
    // Past its deadline, a request may still be at work there (a host
    // slowed down or stopped for a while): asked again, that host answers
    // with its outcome (Migrator::ReconnectPeers).
    const bool again = r.status().code() == absl::StatusCode::kUnavailable ||
                       r.status().code() == absl::StatusCode::kDeadlineExceeded;
    if (r.ok() || !again || waited >= options_.restart_wait) {
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

absl::Status Migrator::ReconnectAll(Move* m, const v1::Mapping& mapping, bool resume_only,
                                    uint32_t* held) {
  v1::ReconnectPeersRequest req;
  req.set_migration_id(m->rec.report().migration_id());
  *req.mutable_mapping() = mapping;
  req.set_resume_only(resume_only);
  req.set_quiesce_attempt(m->rec.quiesce_attempt());
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

namespace {

// A mapping names both its GIDs, 16 bytes each; a resume needs only the
// virtual one. An endpoint that has opened no device yet (an RDMA CM
// listener: librdmacm opens one when a client comes) has no identity at
// all, and nothing to re-point.
bool HasGids(const v1::Mapping& m, bool resume_only) {
  if (m.virtual_gid().empty() && m.physical_gid().empty() && m.qpns().empty() && m.rkeys().empty())
    return true;
  return m.virtual_gid().size() == 16 && (resume_only || m.physical_gid().size() == 16);
}

}  // namespace

absl::StatusOr<v1::ReconnectPeersResponse> Migrator::ReconnectHere(
    const v1::ReconnectPeersRequest& request) {
  if (!HasGids(request.mapping(), request.resume_only()))
    return absl::InvalidArgumentError("a mapping needs its GIDs, 16 bytes each");
  ReachFailpoint(request.resume_endpoint() ? "serve:resume" : "serve:reconnect");
  for (const v1::Mapping& more : request.more_mappings())
    if (!HasGids(more, request.resume_only()))
      return absl::InvalidArgumentError("a mapping needs its GIDs, 16 bytes each");
  std::vector<std::string> ids = {request.migration_id()};
  ids.insert(ids.end(), request.more_migration_ids().begin(), request.more_migration_ids().end());
  const std::set<pid_t> tree(request.tree_pids().begin(), request.tree_pids().end());
  const std::set<pid_t> quiesced = PausedPeersOf(ids);
  v1::ReconnectPeersResponse out;
  // Re-pointed (or resumed), a peer is nobody's paused peer any more: the
  // set of the move that paused it may have another id (a checkpoint's
  // peers are re-pointed by the later restore).
  absl::Cleanup forget = [this, &ids, &out] { ForgetPeerSets(ids, out); };
  // A linked tree's endpoints first, at each other (they share their old
  // host's virtual GID: no lookup below finds them), staying paused.
  absl::Status first;
  if (!tree.empty() && !request.resume_only()) first = RepointTree(request, tree);
  const absl::Status peers = RepointPeers(request, PeersToRepoint(request, quiesced, tree), &out);
  if (first.ok()) first = peers;
  std::move(forget).Invoke();
  if (request.resume_endpoint()) {
    if (absl::Status st = ResumeTree(request); !st.ok() && first.ok()) first = st;
  }
  if (!first.ok()) return Annotate(first, options_.host_name);
  return out;
}

std::set<pid_t> Migrator::PausedPeersOf(const std::vector<std::string>& ids) {
  std::set<pid_t> quiesced;
  absl::MutexLock lock(&mu_);
  // Kept until they are re-pointed: a move of one of them is refused
  // until then (MarkQuiescing), or it would carry the old address along.
  for (const std::string& id : ids) {
    auto it = peer_sets_.find(id);
    if (it != peer_sets_.end()) quiesced.insert(it->second.begin(), it->second.end());
  }
  return quiesced;
}

void Migrator::ForgetPeerSets(const std::vector<std::string>& ids,
                              const v1::ReconnectPeersResponse& out) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : ids) peer_sets_.erase(id);
  for (auto it = peer_sets_.begin(); it != peer_sets_.end();) {
    for (pid_t p : out.pids()) it->second.erase(p);
    it = it->second.empty() ? peer_sets_.erase(it) : std::next(it);
  }
}

absl::Status Migrator::PeerQuiesce(pid_t pid, const std::string& virtual_gid, const char* what) {
  v1::MigratorToShim q;
  q.mutable_peer_quiesce()->set_virtual_gid(virtual_gid);
  q.mutable_peer_quiesce()->set_drain_timeout_ms(options_.drain_timeout_ms);
  return Command(pid, q, absl::Milliseconds(options_.drain_timeout_ms) + options_.rpc_timeout, what)
      .status();
}

absl::Status Migrator::RepointTree(const v1::ReconnectPeersRequest& request,
                                   const std::set<pid_t>& tree) {
  const std::vector<pid_t> pids(tree.begin(), tree.end());
  std::vector<absl::Status> repointed(pids.size());
  AllAtOnce(pids.size(), [&](size_t i) { repointed[i] = RepointTreeEndpoint(pids[i], request); });
  absl::Status first;
  for (size_t i = 0; i < pids.size(); ++i) {
    if (repointed[i].ok()) continue;
    Log("migration %s: process %d of the tree: %s", request.migration_id(), pids[i],
        repointed[i].ToString());
    if (first.ok()) first = repointed[i];
  }
  return first;
}

absl::Status Migrator::RepointTreeEndpoint(pid_t pid, const v1::ReconnectPeersRequest& request) {
  absl::StatusOr<v1::EndpointSummary> e = Describe(pid);
  if (!e.ok()) return e.status();
  if (!e->suspended()) {
    // Not quiesced yet when its move failed: the shim re-points only a
    // paused endpoint.
    if (absl::Status st =
            PeerQuiesce(pid, request.mapping().virtual_gid(), "tree endpoint quiesce");
        !st.ok())
      return st;
  }
  v1::MigratorToShim req;
  v1::PeerReconnect* pr = req.mutable_peer_reconnect();
  *pr->mutable_mapping() = request.mapping();
  for (const v1::Mapping& more : request.more_mappings()) *pr->add_more() = more;
  pr->set_keep_paused(true);
  return Command(pid, req, options_.rpc_timeout, "re-pointing the tree's endpoints").status();
}

std::map<pid_t, bool> Migrator::PeersToRepoint(const v1::ReconnectPeersRequest& request,
                                               const std::set<pid_t>& quiesced,
                                               const std::set<pid_t>& tree) {
  // Whoever points at the endpoint must be re-pointed, quiesced by us or
  // not (a restarted migrator forgot its set; a peer connected meanwhile).
  // At the endpoint's QPs only: other processes of its old host share its
  // virtual GID (a tree's other endpoints, moved a moment ago, whose peers
  // are running again), and their peers are not this move's.
  std::vector<const v1::Mapping*> mappings = {&request.mapping()};
  for (const v1::Mapping& more : request.more_mappings()) mappings.push_back(&more);
  std::map<pid_t, bool> targets;  // pid -> suspended
  for (pid_t p : quiesced) targets[p] = true;
  for (const v1::Mapping* each : mappings) {
    std::set<uint32_t> qpns;
    for (const v1::IdPair& q : each->qpns()) qpns.insert(q.virtual_id());
    for (const auto& [pid, suspended] : LocalPeersOf(each->virtual_gid(), qpns, false, 0))
      targets[pid] = targets[pid] || suspended || quiesced.contains(pid);
  }
  for (pid_t p : tree) targets.erase(p);
  if (request.resume_only()) {
    // A move that lets go of its peers (rolled back, or meeting another
    // move) resumes none that another move holds: paused as its peer, or
    // being quiesced for its own move. That move resumes it.
    absl::MutexLock lock(&mu_);
    for (auto it = targets.begin(); it != targets.end();)
      it = !quiesced.contains(it->first) && !HolderOf(it->first, request.migration_id()).empty()
               ? targets.erase(it)
               : std::next(it);
  }
  return targets;
}

absl::Status Migrator::RepointPeers(const v1::ReconnectPeersRequest& request,
                                    const std::map<pid_t, bool>& targets,
                                    v1::ReconnectPeersResponse* out) {
  // Each peer at once: each re-points its own QPs (one shim, one thread).
  const std::vector<std::pair<pid_t, bool>> peers(targets.begin(), targets.end());
  std::vector<bool> held(peers.size(), false);
  std::vector<absl::Status> result(peers.size());
  AllAtOnce(peers.size(), [&](size_t i) {
    bool is_held = false;
    result[i] = RepointPeer(peers[i].first, peers[i].second, request, &is_held);
    held[i] = is_held;
    if (!result[i].ok()) Log("migration %s: %s", request.migration_id(), result[i].ToString());
  });
  absl::Status first;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (held[i]) {
      out->add_held_pids(peers[i].first);
    } else if (result[i].ok()) {
      out->add_pids(peers[i].first);
    } else if (first.ok()) {
      first = result[i];
    }
  }
  return first;
}

absl::Status Migrator::RepointPeer(pid_t pid, bool suspended,
                                   const v1::ReconnectPeersRequest& request, bool* held) {
  const v1::Mapping& m = request.mapping();
  {
    // Released itself: it learns where the endpoint is when it comes back.
    absl::MutexLock lock(&mu_);
    auto it = held_peers_.find(pid);
    if (it != held_peers_.end()) {
      if (!request.resume_only()) it->second[m.virtual_gid()] = m;
      *held = true;
      return absl::OkStatus();
    }
  }
  if (request.resume_only()) return ResumeEndpoint(pid);
  // The shim re-points only a paused endpoint.
  if (!suspended) {
    if (absl::Status st = PeerQuiesce(pid, m.virtual_gid(), "peer quiesce"); !st.ok()) return st;
  }
  // Drained, it sends nothing until the re-point resumes it: from here
  // its QPs look their routes up again, toward the new address
  // (AddressControl::ForgetCachedRoutes).
  if (absl::Status st = addresses_->ForgetCachedRoutes(); !st.ok())
    return Annotate(st, "making the peer's QPs look their routes up again");
  v1::MigratorToShim req;
  *req.mutable_peer_reconnect()->mutable_mapping() = m;
  for (const v1::Mapping& more : request.more_mappings())
    *req.mutable_peer_reconnect()->add_more() = more;
  absl::Status st = Command(pid, req, options_.rpc_timeout, "peer reconnect").status();
  // A peer that ended between its quiesce and now (its workload done) has
  // nothing left to re-point: the move is not the worse for it.
  if (absl::IsNotFound(st) && !procs_->Exists(pid)) {
    Log("migration %s: peer %d ended before its re-point", request.migration_id(), pid);
    return absl::OkStatus();
  }
  return st;
}

absl::Status Migrator::ResumeTree(const v1::ReconnectPeersRequest& request) {
  absl::Status first;
  // A linked tree's further endpoints; ResumeMoved takes the first.
  for (size_t i = 1; i < static_cast<size_t>(request.tree_pids_size()); ++i) {
    const absl::Status r = ResumeEndpoint(request.tree_pids(i));
    {
      absl::MutexLock arriving(&mu_);
      arriving_.erase(request.tree_pids(i));
    }
    if (!r.ok() && first.ok()) first = r;
  }
  if (absl::Status st = ResumeMoved(request); !st.ok() && first.ok()) first = st;
  return first;
}

}  // namespace rdmavirt::migrator
