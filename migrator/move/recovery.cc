// What a restarted migrator does with the moves its previous run left in
// flight (Migrator::Recover). The record of each says how far it got:
//  - source, destination not yet confirmed: roll back (the process is
//    SIGSTOPped and/or released: SIGCONT, resume marker, restore on this
//    host's HCA, peers re-pointed; if it is gone but its final dump is
//    complete, CRIU-restore it here first);
//  - source, destination confirmed: finish (peers re-pointed at the
//    destination, the endpoint resumed there, the stopped source killed);
//  - destination, not restored: abort (kill a half-restored process,
//    delete the images);
//  - destination, restored: keep the process, wait for the source's
//    ReconnectPeers to resume it.
//  - post-copy (postcopy.cc): a confirmed move's source waits for its
//    page server's end; one that goes back ends it first; a destination
//    watches its lazy-pages daemon, and kills the process if its pages
//    cannot all come.
//  - a tree's further endpoints (tree_lead) follow the tree's first move:
//    brought back on its destination when that move finishes there, put
//    back here once it has rolled back (the tree running again);
// A pid of a record is acted on only while it names the same process (its
// ProcessControl::Identity): after a reboot, or once the process died and
// its pid was given to another, the record's process is gone, and the
// stranger is neither signalled nor killed.
#include <algorithm>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/move/record_store.h"

namespace rdmavirt::migrator {
namespace {

// A process that still runs reconnects to the new socket within a second.
constexpr absl::Duration kReconnectGrace = absl::Seconds(5);

// The move finishes on its destination (RecoverSource's first case).
bool GoesForward(const v1::MigrationRecord& rec) {
  const std::string& kind = rec.report().kind();
  return (kind == "migrate" || kind == "restore") && rec.confirmed() && !rec.destination().empty();
}

}  // namespace

void Migrator::Recover() {
  // Moves into this host first: a source's steps of one (its resume, its
  // abort) are answered as soon as they are known again, not after this
  // host's own moves. Two hosts restarted together with moves toward each
  // other each ask the other to resume theirs (RecoverSource), and would
  // otherwise wait for each other until one gave up.
  // Only a previous run's: this one serves already (main() recovers on a
  // thread of its own, after `criu check`), and a move it began meanwhile
  // is in flight, not left over. (Before, a move begun in that window was
  // rolled back under its own feet.)
  auto previous_run = [this](const v1::MigrationRecord& rec) {
    return !rec.done() && !BegunHere(rec.report().migration_id());
  };
  for (auto& [dir, rec] : ListRecords(options_.state_dir + "/incoming")) {
    if (previous_run(rec)) {
      RecoverDestination(dir, std::move(rec));
    } else if (rec.done() && rec.confirmed() && rec.postcopy().pid() > 0 &&
               !BegunHere(rec.report().migration_id())) {
      // Resumed, its last pages maybe still coming.
      WatchPostCopy(rec);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    incoming_known_ = true;
  }
  // A tree's further endpoints need its process running here to come
  // back here, and its first move's record on the destination to come
  // back there: first moves that go back, then further endpoints, then
  // first moves that go forward.
  auto sources = ListRecords(options_.state_dir + "/migrations");
  std::map<std::string, bool> tree_forward;  // a first move's id -> its tree is on its destination
  for (const auto& [dir, rec] : sources)
    tree_forward[rec.report().migration_id()] =
        rec.done() ? rec.report().ok() && rec.report().kind() == "migrate" : GoesForward(rec);
  for (auto& [dir, rec] : sources)
    if (previous_run(rec) && rec.tree_lead().empty() && !GoesForward(rec)) RecoverSource(dir, rec);
  for (auto& [dir, rec] : sources)
    if (previous_run(rec) && !rec.tree_lead().empty())
      RecoverSource(dir, rec, tree_forward[rec.tree_lead()]);
  for (auto& [dir, rec] : sources)
    if (previous_run(rec) && rec.tree_lead().empty() && GoesForward(rec)) RecoverSource(dir, rec);
}

absl::Status Migrator::AwaitRecovery(const std::string& id, bool shims_too) {
  const absl::Time deadline = absl::Now() + options_.rpc_timeout / 2;
  bool ready = mu_.AwaitWithDeadline(absl::Condition(&incoming_known_), deadline);
  // The shims connected to the previous run say Hello again meanwhile:
  // the peers a re-point must find.
  const absl::Time shims_back = started_ + options_.shims_return_within;
  if (ready && shims_too && absl::Now() < shims_back) {
    static const bool kNever = false;  // mu_ released until then
    mu_.AwaitWithDeadline(absl::Condition(&kNever), std::min(shims_back, deadline));
    ready = absl::Now() >= shims_back;
  }
  if (ready) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      options_.host_name, " is still finding again what its previous run left ",
      "(moves in flight, the shims' connections) before a step of ", id, "; ask again"));
}

