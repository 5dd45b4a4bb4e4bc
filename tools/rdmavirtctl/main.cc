// rdmavirtctl: the operator's CLI to a host's rdmavirt-migratord (Operator
// service, mutual TLS). Exit codes: 0 done, 1 the operation failed (rolled
// back or not), 2 usage error, 3 the daemon cannot be reached.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/addresses.h"
#include "migrator/host/service_address.h"
#include "migrator/transport/tls.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/format.h"
#include "tools/rdmavirtctl/vm.h"

namespace rdmavirt::ctl {
namespace {

constexpr char kUsageText[] =
    "usage: rdmavirtctl [--host HOST[:PORT]] [--tls-dir DIR] [--json] COMMAND [ARGS]\n"
    "\n"
    "Talks to the rdmavirt-migratord of HOST (default 127.0.0.1:7700) over mutual TLS\n"
    "with DIR/ca.pem, DIR/cli.pem, DIR/cli.key (default DIR /etc/rdmavirt/tls).\n"
    "\n"
    "commands:\n"
    "  ps                                   processes under the shim on HOST\n"
    "  migrate PID --to HOST[:PORT] [--address A.B.C.D/LEN]\n"
    "                                       live-migrate PID from HOST to another host\n"
    "  checkpoint PID --dir DIR [--leave-running]\n"
    "                                       checkpoint PID into DIR on HOST\n"
    "  restore --dir DIR [--on HOST[:PORT]] restore a checkpoint of HOST (on another host)\n"
    "  status [--all]                       moves in flight and recent, and HostInfo\n"
    "                                       (--all: every move in flight in the cluster)\n"
    "  host                                 HostInfo: RDMA devices, ports, GIDs, CRIU\n"
    "  hosts                                the live hosts of HOST's inventory\n"
    "\n"
    "VMs (libvirt; HOST's migrator is the destination's):\n"
    "  vm-migrate DOMAIN --to URI [--to-migrator HOST[:PORT]] [--connect URI]\n"
    "                                       live-migrate an RDMA guest, its connections kept\n"
    "  drain (--to URI | --auto) [--dry-run]\n"
    "                                       move every RDMA guest and shimmed process away\n"
    "  snapshot DOMAIN NAME [--with DOMAIN[@URI]]... [--connect URI]\n"
    "                                       snapshot RDMA guests together, connections kept\n"
    "  revert DOMAIN NAME [--connect URI]   revert them together; they reconnect\n"
    "in a guest, or on a host for its hooks:\n"
    "  suspend [PID...]                     quiesce and release every endpoint (or PIDs)\n"
    "  resume [--device DEV]                bring the suspended endpoints back, reconnect\n"
    "  guest-event DOMAIN started|stopped [--mac MAC]\n"
    "                                       tell HOST's migrator about an RDMA guest\n"
    "  help [COMMAND]                       this text, or a command's\n"
    "\n"
    "--json prints the result (report, listing) as JSON on stdout.\n"
    "exit codes: 0 ok, 1 the operation failed, 2 usage error, 3 cannot reach the daemon\n";

const std::map<std::string, std::string>& CommandHelp() {
  static const auto* help = new std::map<std::string, std::string>{
      {"ps",
       "usage: rdmavirtctl ps\n"
       "Lists the processes of HOST that are under the rdmavirt shim: PID, PROGRAM,\n"
       "ENDPOINT (its stable id), PHASE (running, suspended, released), QPS, MRS,\n"
       "REG MEM (registered memory), CQ PENDING (completions held in shadow CQs).\n"},
      {"migrate",
       "usage: rdmavirtctl migrate PID --to HOST[:PORT] [--max-precopy N] [--drain-timeout-ms MS]\n"
       "                           [--address A.B.C.D/LEN[,...]] [--postcopy] [--wait]\n"
       "Live-migrates process PID of --host to the migrator at --to (port 7700 by\n"
       "default), with its descendants: PID or one of them must be under the shim (a\n"
       "shell, job script or MPI daemon may be PID, its RDMA programs its children;\n"
       "several under the shim move as one, connected to each other or not). The\n"
       "destination is checked before anything is touched; any failure before the\n"
       "process runs on the destination rolls it back onto the source.\n"
       "Progress goes to stderr; the summary (blackout, breakdown) to stdout.\n"
       "--max-precopy N: at most N rounds of copying memory while the process runs\n"
       "(1..64; default: the migrator's, 3 unless configured); they stop early once\n"
       "a round is small, or twice in a row copies over 9/10 of the one before.\n"
       "--postcopy: the pages dirtied since the last round are not copied while the\n"
       "process is stopped: it runs on the destination first, which fetches each page\n"
       "as the process touches it and the rest meanwhile (CRIU's lazy pages, over\n"
       "CRIU's own mutual TLS), for a process that dirties memory faster than the\n"
       "link carries it. Until the last page has gone the process needs both hosts:\n"
       "if either fails then, the process is lost.\n"
       "--drain-timeout-ms MS: how long the shim may take to complete the sends in\n"
       "flight before the release (default: the migrator's, 10000).\n"
       "--address names IPv4 addresses of --host that belong to the process (its\n"
       "service addresses): they move with it, and so do its established TCP\n"
       "connections on them. The destination must have an interface on their subnet.\n"
       "Without it a process holding a TCP connection cannot move.\n"
       "If the migrator of --host goes away during the move (exit code 3), it finishes\n"
       "the move or rolls it back when it runs again; --wait waits up to 10 minutes for\n"
       "that and prints the outcome as if the move had ended normally.\n"},
      {"checkpoint",
       "usage: rdmavirtctl checkpoint PID --dir DIR [--leave-running]\n"
       "Checkpoints process PID into DIR (an absolute path on --host, absent or empty).\n"
       "Without --leave-running the process is gone afterwards and its peers stay\n"
       "suspended until it is restored.\n"},
      {"restore",
       "usage: rdmavirtctl restore --dir DIR [--on HOST[:PORT]]\n"
       "Restores the checkpoint in DIR (on --host), on --host or on the host given by\n"
       "--on. The images are verified first: a corrupted or truncated checkpoint is\n"
       "refused (DATA_LOSS) and nothing is created.\n"},
      {"status",
       "usage: rdmavirtctl status [--all]\n"
       "Moves in flight and the recent ones on --host, with their results, and HostInfo.\n"
       "--all adds every move in flight in the cluster, as --host's inventory records\n"
       "them (its migrator's --inventory): endpoint, migration, source, destination.\n"},
      {"hosts",
       "usage: rdmavirtctl hosts\n"
       "The live hosts of --host's inventory (its migrator's --inventory): name, where\n"
       "its migrator listens, RDMA ports active, GIDs, CRIU, free RDMA NICs for guests,\n"
       "libvirt URI. A host whose migrator stopped or died is not listed (its lease\n"
       "expired). Exit code 1 when --host's migrator has no inventory.\n"},
      {"vm-migrate",
       "usage: rdmavirtctl vm-migrate DOMAIN --to URI [--to-migrator HOST[:PORT]]\n"
       "                              [--connect URI] [--migrate-uri URI] [--unsafe]\n"
       "                              [--guest-command PATH]\n"
       "Live-migrates the RDMA guest DOMAIN from the libvirt at --connect (default\n"
       "qemu:///system) to the libvirt at --to, keeping its RDMA connections: the guest's\n"
       "endpoints and their peers are suspended (through the guest agent: PATH suspend,\n"
       "default /usr/sbin/rdmavirt-guest), its RDMA NIC unplugged, the VM migrated, a NIC\n"
       "of the destination plugged in (asked of the destination's rdmavirt-migratord,\n"
       "--to-migrator, default the host of --to, port 7700) and the endpoints resumed\n"
       "there. The destination is checked first; a failure before the VM has moved puts\n"
       "it back as it was, resumed. --migrate-uri and --unsafe go to libvirt as they are.\n"
       "Progress goes to stderr; the report (blackout, steps, NICs) to stdout.\n"},
      {"drain",
       "usage: rdmavirtctl drain (--to URI [--to-migrator HOST[:PORT]] | --auto [--hosts FILE])\n"
       "                         [--connect URI] [--migrate-uri URI] [--dry-run]\n"
       "Moves every RDMA guest of the libvirt at --connect (default qemu:///system; none:\n"
       "this host runs no libvirt) with vm-migrate, and every process under the shim on\n"
       "--host with migrate, off this\n"
       "host: to --to (guests) and --to-migrator (processes; default the host of --to,\n"
       "port 7700), or with --auto, to the live hosts of --host's inventory (its\n"
       "migrator's --inventory, read again before each move): each guest to the host\n"
       "with the most free RDMA NICs for guests (of those registered with a libvirt URI),\n"
       "processes spread over the hosts where CRIU works and an RDMA port is active, a\n"
       "host a move could not start on not picked again. --auto --hosts FILE takes the\n"
       "hosts from FILE instead (\"LIBVIRT-URI MIGRATOR-HOST:PORT\" lines; processes go to\n"
       "the first). One at a time, with progress on stderr and a summary; --dry-run\n"
       "prints the plan and moves nothing. Exit code 1 if anything stayed.\n"},
      {"snapshot",
       "usage: rdmavirtctl snapshot DOMAIN NAME [--with DOMAIN[@URI]]... [--connect URI]\n"
       "                            [--guest-command PATH]\n"
       "Takes snapshot NAME (internal: memory and disks, which must be qcow2) of the\n"
       "running RDMA guest DOMAIN (libvirt at --connect, default qemu:///system) and of\n"
       "each --with guest (on --connect, or at URI), all at one cut: every guest's\n"
       "endpoints and their peers are suspended first (through the guest agent: PATH\n"
       "suspend, default /usr/sbin/rdmavirt-guest), so that no RDMA state is in any\n"
       "snapshot and nothing is in flight between them, then each is snapshotted and\n"
       "all resume. Name every guest DOMAIN's programs talk to: a revert is consistent\n"
       "only when it brings back both ends. A failure deletes the snapshots taken and\n"
       "resumes every guest. Progress goes to stderr; the report to stdout.\n"},
      {"revert",
       "usage: rdmavirtctl revert DOMAIN NAME [--connect URI] [--guest-command PATH]\n"
       "Reverts DOMAIN and every guest snapshotted with it (`snapshot --with`, named in\n"
       "the snapshot) to NAME, running, then resumes their endpoints: each reconnects to\n"
       "the others where they are now. Every snapshot is checked before anything is\n"
       "reverted. A snapshot that `rdmavirtctl snapshot` did not take is refused: its\n"
       "RDMA connections were live in it.\n"},
      {"suspend",
       "usage: rdmavirtctl suspend [PID...]\n"
       "Quiesces every endpoint of --host (or the PIDs), with their peers wherever they\n"
       "are, and releases them: the processes keep running with no RDMA device open, so\n"
       "that the host's RDMA NIC can go or its memory be snapshotted. All or nothing.\n"},
      {"resume",
       "usage: rdmavirtctl resume [--device DEV]\n"
       "Brings the endpoints `suspend` released back on DEV (default: the first device\n"
       "with an active port), re-points their peers at them and resumes everything.\n"},
      {"guest-event",
       "usage: rdmavirtctl guest-event DOMAIN started|stopped [--mac MAC]\n"
       "Tells the migrator of --host that the RDMA guest DOMAIN started (with its RDMA\n"
       "NIC MAC) or stopped there; the libvirt hook calls it.\n"},
      {"host",
       "usage: rdmavirtctl host\n"
       "HostInfo of --host: name, version, RDMA devices with their ports and GIDs, and\n"
       "whether CRIU works there.\n"},
  };
  return *help;
}

struct Args {
  std::string host = "127.0.0.1:7700";
  std::string tls_dir = "/etc/rdmavirt/tls";
  bool json = false;
  std::string command;
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;  // --to, --dir, --on, ...
  bool leave_running = false;
  bool postcopy = false;
  bool unsafe = false;
  bool dry_run = false;
  bool auto_pick = false;
  bool wait = false;
  bool help = false;
  bool all = false;
};

int UsageError(const std::string& message, const std::string& command = "") {
  fprintf(stderr, "rdmavirtctl: %s\n", message.c_str());
  auto it = CommandHelp().find(command);
  fprintf(stderr, "%s",
          it != CommandHelp().end() ? it->second.c_str() : "run `rdmavirtctl --help` for usage\n");
  return kUsage;
}

// 0 to go on, else an exit code (after printing why).
int Parse(int argc, char** argv, Args* a) {
  static const std::vector<std::string> kValued = {
      "--host",        "--tls-dir",          "--to",          "--dir",           "--on",
      "--max-precopy", "--drain-timeout-ms", "--address",     "--device",        "--mac",
      "--to-migrator", "--connect",          "--migrate-uri", "--guest-command", "--with"};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      a->help = true;
      continue;
    }
    if (arg == "--json") {
      a->json = true;
      continue;
    }
    if (arg == "--leave-running") {
      a->leave_running = true;
      continue;
    }
    if (arg == "--postcopy") {
      a->postcopy = true;
      continue;
    }
    if (arg == "--unsafe") {
      a->unsafe = true;
      continue;
    }
    if (arg == "--dry-run") {
      a->dry_run = true;
      continue;
    }
    if (arg == "--auto") {
      a->auto_pick = true;
      continue;
    }
    if (arg == "--wait") {
      a->wait = true;
      continue;
    }
    if (arg == "--all") {
      a->all = true;
      continue;
    }
    if (arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
      std::string value;
      const size_t eq = arg.find('=');
      std::string name = arg.substr(0, eq);
      if (std::find(kValued.begin(), kValued.end(), name) == kValued.end())
        return UsageError(absl::StrCat("unknown option ", name), a->command);
      if (eq != std::string::npos) {
        value = arg.substr(eq + 1);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return UsageError(absl::StrCat(name, " needs a value"), a->command);
      }
      if (name == "--host")
        a->host = value;
      else if (name == "--tls-dir")
        a->tls_dir = value;
      // --address and --with may be given more than once.
      else if (name == "--address" && a->options.contains(name))
        a->options[name] += "," + value;
      else if (name == "--with" && a->options.contains(name))
        a->options[name] += "\n" + value;
      else
        a->options[name] = value;
      continue;
    }
    if (arg.size() > 1 && arg[0] == '-') return UsageError(absl::StrCat("unknown option ", arg));
    if (a->command.empty())
      a->command = arg;
    else
      a->positional.push_back(arg);
  }
  return 0;
}

