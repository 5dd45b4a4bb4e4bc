// Rollback: a move that failed before its destination confirmed put back
// on this host (the destination aborts, the process continues, its
// endpoint is brought back and resumed, its peers re-pointed at it). See
// migrator.h.
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

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
  r->set_error(std::string(cause.message()));
  SetPhase(m, "rollback", std::string(cause.message()));
  std::vector<std::string> problems;
  if (absl::Status st = AbortOnDestination(m); !st.ok())
    problems.push_back(std::string(st.message()));
  ContinueHere(m, &problems);
  bool peers_done = false;
  const bool back = BringBackHere(m, paused, &problems, &peers_done);
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
  RemoveStepDirs(m);
  if (paused == nullptr) Finish(m, cause);
}

void Migrator::ContinueHere(Move* m, std::vector<std::string>* problems) {
  if (m->rec.addresses_moved()) {
    if (absl::Status st = AddAddresses(m->rec); !st.ok()) {
      problems->push_back(absl::StrCat("adding the service addresses back: ", st.message()));
    } else {
      m->rec.set_addresses_moved(false);
      Persist(m);
    }
  }
  if (m->rec.stopped()) {
    if (absl::Status st = procs_->Continue(TreeRoot(m->rec)); !st.ok())
      problems->push_back(st.ToString());
  }
}

bool Migrator::BringBackHere(Move* m, std::optional<v1::Mapping>* paused,
                             std::vector<std::string>* problems, bool* peers_done) {
  const pid_t pid = m->rec.report().pid();
  // Released, or maybe not (its answer was lost): a shim still connected
  // and running was not.
  bool connected_running = false;
  for (const ShimInfo& s : shims_->Connected())
    if (s.pid == pid && s.phase == v1::ENDPOINT_PHASE_RUNNING) connected_running = true;
  // Quiesced, and not back as running: released, its answer (or the
  // record of it) lost with a migrator that died meanwhile (the chaos
  // soak's source killed during the release).
  if ((m->rec.released() || m->rec.quiesced()) && !connected_running) {
    absl::StatusOr<v1::EndpointSummary> e = BringBack(pid, FirstActiveDeviceName(), {});
    if (!e.ok()) {
      // Its peers stay suspended: resumed, they would post to a QP that
      // is gone. The report says so.
      problems->push_back(absl::StrCat("restoring on the source: ", e.status().message()));
      return false;
    }
    m->rec.set_released(false);
    Persist(m);
    *peers_done = true;
    if (paused != nullptr) {
      *paused = e->mapping();
      return true;
    }
    if (absl::Status st = ReconnectAll(m, e->mapping(), false); !st.ok())
      problems->push_back(std::string(st.message()));
    if (absl::Status rr = ResumeEndpoint(pid); !rr.ok())
      problems->push_back(std::string(rr.message()));
    return true;
  }
  if (paused != nullptr) {
    // Its QPs are as they were (quiesced, or not even that): re-pointed
    // with the tree's all the same.
    *paused = m->rec.endpoint().mapping();
    *peers_done = true;
    return true;
  }
  if (m->rec.quiesced()) {
    if (absl::Status rr = ResumeEndpoint(pid); !rr.ok()) {
      problems->push_back(std::string(rr.message()));
      return false;
    }
  }
  return true;
}

}  // namespace rdmavirt::migrator
