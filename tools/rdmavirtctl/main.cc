// rdmavirtctl: the operator's CLI to a host's rdmavirt-migratord (Operator
// service, mutual TLS). Exit codes: 0 done, 1 the operation failed (rolled
// back or not), 2 usage error, 3 the daemon cannot be reached.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "migrator/addresses.h"
#include "migrator/service_address.h"
#include "migrator/tls.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"
#include "tools/rdmavirtctl/format.h"

namespace rdmavirt::ctl {
namespace {

constexpr int kOk = 0, kFailed = 1, kUsage = 2, kUnreachable = 3;

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
    "  status                               moves in flight and recent, and HostInfo\n"
    "  host                                 HostInfo: RDMA devices, ports, GIDs, CRIU\n"
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
       "                           [--address A.B.C.D/LEN[,...]]\n"
       "Live-migrates process PID of --host to the migrator at --to (port 7700 by\n"
       "default). The destination is checked before anything is touched; any failure\n"
       "before the process runs on the destination rolls it back onto the source.\n"
       "Progress goes to stderr; the summary (blackout, breakdown) to stdout.\n"
       "--address names IPv4 addresses of --host that belong to the process (its\n"
       "service addresses): they move with it, and so do its established TCP\n"
       "connections on them. The destination must have an interface on their subnet.\n"
       "Without it a process holding a TCP connection cannot move.\n"},
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
       "usage: rdmavirtctl status\n"
       "Moves in flight and the recent ones on --host, with their results, and HostInfo.\n"},
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
  bool help = false;
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
      "--host",        "--tls-dir",          "--to",     "--dir", "--on",
      "--max-precopy", "--drain-timeout-ms", "--address"};
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
      // --address may be given more than once.
      else if (name == "--address" && a->options.contains(name))
        a->options[name] += "," + value;
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

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

class Client {
 public:
  Client(const Args& args, std::string target) : args_(args), target_(std::move(target)) {}

  // kOk, or kUnreachable after saying why.
  int Connect() {
    absl::StatusOr<migrator::TlsFiles> tls = migrator::LoadTls(args_.tls_dir, "cli.pem", "cli.key");
    if (!tls.ok()) {
      fprintf(stderr, "rdmavirtctl: %s\n", std::string(tls.status().message()).c_str());
      return kUnreachable;
    }
    channel_ = grpc::CreateChannel(target_, migrator::MutualTlsChannelCredentials(*tls));
    if (!channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
      fprintf(stderr,
              "rdmavirtctl: cannot reach rdmavirt-migratord at %s (is it running there, and "
              "are its certificates and those in %s of the same CA?)\n",
              target_.c_str(), args_.tls_dir.c_str());
      return kUnreachable;
    }
    stub_ = v1::Operator::NewStub(channel_);
    return kOk;
  }

  v1::Operator::Stub* stub() { return stub_.get(); }
  const std::string& target() const { return target_; }

  // A failed RPC: 1, or 3 when the daemon went away.
  int Failed(const char* what, const grpc::Status& st) {
    fprintf(stderr, "rdmavirtctl: %s: %s (%s)\n", what, st.error_message().c_str(),
            CodeName(st.error_code()));
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE &&
        channel_->GetState(false) != GRPC_CHANNEL_READY)
      return kUnreachable;
    return kFailed;
  }

  static const char* CodeName(grpc::StatusCode c) {
    switch (c) {
      case grpc::StatusCode::CANCELLED:
        return "CANCELLED";
      case grpc::StatusCode::INVALID_ARGUMENT:
        return "INVALID_ARGUMENT";
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        return "DEADLINE_EXCEEDED";
      case grpc::StatusCode::NOT_FOUND:
        return "NOT_FOUND";
      case grpc::StatusCode::ALREADY_EXISTS:
        return "ALREADY_EXISTS";
      case grpc::StatusCode::PERMISSION_DENIED:
        return "PERMISSION_DENIED";
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED";
      case grpc::StatusCode::FAILED_PRECONDITION:
        return "FAILED_PRECONDITION";
      case grpc::StatusCode::ABORTED:
        return "ABORTED";
      case grpc::StatusCode::UNIMPLEMENTED:
        return "UNIMPLEMENTED";
      case grpc::StatusCode::INTERNAL:
        return "INTERNAL";
      case grpc::StatusCode::UNAVAILABLE:
        return "UNAVAILABLE";
      case grpc::StatusCode::DATA_LOSS:
        return "DATA_LOSS";
      case grpc::StatusCode::UNAUTHENTICATED:
        return "UNAUTHENTICATED";
      default:
        return "UNKNOWN";
    }
  }

 private:
  const Args& args_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Operator::Stub> stub_;
};

// Reads a Progress stream: lines on stderr, the report at the end.
int FollowMove(Client* c, const Args& args, const char* what,
               std::unique_ptr<grpc::ClientReaderInterface<v1::Progress>> reader) {
  v1::Progress p;
  v1::MigrationReport report;
  bool have_report = false;
  std::string last_phase;
  absl::Time last_bytes = absl::InfinitePast();
  while (reader->Read(&p)) {
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
  // What each command takes.
  static const std::map<std::string, std::pair<size_t, std::vector<std::string>>> kTakes = {
      {"ps", {0, {}}},
      {"status", {0, {}}},
      {"host", {0, {}}},
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

  Client client(args, host->Target());
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
  if (args.command == "status") {
    v1::StatusResponse out;
    const grpc::Status st = client.stub()->Status(&ctx, v1::StatusRequest(), &out);
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
