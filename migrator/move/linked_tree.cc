// Trees with several endpoints: one move per further endpoint beside its
// first one (MakeMembers), brought back on the destination after it, and
// for a linked tree (endpoints connected to each other) its completion and
// rollback in one step per host. See migrator.h.
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

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

}  // namespace rdmavirt::migrator
