// Migrate (Operator), the move of a process tree to another host, and the
// steps a move shares with a restore elsewhere: the destination's prepare,
// the final images' transfer, the restore there, and the completion that
// re-points the peers and resumes the endpoint. See migrator.h.
#include <filesystem>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/criu/image_stream.h"
#include "migrator/host/addresses.h"
#include "migrator/host/containers.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

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
  // A previous run's page server (a restart during the post-copy) is
  // waited for by its record.
  absl::Status pages = absl::OkStatus();
  const bool resumed_postcopy = !m->lazy_dump.joinable() && m->rec.postcopy().pid() > 0;
  if (m->lazy_dump.joinable() || resumed_postcopy) {
    SetPhase(m, "postcopy", absl::StrCat(m->rec.destination(), " takes the last pages"));
    pages = resumed_postcopy ? AwaitPostCopy(m->rec.postcopy(), options_.transfer_timeout)
                             : EndLazyDump(m, /*cancel=*/false);
    if (!pages.ok())
      pages = Annotate(
          pages, absl::StrCat("post-copy: the process is lost (its copy on ", m->rec.destination(),
                              " is killed there without its pages; the one here "
                              "cannot go on, its peers follow the other)"));
  }
  SetPhase(m, "cleanup");
  // A restore elsewhere left no copy here; a move left one, stopped.
  const absl::Status killed = !m->rec.stopped() ? absl::OkStatus()
                              : m->rec.has_container()
                                  ? RemoveContainerCopy(m->rec.container(), "stopped source copy")
                                  : KillCopy(TreeRoot(m->rec), "stopped source copy");
  if (r->kind() == "restore") r->set_pid(m->rec.restored_pid());
  RemoveStepDirs(m);
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

absl::Status Migrator::Migrate(const v1::MigrateRequest& request, const ProgressSink& sink) {
  // The process named moves with its descendants (what CRIU dumps); the
  // one among them under the shim is the endpoint.
  // A container moves whole, from its first process.
  pid_t root = request.pid();
  std::optional<v1::Container> container;
  if (!request.container().empty()) {
    if (request.postcopy())
      return absl::InvalidArgumentError("a container moves without post-copy");
    absl::StatusOr<v1::Container> c = MovableContainer(request.container(), &root);
    if (!c.ok()) return c.status();
    container = *std::move(c);
  }
  if (root <= 0) return absl::InvalidArgumentError(absl::StrCat("invalid pid ", root));
  absl::StatusOr<HostPort> dest = ParseHostPort(request.destination(), options_.port);
  if (!dest.ok()) return Annotate(dest.status(), "destination");
  // First: a process in the middle of its move has no shim to ask.
  if (absl::Status st = MarkMoving(root); !st.ok()) return st;
  absl::Cleanup unbusy = [&] { DoneMoving(root); };
  absl::StatusOr<std::vector<pid_t>> endpoints = EndpointsOfTree(root);
  if (!endpoints.ok()) return endpoints.status();
  const pid_t pid = endpoints->front();
  std::vector<pid_t> busy;  // the endpoints, besides the root
  absl::Cleanup unbusy_endpoints = [&] {
    for (pid_t p : busy) DoneMoving(p);
  };
  for (pid_t e : *endpoints) {
    if (e == root) continue;
    if (absl::Status st = MarkMoving(e); !st.ok()) return st;
    busy.push_back(e);
  }
  // A container's terminal, if it had one, would be its runtime's.
  absl::StatusOr<std::string> terminal = container.has_value() ? std::string() : TreeTerminal(root);
  if (!terminal.ok()) return terminal.status();
  if (absl::Status st = CheckTreeDevices(root, *endpoints); !st.ok()) return st;
  if (container.has_value()) {
    if (endpoints->size() > 1)
      return absl::FailedPreconditionError(absl::StrCat(
          "container ", container->name(), " has ", endpoints->size(),
          " processes under the shim: a container moves with one (a job of several, as MPI's, "
          "moves as a process tree)"));
    container->set_endpoint_pid_inside(options_.containers->PidInside(pid));
  }
  std::unique_ptr<Move> m = NewMove("migrate", pid, sink);
  m->rec.set_terminal(*terminal);
  if (container.has_value()) {
    *m->rec.mutable_container() = *container;
    m->rec.mutable_report()->set_container(container->name());
  }
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
  std::vector<std::unique_ptr<Move>> members;
  if (absl::Status st = DescribeMove(m.get(), *endpoints, &members); !st.ok()) return st;
  absl::Cleanup unclaim = [&] { UnclaimMove(m.get()); };
  if (absl::Status st = PrepareMigration(m.get(), members); !st.ok()) return st;
  absl::Status st = RunSource(m.get(), request, members);
  if (!st.ok()) {
    RollBackTree(m.get(), members, st);
    return st;
  }
  CompleteTree(m.get(), members);
  return absl::OkStatus();
}