absl::StatusOr<int> ParsePid(const std::string& s) {
  int pid = 0;
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(s, &pid) || pid <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("\"", s, "\" is not a process id (a positive integer)"));
  return pid;
}

absl::StatusOr<uint32_t> ParseCount(const std::string& name, const std::string& s, uint32_t max) {
  uint32_t v = 0;
  if (s.find_first_not_of("0123456789") != std::string::npos || !absl::SimpleAtoi(s, &v) ||
      v == 0 || v > max)
    return absl::InvalidArgumentError(absl::StrCat(name, " takes 1..", max));
  return v;
}

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

// Reads a Progress stream: lines on stderr, the report at the end. When the
// daemon goes away in the middle (killed, restarted), says what that means
// and, with --wait, waits for the restarted daemon's outcome of the move.
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
    printf("%s", args.json ? (Json(report) + "\n").c_str() : ReportText(report).c_str());
    return report.ok() ? kOk : kFailed;
  }
  if (have_report) {
    if (args.json)
      printf("%s\n", Json(report).c_str());
    else
      printf("%s", ReportText(report).c_str());
  }
  if (!st.ok()) return c->Failed(what, st);
  if (have_report && !report.ok()) return kFailed;
  return kOk;
}

std::string Opt(const Args& a, const std::string& name) {
  auto it = a.options.find(name);
  return it == a.options.end() ? std::string() : it->second;
}

