#include "tools/rdmavirtctl/follow_move.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "migrator/transport/tls.h"
#include "tools/rdmavirtctl/format.h"

namespace rdmavirt::ctl {
namespace {

// The report of move `id` once the migrator at `target` (restarted after it
// went away mid-move) has finished it or rolled it back; waits for it to
// come back and for the move to end, at most `limit`.
absl::StatusOr<v1::MigrationReport> WaitForOutcome(const Args& args, const std::string& target,
                                                   const std::string& id, absl::Duration limit) {
  absl::StatusOr<migrator::TlsFiles> tls = migrator::LoadTls(args.tls_dir, "cli.pem", "cli.key");
  if (!tls.ok()) return tls.status();
  const absl::Time give_up = absl::Now() + limit;
  std::string last;
  while (absl::Now() < give_up) {
    absl::SleepFor(absl::Seconds(2));
    auto channel = grpc::CreateChannel(target, migrator::MutualTlsChannelCredentials(*tls));
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5))) {
      if (last != "down")
        fprintf(stderr, "[waiting] the migrator at %s is not back yet\n", target.c_str());
      last = "down";
      continue;
    }
    std::unique_ptr<v1::Operator::Stub> stub = v1::Operator::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StatusResponse status;
    if (!stub->Status(&ctx, v1::StatusRequest(), &status).ok()) continue;
    for (const v1::MigrationReport& r : status.recent())
      if (r.migration_id() == id) return r;
    if (last != "back")
      fprintf(stderr, "[waiting] the migrator is back; move %s still in flight\n", id.c_str());
    last = "back";
  }
  return absl::DeadlineExceededError(
      absl::StrCat("move ", id, " had not ended after ", absl::FormatDuration(limit)));
}

}  // namespace

int FollowMove(Client* c, const Args& args, const char* what,
               std::unique_ptr<grpc::ClientReaderInterface<v1::Progress>> reader) {
  v1::Progress p;
  v1::MigrationReport report;
  bool have_report = false;
  std::string last_phase;
  std::string id;
  absl::Time last_bytes = absl::InfinitePast();
  while (reader->Read(&p)) {
    if (!p.migration_id().empty()) id = p.migration_id();
    if (p.has_report()) {
      report = p.report();
      have_report = true;
      continue;
    }
    // Byte counts at most twice a second; every phase change.
    const bool bytes_only = p.phase() == last_phase && p.detail().empty();
    if (bytes_only && absl::Now() - last_bytes < absl::Milliseconds(500) &&
        p.bytes_done() != p.bytes_total())
      continue;
    if (bytes_only) last_bytes = absl::Now();
    last_phase = p.phase();
    fprintf(stderr, "%s\n", ProgressLine(p).c_str());
  }
  const grpc::Status st = reader->Finish();
  if (!have_report && !id.empty() && st.error_code() == grpc::StatusCode::UNAVAILABLE) {
    fprintf(stderr,
            "rdmavirtctl: %s: rdmavirt-migratord at %s went away during move %s (phase %s): %s\n"
            "When it runs again it finishes the move or rolls it back; `rdmavirtctl --host %s "
            "status` shows which%s.\n",
            what, c->target().c_str(), id.c_str(), last_phase.c_str(), st.error_message().c_str(),
            c->target().c_str(), args.wait ? " (waiting for it)" : ", and --wait waits for it");
    if (!args.wait) return kUnreachable;
    absl::StatusOr<v1::MigrationReport> r =
        WaitForOutcome(args, c->target(), id, absl::Minutes(10));
    if (!r.ok()) {
      fprintf(stderr, "rdmavirtctl: %s: %s\n", what, std::string(r.status().message()).c_str());
      return kUnreachable;
    }
    report = *r;
    Show(args.json, report, ReportText);
    return report.ok() ? kOk : kFailed;
  }
  if (have_report) Show(args.json, report, ReportText);
  if (!st.ok()) return c->Failed(what, st);
  if (have_report && !report.ok()) return kFailed;
  return kOk;
}

}  // namespace rdmavirt::ctl