absl::Status Migrator::DescribeMove(Move* m, const std::vector<pid_t>& endpoints,
                                    std::vector<std::unique_ptr<Move>>* members) {
  const pid_t pid = m->rec.report().pid();
  SetPhase(m, "prepare", m->rec.destination());
  absl::StatusOr<v1::EndpointSummary> e = Describe(pid);
  if (!m->record_error.ok()) e = m->record_error;
  if (!e.ok()) {
    const absl::Status st = Annotate(e.status(), "nothing was quiesced");
    Finish(m, st);
    return st;
  }
  *m->rec.mutable_endpoint() = *e;
  m->rec.mutable_report()->set_endpoint_id(e->endpoint_id());
  absl::Status known = CheckPeersLocatable(*e);
  // One move per further endpoint of the tree, around this one.
  if (known.ok() && endpoints.size() > 1) known = MakeMembers(m, endpoints, members);
  if (known.ok() && members->empty()) m->linked = ConnectedAmong({*e});
  if (known.ok()) known = ClaimMove(m);
  if (!known.ok()) {
    known = Annotate(known, "nothing was quiesced");
    for (const std::unique_ptr<Move>& mm : *members) Finish(mm.get(), known);
    Finish(m, known);
    return known;
  }
  return absl::OkStatus();
}

absl::Status Migrator::PrepareMigration(Move* m,
                                        const std::vector<std::unique_ptr<Move>>& members) {
  v1::PrepareRequest prep;
  prep.set_migration_id(m->rec.report().migration_id());
  *prep.mutable_endpoint() = m->rec.endpoint();
  // With the prefix this host has for them.
  for (const std::string& a : m->rec.report().addresses()) prep.add_addresses(a);
  if (m->rec.has_container()) *prep.mutable_container() = m->rec.container();
  if (absl::Status st = PrepareDestination(m, prep, "nothing was quiesced"); !st.ok()) {
    m->rec.mutable_report()->set_rolled_back(false);
    for (const std::unique_ptr<Move>& mm : members) Finish(mm.get(), st);
    Finish(m, st);
    return st;
  }
  return absl::OkStatus();
}

void Migrator::RollBackTree(Move* m, const std::vector<std::unique_ptr<Move>>& members,
                            const absl::Status& cause) {
  // The tree first (continued on the source, the first endpoint back),
  // then each further endpoint, which needs its process running.
  if (m->linked) {
    RollBackLinked(m, members, cause);
    return;
  }
  RollBack(m, cause);
  for (const std::unique_ptr<Move>& mm : members) RollBack(mm.get(), cause);
}

void Migrator::CompleteTree(Move* m, const std::vector<std::unique_ptr<Move>>& members) {
  if (m->linked) {
    CompleteLinked(m, members);
    return;
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
  (void)CompleteForward(m);
}

}  // namespace rdmavirt::migrator