// The commands of guests and VMs: vm-migrate, drain, snapshot, revert,
// suspend, resume, guest-event.
int GuestCommand(const Args& args) {
  static const std::map<std::string, std::vector<std::string>> kAllowed = {
      {"vm-migrate", {"--to", "--to-migrator", "--connect", "--migrate-uri", "--guest-command"}},
      {"drain",
       {"--to", "--to-migrator", "--connect", "--migrate-uri", "--guest-command", "--hosts"}},
      {"snapshot", {"--with", "--connect", "--guest-command"}},
      {"revert", {"--connect", "--guest-command"}},
      {"suspend", {"--drain-timeout-ms"}},
      {"resume", {"--device"}},
      {"guest-event", {"--mac"}},
  };
  const std::vector<std::string>& allowed = kAllowed.at(args.command);
  for (const auto& [name, value] : args.options)
    if (std::find(allowed.begin(), allowed.end(), name) == allowed.end())
      return UsageError(absl::StrCat(args.command, " does not take ", name), args.command);
  if (args.unsafe && args.command != "vm-migrate" && args.command != "drain")
    return UsageError("--unsafe is for vm-migrate and drain", args.command);
  if ((args.dry_run || args.auto_pick) && args.command != "drain")
    return UsageError("--dry-run and --auto are for drain", args.command);
  if (args.leave_running) return UsageError("--leave-running is for checkpoint", args.command);

  if (args.command == "snapshot" || args.command == "revert") {
    if (args.positional.size() != 2)
      return UsageError(absl::StrCat(args.command, " takes a DOMAIN and a snapshot NAME"),
                        args.command);
    SnapshotOptions o;
    o.vm.domain = args.positional[0];
    o.name = args.positional[1];
    if (!ValidSnapshotName(o.name))
      return UsageError(absl::StrCat("\"", o.name,
                                     "\" is not a snapshot name (letters, digits, '.', '_', "
                                     "'-'; not first '.' or '-')"),
                        args.command);
    if (!Opt(args, "--with").empty()) o.with = absl::StrSplit(Opt(args, "--with"), '\n');
    if (!Opt(args, "--connect").empty()) o.vm.connect = Opt(args, "--connect");
    if (!Opt(args, "--guest-command").empty()) {
      o.vm.guest_command = Opt(args, "--guest-command");
      if (o.vm.guest_command[0] != '/')
        return UsageError("--guest-command takes an absolute path", args.command);
    }
    o.vm.tls_dir = args.tls_dir;
    o.vm.json = args.json;
    return args.command == "snapshot" ? Snapshot(o) : Revert(o);
  }

  if (args.command == "vm-migrate" || args.command == "drain") {
    const bool drain = args.command == "drain";
    if (drain ? !args.positional.empty() : args.positional.size() != 1)
      return UsageError(drain ? "drain takes no arguments" : "vm-migrate takes a DOMAIN",
                        args.command);
    VmOptions o;
    if (!drain) o.domain = args.positional[0];
    o.to = Opt(args, "--to");
    DrainOptions d;
    if (drain && args.auto_pick) {
      if (!o.to.empty() || !Opt(args, "--to-migrator").empty())
        return UsageError("--auto or --to, not both", args.command);
      d.from_inventory = Opt(args, "--hosts").empty();
    }
    if (d.from_inventory) {
      // The candidates are read from --host's migrator as the drain goes.
    } else if (drain && args.auto_pick) {
      const std::string path = Opt(args, "--hosts");
      std::ifstream in(path);
      if (!in) return UsageError(absl::StrCat("cannot read ", path), args.command);
      std::stringstream text;
      text << in.rdbuf();
      absl::StatusOr<std::vector<std::pair<std::string, std::string>>> hosts =
          ParseHostsFile(text.str());
      if (!hosts.ok())
        return UsageError(absl::StrCat(path, ": ", hosts.status().message()), args.command);
      for (auto& [uri, m] : *hosts) {
        absl::StatusOr<migrator::HostPort> hp = migrator::ParseHostPort(m);
        d.candidates.emplace_back(uri, hp->Target());
      }
    } else if (o.to.empty() || o.to.find("://") == std::string::npos) {
      return UsageError(absl::StrCat(args.command,
                                     drain ? " needs --auto or --to with a libvirt URI"
                                           : " needs --to with a libvirt URI",
                                     " (qemu+ssh://HOST/system)"),
                        args.command);
    } else if (!Opt(args, "--hosts").empty()) {
      return UsageError("--hosts is for --auto", args.command);
    }
    if (!o.to.empty()) {
      o.to_migrator = Opt(args, "--to-migrator");
      if (o.to_migrator.empty()) o.to_migrator = UriHost(o.to);
      if (o.to_migrator.empty())
        return UsageError("--to names no host: give --to-migrator HOST[:PORT]", args.command);
      absl::StatusOr<migrator::HostPort> m = migrator::ParseHostPort(o.to_migrator);
      if (!m.ok())
        return UsageError(absl::StrCat("--to-migrator: ", m.status().message()), args.command);
      o.to_migrator = m->Target();
    }
    if (!Opt(args, "--connect").empty()) o.connect = Opt(args, "--connect");
    o.migrate_uri = Opt(args, "--migrate-uri");
    if (!Opt(args, "--guest-command").empty()) {
      o.guest_command = Opt(args, "--guest-command");
      if (o.guest_command[0] != '/')
        return UsageError("--guest-command takes an absolute path", args.command);
    }
    o.unsafe = args.unsafe;
    o.tls_dir = args.tls_dir;
    o.json = args.json;
    if (!drain) return VmMigrate(o);
    absl::StatusOr<migrator::HostPort> host = migrator::ParseHostPort(args.host);
    if (!host.ok()) return UsageError(absl::StrCat("--host: ", host.status().message()));
    d.vm = o;
    d.host = host->Target();
    d.dry_run = args.dry_run;
    return Drain(d);
  }

  v1::SuspendRequest suspend;
  v1::GuestEventRequest event;
  if (args.command == "suspend") {
    for (const std::string& p : args.positional) {
      absl::StatusOr<int> pid = ParsePid(p);
      if (!pid.ok()) return UsageError(std::string(pid.status().message()), args.command);
      suspend.add_pids(*pid);
    }
    if (!Opt(args, "--drain-timeout-ms").empty()) {
      absl::StatusOr<uint32_t> n =
          ParseCount("--drain-timeout-ms", Opt(args, "--drain-timeout-ms"), 600000);
      if (!n.ok()) return UsageError(std::string(n.status().message()), args.command);
      suspend.set_drain_timeout_ms(*n);
    }
  } else if (args.command == "resume") {
    if (!args.positional.empty()) return UsageError("resume takes no arguments", args.command);
  } else {
    if (args.positional.size() != 2 ||
        (args.positional[1] != "started" && args.positional[1] != "stopped"))
      return UsageError("guest-event takes DOMAIN and started or stopped", args.command);
    event.set_domain(args.positional[0]);
    event.set_event(args.positional[1]);
    event.set_mac(Opt(args, "--mac"));
  }
  absl::StatusOr<migrator::HostPort> host = migrator::ParseHostPort(args.host);
  if (!host.ok()) return UsageError(absl::StrCat("--host: ", host.status().message()));
  Client client(args.tls_dir, host->Target());
  if (int rc = client.Connect(); rc != kOk) return rc;
  grpc::ClientContext ctx;
  if (args.command == "guest-event") {
    v1::GuestEventResponse out;
    const grpc::Status st = client.stub()->GuestEvent(&ctx, event, &out);
    return st.ok() ? kOk : client.Failed("guest-event", st);
  }
  v1::GuestReport out;
  grpc::Status st;
  if (args.command == "suspend") {
    st = client.stub()->Suspend(&ctx, suspend, &out);
  } else {
    v1::ResumeRequest req;
    req.set_device(Opt(args, "--device"));
    st = client.stub()->Resume(&ctx, req, &out);
  }
  if (!st.ok()) return client.Failed(args.command.c_str(), st);
  printf("%s", args.json ? (Json(out) + "\n").c_str() : GuestReportText(out).c_str());
  return out.ok() ? kOk : kFailed;
}

