// A move's bookkeeping, shared by every sequence that runs one (outgoing
// moves, checkpoints and restores, guests' suspends, recovery, incoming
// moves' kills): its record and progress, its channels to other hosts, the
// sets that keep two moves of one process apart, and the kill of a copy
// that must not stay. See migrator.h.
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "migrator/host/failpoints.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/move/record_store.h"

namespace rdmavirt::migrator {

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

std::unique_ptr<Migrator::Move> Migrator::NewMove(const std::string& kind, pid_t pid,
                                                  const ProgressSink& sink) {
  auto m = std::make_unique<Move>();
  m->start = absl::Now();
  m->sink = sink;
  const std::string id = NewId();
  {
    absl::MutexLock lock(&mu_);
    begun_here_.insert(id);
  }
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

bool Migrator::BegunHere(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return begun_here_.contains(id);
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

absl::Status Migrator::MarkMoving(pid_t pid) {
  absl::MutexLock lock(&mu_);
  if (!moving_.insert(pid).second)
    return absl::FailedPreconditionError(absl::StrCat("process ", pid, " is already moving"));
  return absl::OkStatus();
}

absl::Status Migrator::ResumeEndpoint(pid_t pid) {
  v1::MigratorToShim res;
  res.mutable_resume();
  return Command(pid, res, options_.rpc_timeout, "resume").status();
}

absl::Status Migrator::ResumeAfter(pid_t pid, const absl::Status& reconnected) {
  const absl::Status resumed = ResumeEndpoint(pid);
  return reconnected.ok() ? resumed : reconnected;
}

void Migrator::FinishReconnected(Move* m, absl::Time c0, const absl::Status& status) {
  v1::Breakdown* b = m->rec.mutable_report()->mutable_breakdown();
  b->set_reconnect_us(MicrosSince(c0));
  b->set_blackout_us(MicrosSince(m->blackout_start));
  Finish(m, status);
}

std::function<void(pid_t)> Migrator::NoteRestored(Move* m) {
  return [this, m](pid_t p) {
    m->rec.set_restored_pid(p);
    m->rec.set_restored_identity(procs_->Identity(p));
    Persist(m);
  };
}

void Migrator::RemoveStepDirs(Move* m) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(m->dir, ec))
    if (e.is_directory()) std::filesystem::remove_all(e.path(), ec);
}

void Migrator::DoneMoving(pid_t pid) {
  absl::MutexLock lock(&mu_);
  moving_.erase(pid);
  quiescing_.erase(pid);
}

// Marks `pid` as being quiesced for its own move `id` (QuiescePeers then
// refuses to pause it). Paused as another move's peer, it waits for that
// move to let it go if `id` is the older move, else is refused (AwaitHeld).
absl::Status Migrator::MarkQuiescing(pid_t pid, const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = AwaitHeld(pid, id, "process "); !st.ok()) return st;
  quiescing_[pid] = id;
  return absl::OkStatus();
}

std::string Migrator::HolderOf(pid_t pid, const std::string& id) {
  for (const auto& [holder, pids] : peer_sets_)
    if (holder != id && pids.contains(pid)) return holder;
  auto own = quiescing_.find(pid);
  if (own != quiescing_.end() && own->second != id) return own->second;
  return "";
}

// Moves that meet wait or yield by age (their ids begin with their start
// time): the older waits for the younger to let go of what it holds (a
// peer it paused, or its own endpoint it is quiescing), the younger is
// refused (ABORTED) and lets go of all it holds (QuiesceWhenFree). Waits go
// only from older to younger, so none waits in a cycle, and the oldest move
// never lets go: it goes. A wait here is bounded (half the RPC timeout, so
// a remote requester hears back): still held then, the older is told so
// (RESOURCE_EXHAUSTED), keeps what it holds and asks again (AskToQuiesce).
// A wait that ends with the endpoint moved away by the younger move is
// refused (ABORTED): the older's view of its peers is out of date.
absl::Status Migrator::AwaitHeld(pid_t pid, const std::string& id, const std::string& what) {
  std::string holder = HolderOf(pid, id);
  if (holder.empty()) return absl::OkStatus();
  const bool older = id < holder;
  if (older) {
    auto free = [&] {
      mu_.AssertHeld();  // a Condition is evaluated with mu_ held
      return HolderOf(pid, id).empty();
    };
    if (mu_.AwaitWithTimeout(absl::Condition(&free), options_.rpc_timeout / 2)) {
      if (procs_->Exists(pid)) return absl::OkStatus();
      return absl::AbortedError(absl::StrCat(what, pid, " moved with migration ", holder,
                                             " while this move waited for it"));
    }
    holder = HolderOf(pid, id);
  }
  const bool moving = quiescing_.contains(pid) && quiescing_.at(pid) == holder;
  const std::string held = absl::StrCat(what, pid,
                                        moving ? " is being quiesced for its own move, migration "
                                               : " is paused as a peer of migration ",
                                        holder);
  if (older) return absl::ResourceExhaustedError(absl::StrCat(held, "; asking again"));
  return absl::AbortedError(absl::StrCat(held, "; try again when that move is done"));
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

}  // namespace rdmavirt::migrator
