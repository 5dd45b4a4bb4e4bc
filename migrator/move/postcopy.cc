// Post-copy across a restart of the migrator. CRIU's helpers of a
// post-copy (the source's page server, the destination's lazy-pages
// daemon) run in a process group of their own and outlive the migrator
// that started them; each writes its exit status to a file when it ends
// (SpawnFds::exit_status_file). Records name them (MigrationRecord.
// postcopy), so that the next run:
//  - as the source of a confirmed move, waits for its page server and
//    reports the move done or the process lost (Conclude);
//  - as the source of a move that goes back, ends it (StopPostCopyHelper),
//    which lets go of the process;
//  - as the destination, watches the lazy-pages daemon and kills the
//    restored process if its pages cannot all come (WatchPostCopy).
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "migrator/host/log.h"
#include "migrator/host/spawn.h"
#include "migrator/move/migrator.h"

namespace rdmavirt::migrator {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(100);

// How a helper ended, if it has: its status as the shell wrote it
// (128+N: killed by signal N).
std::string DescribeExit(int status) {
  if (status > 128) return absl::StrCat("killed by signal ", status - 128);
  return absl::StrCat("exit status ", status);
}

}  // namespace

v1::PostCopyHelper Migrator::RecordHelper(const PostCopyHelper& helper) {
  v1::PostCopyHelper h;
  h.set_pid(helper.pid);
  h.set_identity(procs_->Identity(helper.pid));
  h.set_status_file(helper.status_file);
  return h;
}

absl::Status Migrator::AwaitPostCopy(const v1::PostCopyHelper& helper, absl::Duration limit) {
  // A helper recorded without an identity had ended before it was noted.
  const bool known = !helper.identity().empty();
  const absl::Time deadline = absl::Now() + limit;
  for (;;) {
    std::optional<int> status = ReadExitStatus(helper.status_file());
    if (!status.has_value() && (!known || !SameProcess(helper.pid(), helper.identity()))) {
      // Gone: it may have written its status just before it ended.
      status = ReadExitStatus(helper.status_file());
      if (!status.has_value())
        return absl::UnavailableError(
            absl::StrCat("CRIU's post-copy helper (pid ", helper.pid(),
                         ") is gone without its exit status: killed with its shell"));
    }
    if (status.has_value()) {
      if (*status == 0) return absl::OkStatus();
      return absl::UnavailableError(absl::StrCat("CRIU's post-copy helper (pid ", helper.pid(),
                                                 ") ended: ", DescribeExit(*status)));
    }
    if (stopping_.WaitForNotificationWithTimeout(kPoll))
      return absl::CancelledError("the migrator stops");
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(absl::StrCat("CRIU's post-copy helper (pid ", helper.pid(),
                                                      ") still runs after ",
                                                      absl::FormatDuration(limit)));
  }
}

void Migrator::StopPostCopyHelper(const v1::PostCopyHelper& helper) {
  if (helper.identity().empty() || !SameProcess(helper.pid(), helper.identity())) return;
  Log("post-copy helper %d of a move that goes back: killed", helper.pid());
  (void)KillCopy(helper.pid(), "post-copy helper");  // the shell and CRIU under it
}

void Migrator::WatchPostCopy(const v1::MigrationRecord& rec) {
  if (ReadExitStatus(rec.postcopy().status_file()) == 0) return;  // every page came
  absl::MutexLock lock(&watchers_mu_);
  watchers_.emplace_back([this, rec] {
    const std::string& id = rec.report().migration_id();
    const absl::Status pages = AwaitPostCopy(rec.postcopy(), absl::InfiniteDuration());
    if (pages.ok()) {
      Log("incoming %s: post-copy done, every page of process %d is in", id, rec.restored_pid());
      return;
    }
    if (absl::IsCancelled(pages)) return;
    if (!SameProcess(rec.restored_pid(), rec.restored_identity())) {
      Log("incoming %s: post-copy failed (%s); process %d is gone already", id, pages.message(),
          rec.restored_pid());
      return;
    }
    Log("incoming %s: post-copy failed (%s); process %d is killed: its pages cannot all come", id,
        pages.message(), rec.restored_pid());
    (void)KillCopy(rec.restored_pid(), "restored copy without its pages");
  });
}

}  // namespace rdmavirt::migrator