int Main(int argc, char** argv) {
  Args args;
  if (int rc = Parse(argc, argv, &args); rc != 0) return rc;
  if (args.command == "help" || (args.help && args.command.empty())) {
    const std::string topic = !args.positional.empty() ? args.positional[0] : "";
    auto it = CommandHelp().find(topic);
    if (!topic.empty() && it == CommandHelp().end())
      return UsageError(absl::StrCat("no command ", topic));
    printf("%s", it != CommandHelp().end() ? it->second.c_str() : kUsageText);
    return kOk;
  }
  if (args.command.empty()) return UsageError("no command given");
  auto help = CommandHelp().find(args.command);
  if (help == CommandHelp().end())
    return UsageError(absl::StrCat("unknown command \"", args.command, "\""));
  if (args.help) {
    printf("%s", help->second.c_str());
    return kOk;
  }
  if (args.command == "vm-migrate" || args.command == "suspend" || args.command == "resume" ||
      args.command == "guest-event" || args.command == "drain" || args.command == "snapshot" ||
      args.command == "revert")
    return GuestCommand(args);
  // What each command takes.
  static const std::map<std::string, std::pair<size_t, std::vector<std::string>>> kTakes = {
      {"ps", {0, {}}},
      {"status", {0, {}}},
      {"host", {0, {}}},
      {"hosts", {0, {}}},
      {"migrate", {1, {"--to", "--max-precopy", "--drain-timeout-ms", "--address"}}},
      {"checkpoint", {1, {"--dir"}}},
      {"restore", {0, {"--dir", "--on"}}},
  };
  const auto& [npos, allowed] = kTakes.at(args.command);
  if (args.positional.size() != npos)
    return UsageError(npos ? absl::StrCat(args.command, " takes a PID")
                           : absl::StrCat(args.command, " takes no arguments"),
                      args.command);
  for (const auto& [name, value] : args.options)
    if (std::find(allowed.begin(), allowed.end(), name) == allowed.end())
      return UsageError(absl::StrCat(args.command, " does not take ", name), args.command);
  if (args.leave_running && args.command != "checkpoint")
    return UsageError("--leave-running is for checkpoint", args.command);
  if (args.postcopy && args.command != "migrate")
    return UsageError("--postcopy is for migrate", args.command);
  if (args.all && args.command != "status") return UsageError("--all is for status", args.command);

  absl::StatusOr<migrator::HostPort> host = migrator::ParseHostPort(args.host);
  if (!host.ok()) return UsageError(absl::StrCat("--host: ", host.status().message()));

  // Validate everything before connecting.
  int pid = 0;
  if (npos == 1) {
    absl::StatusOr<int> p = ParsePid(args.positional[0]);
    if (!p.ok()) return UsageError(std::string(p.status().message()), args.command);
    pid = *p;
  }
  auto opt = [&](const std::string& n) {
    auto it = args.options.find(n);
    return it == args.options.end() ? std::string() : it->second;
  };
  v1::MigrateRequest migrate;
  v1::CheckpointRequest checkpoint;
  v1::RestoreRequest restore;
  if (args.command == "migrate") {
    if (opt("--to").empty()) return UsageError("migrate needs --to HOST[:PORT]", "migrate");
    absl::StatusOr<migrator::HostPort> to = migrator::ParseHostPort(opt("--to"));
    if (!to.ok()) return UsageError(absl::StrCat("--to: ", to.status().message()), "migrate");
    migrate.set_pid(pid);
    migrate.set_destination(to->Target());
    migrate.set_postcopy(args.postcopy);
    if (!opt("--max-precopy").empty()) {
      absl::StatusOr<uint32_t> n = ParseCount("--max-precopy", opt("--max-precopy"), 64);
      if (!n.ok()) return UsageError(std::string(n.status().message()), "migrate");
      migrate.set_max_precopy_iterations(*n);
    }
    if (!opt("--drain-timeout-ms").empty()) {
      absl::StatusOr<uint32_t> n =
          ParseCount("--drain-timeout-ms", opt("--drain-timeout-ms"), 600000);
      if (!n.ok()) return UsageError(std::string(n.status().message()), "migrate");
      migrate.set_drain_timeout_ms(*n);
    }
    if (args.options.contains("--address")) {
      for (absl::string_view a : absl::StrSplit(opt("--address"), ',')) {
        absl::StatusOr<migrator::ServiceAddress> parsed = migrator::ParseServiceAddress(a);
        if (!parsed.ok())
          return UsageError(absl::StrCat("--address: ", parsed.status().message()), "migrate");
        migrate.add_addresses(std::string(a));
      }
    }
  } else if (args.command == "checkpoint") {
    if (opt("--dir").empty() || opt("--dir")[0] != '/')
      return UsageError("checkpoint needs --dir with an absolute path", "checkpoint");
    checkpoint.set_pid(pid);
    checkpoint.set_dir(opt("--dir"));
    checkpoint.set_leave_running(args.leave_running);
  } else if (args.command == "restore") {
    if (opt("--dir").empty() || opt("--dir")[0] != '/')
      return UsageError("restore needs --dir with an absolute path", "restore");
    restore.set_dir(opt("--dir"));
    if (!opt("--on").empty()) {
      absl::StatusOr<migrator::HostPort> on = migrator::ParseHostPort(opt("--on"));
      if (!on.ok()) return UsageError(absl::StrCat("--on: ", on.status().message()), "restore");
      restore.set_on(on->Target());
    }
  }

  Client client(args.tls_dir, host->Target());
  if (int rc = client.Connect(); rc != kOk) return rc;
  grpc::ClientContext ctx;
  if (args.command == "ps") {
    v1::ListEndpointsResponse out;
    const grpc::Status st = client.stub()->ListEndpoints(&ctx, v1::ListEndpointsRequest(), &out);
    if (!st.ok()) return client.Failed("ps", st);
    printf("%s", args.json ? (Json(out) + "\n").c_str() : EndpointTable(out).c_str());
    return kOk;
  }
  if (args.command == "host") {
    v1::HostInfo out;
    const grpc::Status st = client.stub()->GetHostInfo(&ctx, v1::HostInfoRequest(), &out);
    if (!st.ok()) return client.Failed("host", st);
    printf("%s", args.json ? (Json(out) + "\n").c_str() : HostText(out).c_str());
    return kOk;
  }
  if (args.command == "hosts") {
    v1::ListHostsResponse out;
    const grpc::Status st = client.stub()->ListHosts(&ctx, v1::ListHostsRequest(), &out);
    if (!st.ok()) return client.Failed("hosts", st);
    printf("%s", args.json ? (Json(out) + "\n").c_str() : HostsTable(out).c_str());
    return kOk;
  }
  if (args.command == "status") {
    v1::StatusResponse out;
    v1::StatusRequest req;
    req.set_all(args.all);
    const grpc::Status st = client.stub()->Status(&ctx, req, &out);
    if (!st.ok()) return client.Failed("status", st);
    printf("%s", args.json ? (Json(out) + "\n").c_str() : StatusText(out).c_str());
    return kOk;
  }
  if (args.command == "migrate")
    return FollowMove(&client, args, "migrate", client.stub()->Migrate(&ctx, migrate));
  if (args.command == "checkpoint")
    return FollowMove(&client, args, "checkpoint", client.stub()->Checkpoint(&ctx, checkpoint));
  return FollowMove(&client, args, "restore", client.stub()->Restore(&ctx, restore));
}

}  // namespace
}  // namespace rdmavirt::ctl

int main(int argc, char** argv) { return rdmavirt::ctl::Main(argc, argv); }
