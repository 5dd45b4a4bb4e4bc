#include "tools/rdmavirtctl/host_commands.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/addresses.h"
#include "migrator/host/service_address.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/follow_move.h"
#include "tools/rdmavirtctl/format.h"

namespace rdmavirt::ctl {
namespace {

// What each command takes: how many positional arguments (a PID or
// none), which options.
const std::pair<size_t, std::vector<std::string>>& Takes(const std::string& command) {
  static const auto* takes = new std::map<std::string, std::pair<size_t, std::vector<std::string>>>{
      {"ps", {0, {}}},
      {"status", {0, {}}},
      {"host", {0, {}}},
      {"hosts", {0, {}}},
      {"migrate", {1, {"--to", "--max-precopy", "--drain-timeout-ms", "--address", "--container"}}},
      {"checkpoint", {1, {"--dir", "--container"}}},
      {"restore", {0, {"--dir", "--on"}}},
  };
  return takes->at(command);
}

// The arguments, options and flags given are the command's.
int CheckHostArgs(const Args& args) {
  const auto& [takes_pid, allowed] = Takes(args.command);
  // A container instead of a PID.
  const size_t npos = args.options.contains("--container") ? 0 : takes_pid;
  if (args.options.contains("--container") && !args.positional.empty())
    return UsageError(absl::StrCat(args.command, " takes a PID or --container, not both"),
                      args.command);
  if (args.positional.size() != npos)
    return UsageError(npos ? absl::StrCat(args.command, " takes a PID or --container NAME")
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
  return kOk;
}

int MigrateRequestOf(const Args& args, int pid, v1::MigrateRequest* migrate) {
  if (Opt(args, "--to").empty()) return UsageError("migrate needs --to HOST[:PORT]", "migrate");
  absl::StatusOr<migrator::HostPort> to = migrator::ParseHostPort(Opt(args, "--to"));
  if (!to.ok()) return UsageError(absl::StrCat("--to: ", to.status().message()), "migrate");
  migrate->set_pid(pid);
  migrate->set_container(Opt(args, "--container"));
  if (args.postcopy && !migrate->container().empty())
    return UsageError("a container moves without --postcopy", "migrate");
  migrate->set_destination(to->Target());
  migrate->set_postcopy(args.postcopy);
  if (!Opt(args, "--max-precopy").empty()) {
    absl::StatusOr<uint32_t> n = ParseCount("--max-precopy", Opt(args, "--max-precopy"), 64);
    if (!n.ok()) return UsageError(std::string(n.status().message()), "migrate");
    migrate->set_max_precopy_iterations(*n);
  }
  if (!Opt(args, "--drain-timeout-ms").empty()) {
    absl::StatusOr<uint32_t> n =
        ParseCount("--drain-timeout-ms", Opt(args, "--drain-timeout-ms"), 600000);
    if (!n.ok()) return UsageError(std::string(n.status().message()), "migrate");
    migrate->set_drain_timeout_ms(*n);
  }
  if (args.options.contains("--address")) {
    for (absl::string_view a : absl::StrSplit(Opt(args, "--address"), ',')) {
      absl::StatusOr<migrator::ServiceAddress> parsed = migrator::ParseServiceAddress(a);
      if (!parsed.ok())
        return UsageError(absl::StrCat("--address: ", parsed.status().message()), "migrate");
      migrate->add_addresses(std::string(a));
    }
  }
  return kOk;
}

int CheckpointRequestOf(const Args& args, int pid, v1::CheckpointRequest* checkpoint) {
  if (Opt(args, "--dir").empty() || Opt(args, "--dir")[0] != '/')
    return UsageError("checkpoint needs --dir with an absolute path", "checkpoint");
  checkpoint->set_pid(pid);
  checkpoint->set_container(Opt(args, "--container"));
  checkpoint->set_dir(Opt(args, "--dir"));
  checkpoint->set_leave_running(args.leave_running);
  return kOk;
}

int RestoreRequestOf(const Args& args, v1::RestoreRequest* restore) {
  if (Opt(args, "--dir").empty() || Opt(args, "--dir")[0] != '/')
    return UsageError("restore needs --dir with an absolute path", "restore");
  restore->set_dir(Opt(args, "--dir"));
  if (!Opt(args, "--on").empty()) {
    absl::StatusOr<migrator::HostPort> on = migrator::ParseHostPort(Opt(args, "--on"));
    if (!on.ok()) return UsageError(absl::StrCat("--on: ", on.status().message()), "restore");
    restore->set_on(on->Target());
  }
  return kOk;
}

// The requests of the moves, validated before connecting.
struct MoveRequests {
  v1::MigrateRequest migrate;
  v1::CheckpointRequest checkpoint;
  v1::RestoreRequest restore;
};

int MoveRequestsOf(const Args& args, MoveRequests* r) {
  int pid = 0;
  if (Takes(args.command).first == 1 && !args.positional.empty()) {
    absl::StatusOr<int> p = ParsePid(args.positional[0]);
    if (!p.ok()) return UsageError(std::string(p.status().message()), args.command);
    pid = *p;
  }
  if (args.command == "migrate") return MigrateRequestOf(args, pid, &r->migrate);
  if (args.command == "checkpoint") return CheckpointRequestOf(args, pid, &r->checkpoint);
  if (args.command == "restore") return RestoreRequestOf(args, &r->restore);
  return kOk;
}

// One listing RPC, its answer shown as JSON or as `text` says.
template <typename Request, typename Response>
int List(Client* client, const Args& args, Client::Rpc<Request, Response> rpc,
         const Request& request, std::string (*text)(const Response&)) {
  Response out;
  const grpc::Status st = client->Call(rpc, request, &out);
  if (!st.ok()) return client->Failed(args.command.c_str(), st);
  Show(args.json, out, text);
  return kOk;
}

int Call(Client* client, const Args& args, const MoveRequests& r) {
  using Stub = v1::Operator::Stub;
  if (args.command == "ps")
    return List(client, args, &Stub::ListEndpoints, v1::ListEndpointsRequest(), EndpointTable);
  if (args.command == "host")
    return List(client, args, &Stub::GetHostInfo, v1::HostInfoRequest(), HostText);
  if (args.command == "hosts")
    return List(client, args, &Stub::ListHosts, v1::ListHostsRequest(), HostsTable);
  if (args.command == "status") {
    v1::StatusRequest req;
    req.set_all(args.all);
    return List(client, args, &Stub::Status, req, StatusText);
  }
  grpc::ClientContext ctx;
  Stub* stub = client->stub();
  if (args.command == "migrate")
    return FollowMove(client, args, "migrate", stub->Migrate(&ctx, r.migrate));
  if (args.command == "checkpoint")
    return FollowMove(client, args, "checkpoint", stub->Checkpoint(&ctx, r.checkpoint));
  return FollowMove(client, args, "restore", stub->Restore(&ctx, r.restore));
}

}  // namespace

int HostCommand(const Args& args) {
  if (int rc = CheckHostArgs(args); rc != kOk) return rc;
  std::string target;
  if (int rc = HostTarget(args, &target); rc != kOk) return rc;
  // Validate everything before connecting.
  MoveRequests requests;
  if (int rc = MoveRequestsOf(args, &requests); rc != kOk) return rc;
  Client client(args.tls_dir, target);
  if (int rc = client.Connect(); rc != kOk) return rc;
  return Call(&client, args, requests);
}

}  // namespace rdmavirt::ctl
