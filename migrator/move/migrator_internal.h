// State of one move inside the Migrator (migrator.h), and the small tools
// its sequences share: the source side (bookkeeping.cc, quiesce.cc,
// reconnect.cc, precopy_dump.cc, migrate.cc, linked_tree.cc, rollback.cc,
// local_checkpoint.cc), the destination side (incoming.cc), guests
// (guests.cc) and recovery (recovery.cc). Not part of the migrator's
// interface.
//
// Locks: a Move belongs to the thread that runs it, but for what calls to
// several peer hosts at once share (peers_mu) and its post-copy dump's
// thread (lazy_mu); an Incoming's fields are under its `mu`. Helpers here
// take no lock.
#ifndef RDMAVIRT_MIGRATOR_MOVE_MIGRATOR_INTERNAL_H_
#define RDMAVIRT_MIGRATOR_MOVE_MIGRATOR_INTERNAL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "migrator/move/migrator.h"
#include "migrator/move/precopy_pages.h"

namespace rdmavirt::migrator {

// A move this host runs as the source (or a checkpoint, or a restore).
// Owned by the thread running it.
struct Migrator::Move {
  v1::MigrationRecord rec;
  std::string dir;  // STATE/migrations/ID
  ProgressSink sink;
  absl::Time start;
  absl::Time blackout_start = absl::InfiniteFuture();
  // Taken by the calls to several peer hosts at once (AllAtOnce) around
  // what they share: `stubs`, and the record and progress of SetPhase.
  //
  // Not ABSL_GUARDED_BY(peers_mu): outside AllAtOnce the thread that owns
  // the move reads and writes `stubs` and `rec` without it, as no other
  // thread runs then; the analysis cannot tell those stretches apart.
  absl::Mutex peers_mu;
  std::map<std::string, std::unique_ptr<v1::Transfer::StubInterface>> stubs;
  bool prepared = false;  // the destination holds an incoming record
  // What went wrong completing the tree's further endpoints (a tree's
  // first move reports them).
  std::vector<std::string> member_errors;
  bool restore_asked = false;  // RestoreIncoming was sent: a copy may run there
  // A tree's first move: endpoints of the tree are connected to each other
  // or to themselves (UCX connects a process to itself, and the ranks of
  // one host to each other). They share their host's virtual GID, so no
  // lookup of peers finds them: they are quiesced all before any is
  // released, and re-pointed at each other by the tree's steps.
  bool linked = false;
  // The endpoints of its tree (every move of a tree with several).
  std::vector<pid_t> tree_pids;
  // The pages its pre-copy sent, for the release (precopy_pages.h).
  PrecopyPages precopy_pages;
  // Its writable registered memory, from the quiesce's reply.
  std::vector<std::pair<uint64_t, uint64_t>> writable_registered;
  // Post-copy: the final dump (Checkpointer::LazyDump) runs on this thread
  // until its pages have all gone; where it serves them; what it returned
  // and when. Ended by EndLazyDump.
  std::thread lazy_dump;
  LazyPages lazy_serve;
  absl::Mutex lazy_mu;
  bool lazy_written ABSL_GUARDED_BY(lazy_mu) = false;   // its images are complete
  PostCopyHelper lazy_helper ABSL_GUARDED_BY(lazy_mu);  // the CRIU serving them
  bool lazy_ended ABSL_GUARDED_BY(lazy_mu) = false;
  absl::Status lazy_status ABSL_GUARDED_BY(lazy_mu);
  absl::Time lazy_done ABSL_GUARDED_BY(lazy_mu);
  absl::Time lazy_restored = absl::InfiniteFuture();  // the destination's restore returned
  // The first failed write of `rec`: crash recovery reads the record, so a
  // move that cannot write it is refused or rolled back while it can be.
  absl::Status record_error;
};

// A move this host receives. Its operations come one at a time from the
// source (Prepare, PushImages..., RestoreIncoming, then ReconnectPeers or
// AbortIncoming); `mu` orders them anyway, except that the CRIU restore
// runs without it, so that an abort (the source gave up waiting) is not
// held up behind it: the restore then finds `aborted` and kills what it
// restored.
struct Migrator::Incoming {
  absl::Mutex mu;
  v1::MigrationRecord rec ABSL_GUARDED_BY(mu);
  bool aborted ABSL_GUARDED_BY(mu) = false;
  // A PushImages stream is being written (without `mu` held, so that an
  // abort need not wait for it); a second stream is refused meanwhile.
  bool streaming ABSL_GUARDED_BY(mu) = false;
  absl::Status record_error ABSL_GUARDED_BY(mu);  // the first failed record write
  std::string dir;                                // STATE/incoming/ID
  uint32_t last_iteration ABSL_GUARDED_BY(mu) = 0;
};

// Runs call(0) .. call(n - 1) at once, on up to kMaxAtOnce threads (this
// one among them), and returns when all have: calls that wait on other
// hosts (or other processes) take as long as the slowest, not as their
// sum. A host with a hundred peer ranks gets 32 threads, not a hundred.
inline constexpr size_t kMaxAtOnce = 32;
inline void AllAtOnce(size_t n, const std::function<void(size_t)>& call) {
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) call(i);
  };
  std::vector<std::thread> threads;
  const size_t helpers = n > 0 ? std::min(n, kMaxAtOnce) - 1 : 0;  // this thread is one
  threads.reserve(helpers);
  for (size_t i = 0; i < helpers; ++i) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
}

// Where a move's process steps (pre-dump, dump, stop, continue, kill)
// start: the tree's root, which is the endpoint's own process unless a
// parent of it was named (MigrationRecord.tree_root).
inline pid_t TreeRoot(const v1::MigrationRecord& r) {
  return r.tree_root() > 0 ? r.tree_root() : r.report().pid();
}

// The move that holds what a move pauses (its endpoint, its peers) and
// whose age orders it among other moves (AwaitHeld): a tree's further
// endpoints hold under its first move's id (tree_lead), so that the tree
// is one move to the others and never waits for itself.
inline const std::string& HolderId(const v1::MigrationRecord& r) {
  return r.tree_lead().empty() ? r.report().migration_id() : r.tree_lead();
}

inline uint64_t MicrosSince(absl::Time t) {
  return static_cast<uint64_t>(absl::ToInt64Microseconds(absl::Now() - t));
}

inline std::string Rfc3339(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", t, absl::UTCTimeZone());
}

// A manifest of `files`, the images of `endpoint` that move `id` took on
// `host`.
v1::Manifest MakeManifest(const std::string& id, const v1::EndpointSummary& endpoint,
                          const std::vector<v1::ImageFile>& files, const std::string& host,
                          const std::string& terminal);
uint64_t SumSizes(const std::vector<v1::ImageFile>& files);

// Whether a QP of one of `all` is connected to one of them, itself
// included (linked_tree.cc).
bool ConnectedAmong(const std::vector<v1::EndpointSummary>& all);

// A status with `context: ` before its message, same code.
absl::Status Annotate(const absl::Status& st, absl::string_view context);

// A gRPC status as an absl one (the codes are the same).
absl::Status FromGrpc(const grpc::Status& st, absl::string_view context);

// One unary call to another host's migrator within `timeout`; its failure
// is a status with `what` for context.
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

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_MOVE_MIGRATOR_INTERNAL_H_