void Migrator::RecoverSource(const std::string& dir, v1::MigrationRecord record,
                             bool tree_forward) {
  Move m;
  m.rec = std::move(record);
  m.dir = dir;
  m.start = absl::Now();
  m.blackout_start = absl::Now();
  m.prepared = !m.rec.destination().empty();
  v1::MigrationReport* r = m.rec.mutable_report();
  const pid_t pid = r->pid();
  Log("recovery: migration %s (%s of pid %d) was in phase %s", r->migration_id(), r->kind(), pid,
      m.rec.phase());
  {
    absl::MutexLock lock(&mu_);
    moving_.insert(pid);
  }
  const absl::Status cause = absl::AbortedError(absl::StrCat(
      "rdmavirt-migratord restarted during the ", r->kind(), " (phase ", m.rec.phase(), ")"));
  // A post-copy's page server of a move that goes back lets go of the
  // process first.
  if (!m.rec.confirmed()) StopPostCopyHelper(m.rec.postcopy());
  const bool alive = SourceProcessAlive(&m);

  if (!m.rec.tree_lead().empty() && !m.rec.confirmed() && tree_forward) {
    // Its tree runs on the destination, its endpoint released there.
    if (absl::Status st = BringBackMember(&m); !st.ok()) {
      r->set_error(absl::StrCat(cause.message(), "; its tree moved to ", m.rec.destination(),
                                ", where it was not brought back: ", st.message()));
      Finish(&m, cause);
    } else {
      (void)CompleteForward(&m);
    }
  } else if ((r->kind() == "migrate" || r->kind() == "restore") && m.rec.confirmed() &&
             !m.rec.destination().empty()) {
    // The endpoint lives on the destination: finish the move.
    (void)CompleteForward(&m);
  } else if (r->kind() == "restore" && !m.rec.destination().empty()) {
    // Restored elsewhere maybe, never resumed: the destination drops it.
    RollBack(&m, cause);
  } else if (r->kind() == "restore") {
    if (SameProcess(m.rec.restored_pid(), m.rec.restored_identity()))
      (void)procs_->Kill(m.rec.restored_pid());
    Finish(&m, cause);
  } else if (!alive && m.rec.dumped() && r->kind() == "migrate") {
    RestoreFinalDumpHere(&m, cause);
  } else if (!alive) {
    r->set_error(absl::StrCat(cause.message(), "; process ", pid,
                              " is gone and no complete dump of it exists"));
    Finish(&m, cause);
  } else {
    if (!m.rec.released()) {
      // Quiesced at most: it reconnects on its own, say Hello RUNNING.
      (void)shims_->WaitHello(pid, v1::ENDPOINT_PHASE_RUNNING, kReconnectGrace);
    }
    RollBack(&m, cause);
  }
  DoneMoving(pid);
}

bool Migrator::SourceProcessAlive(Move* m) {
  const pid_t pid = m->rec.report().pid();
  const bool alive = SameProcess(pid, m->rec.identity());
  if (!alive && procs_->Exists(pid)) {
    Log("recovery: migration %s: pid %d is another process now (%s, was %s): left alone",
        m->rec.report().migration_id(), pid, procs_->Identity(pid), m->rec.identity());
  }
  if (!alive) {
    // Nothing of it here to continue, bring back or kill.
    m->rec.set_stopped(false);
    m->rec.set_released(false);
    m->rec.set_quiesced(false);
  }
  return alive;
}

void Migrator::RestoreFinalDumpHere(Move* m, const absl::Status& cause) {
  v1::MigrationReport* r = m->rec.mutable_report();
  const pid_t pid = r->pid();
  // Gone (killed with us?), but its final dump is whole: restore it here.
  SetPhase(m, "rollback", "restoring the final dump on this host");
  // Its service addresses come back first: CRIU binds its sockets to them.
  const bool tcp = m->rec.addresses_size() > 0;
  std::string addresses_error;
  if (m->rec.addresses_moved()) {
    if (absl::Status st = AddAddresses(m->rec); !st.ok())
      addresses_error = absl::StrCat("; adding the service addresses back: ", st.message());
    else
      m->rec.set_addresses_moved(false);
  }
  // A container's runtime still holds the dead one by its name: removed,
  // so that the restore can make it again.
  const v1::Container* container = m->rec.has_container() ? &m->rec.container() : nullptr;
  if (container != nullptr) (void)RemoveContainerCopy(*container, "dead source copy");
  v1::RestoreIncomingResponse out;
  absl::StatusOr<pid_t> back =
      RestoreFromDir(m->rec.image_dir(), tcp, !m->rec.terminal().empty(), /*lazy_from=*/nullptr,
                     /*postcopy=*/nullptr, pid, NoteRestored(m), {}, &out, container);
  if (!back.ok()) {
    r->set_error(absl::StrCat(cause.message(), addresses_error,
                              "; restoring the final dump failed: ", back.status().message()));
    Finish(m, cause);
  } else {
    // The endpoint keeps its pid (CRIU gives every pid back).
    r->set_pid(out.pid());
    m->rec.set_identity(procs_->Identity(out.pid()));
    m->rec.set_released(false);
    m->rec.set_stopped(false);
    absl::Status peers = ReconnectAll(m, out.endpoint().mapping(), false);
    const absl::Status rr = ResumeEndpoint(out.pid());
    r->set_rolled_back(rr.ok());
    r->set_error(absl::StrCat(cause.message(), addresses_error));
    if (!peers.ok()) r->set_error(absl::StrCat(r->error(), "; ", peers.message()));
    Finish(m, cause);
  }
}

void Migrator::RecoverDestination(const std::string& dir, v1::MigrationRecord record) {
  auto in = std::make_unique<Incoming>();
  in->dir = dir;
  absl::MutexLock lock(&in->mu);
  in->rec = std::move(record);
  const std::string id = in->rec.report().migration_id();
  if (in->rec.confirmed()) {
    // Restored and confirmed: the source finishes the move and resumes it.
    Log("recovery: incoming %s: restored process %d kept for its source", id,
        in->rec.restored_pid());
    if (in->rec.postcopy().pid() > 0) WatchPostCopy(in->rec);
    absl::MutexLock l(&mu_);
    incoming_[id] = std::move(in);
    return;
  }
  (void)DropIncoming(in.get(), "rdmavirt-migratord restarted before the restore completed");
}

}  // namespace rdmavirt::migrator
