#include "tools/rdmavirtctl/guest_commands.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/addresses.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/domain_xml.h"
#include "tools/rdmavirtctl/drain.h"
#include "tools/rdmavirtctl/format.h"
#include "tools/rdmavirtctl/snapshot.h"
#include "tools/rdmavirtctl/vm_migrate.h"

namespace rdmavirt::ctl {
namespace {

// The options each command takes.
const std::map<std::string, std::vector<std::string>>& GuestOptions() {
  static const auto* allowed = new std::map<std::string, std::vector<std::string>>{
      {"vm-migrate", {"--to", "--to-migrator", "--connect", "--migrate-uri", "--guest-command"}},
      {"drain",
       {"--to", "--to-migrator", "--connect", "--migrate-uri", "--guest-command", "--hosts",
        "--max-precopy"}},
      {"snapshot", {"--with", "--connect", "--guest-command"}},
      {"revert", {"--connect", "--guest-command"}},
      {"suspend", {"--drain-timeout-ms"}},
      {"resume", {"--device"}},
      {"guest-event", {"--mac"}},
  };
  return *allowed;
}

// The options and flags given are the command's.
int CheckGuestOptions(const Args& args) {
  const std::vector<std::string>& allowed = GuestOptions().at(args.command);
  for (const auto& [name, value] : args.options)
    if (std::find(allowed.begin(), allowed.end(), name) == allowed.end())
      return UsageError(absl::StrCat(args.command, " does not take ", name), args.command);
  if (args.unsafe && args.command != "vm-migrate" && args.command != "drain")
    return UsageError("--unsafe is for vm-migrate and drain", args.command);
  if ((args.dry_run || args.auto_pick) && args.command != "drain")
    return UsageError("--dry-run and --auto are for drain", args.command);
  if (args.leave_running) return UsageError("--leave-running is for checkpoint", args.command);
  return kOk;
}

// --connect and --guest-command (an absolute path) into `o`, when given.
int GuestOptionsInto(const Args& args, VmOptions* o) {
  if (!Opt(args, "--connect").empty()) o->connect = Opt(args, "--connect");
  if (!Opt(args, "--guest-command").empty()) {
    o->guest_command = Opt(args, "--guest-command");
    if (o->guest_command[0] != '/')
      return UsageError("--guest-command takes an absolute path", args.command);
  }
  o->tls_dir = args.tls_dir;
  o->json = args.json;
  return kOk;
}

int SnapshotCommand(const Args& args) {
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
  if (int rc = GuestOptionsInto(args, &o.vm); rc != kOk) return rc;
  return args.command == "snapshot" ? Snapshot(o) : Revert(o);
}

// The hosts of a --hosts FILE, as drain candidates.
int HostsFileInto(const Args& args, DrainOptions* d) {
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
    d->candidates.emplace_back(uri, hp->Target());
  }
  return kOk;
}

// Where vm-migrate or drain goes: --to with a libvirt URI, or (drain)
// --auto, from the inventory or a --hosts FILE.
int DestinationsInto(const Args& args, const VmOptions& o, DrainOptions* d) {
  const bool drain = args.command == "drain";
  if (drain && args.auto_pick) {
    if (!o.to.empty() || !Opt(args, "--to-migrator").empty())
      return UsageError("--auto or --to, not both", args.command);
    d->from_inventory = Opt(args, "--hosts").empty();
  }
  if (d->from_inventory) return kOk;  // read from --host's migrator as the drain goes
  if (drain && args.auto_pick) return HostsFileInto(args, d);
  if (!Opt(args, "--hosts").empty()) return UsageError("--hosts is for --auto", args.command);
  // A host without libvirt has no guests to send anywhere: its processes
  // need only the destination's migrator.
  if (drain && o.to.empty() && Opt(args, "--connect") == "none" &&
      !Opt(args, "--to-migrator").empty())
    return kOk;
  if (o.to.empty() || o.to.find("://") == std::string::npos)
    return UsageError(absl::StrCat(args.command,
                                   drain ? " needs --auto or --to with a libvirt URI"
                                         : " needs --to with a libvirt URI",
                                   " (qemu+ssh://HOST/system)",
                                   drain ? ", or --connect none with --to-migrator" : ""),
                      args.command);
  return kOk;
}

// The migrator of --to's host (--to-migrator, default the host of --to),
// or a drain's without --to (--connect none).
int DestinationMigratorInto(const Args& args, VmOptions* o) {
  if (o->to.empty() && Opt(args, "--to-migrator").empty()) return kOk;
  o->to_migrator = Opt(args, "--to-migrator");
  if (o->to_migrator.empty()) o->to_migrator = UriHost(o->to);
  if (o->to_migrator.empty())
    return UsageError("--to names no host: give --to-migrator HOST[:PORT]", args.command);
  absl::StatusOr<migrator::HostPort> m = migrator::ParseHostPort(o->to_migrator);
  if (!m.ok())
    return UsageError(absl::StrCat("--to-migrator: ", m.status().message()), args.command);
  o->to_migrator = m->Target();
  return kOk;
}

// vm-migrate and drain.
int VmCommand(const Args& args) {
  const bool drain = args.command == "drain";
  if (drain ? !args.positional.empty() : args.positional.size() != 1)
    return UsageError(drain ? "drain takes no arguments" : "vm-migrate takes a DOMAIN",
                      args.command);
  VmOptions o;
  if (!drain) o.domain = args.positional[0];
  o.to = Opt(args, "--to");
  DrainOptions d;
  if (int rc = DestinationsInto(args, o, &d); rc != kOk) return rc;
  if (int rc = DestinationMigratorInto(args, &o); rc != kOk) return rc;
  o.migrate_uri = Opt(args, "--migrate-uri");
  if (int rc = GuestOptionsInto(args, &o); rc != kOk) return rc;
  o.unsafe = args.unsafe;
  if (!drain) return VmMigrate(o);
  if (int rc = HostTarget(args, &d.host); rc != kOk) return rc;
  if (!Opt(args, "--max-precopy").empty()) {
    absl::StatusOr<uint32_t> n = ParseCount("--max-precopy", Opt(args, "--max-precopy"), 64);
    if (!n.ok()) return UsageError(std::string(n.status().message()), "drain");
    d.max_precopy = *n;
  }
  d.vm = o;
  d.dry_run = args.dry_run;
  return Drain(d);
}

// The request of suspend or guest-event (resume's is its --device).
int EndpointRequests(const Args& args, v1::SuspendRequest* suspend, v1::GuestEventRequest* event) {
  if (args.command == "suspend") {
    for (const std::string& p : args.positional) {
      absl::StatusOr<int> pid = ParsePid(p);
      if (!pid.ok()) return UsageError(std::string(pid.status().message()), args.command);
      suspend->add_pids(*pid);
    }
    if (!Opt(args, "--drain-timeout-ms").empty()) {
      absl::StatusOr<uint32_t> n =
          ParseCount("--drain-timeout-ms", Opt(args, "--drain-timeout-ms"), 600000);
      if (!n.ok()) return UsageError(std::string(n.status().message()), args.command);
      suspend->set_drain_timeout_ms(*n);
    }
  } else if (args.command == "resume") {
    if (!args.positional.empty()) return UsageError("resume takes no arguments", args.command);
  } else {
    if (args.positional.size() != 2 ||
        (args.positional[1] != "started" && args.positional[1] != "stopped"))
      return UsageError("guest-event takes DOMAIN and started or stopped", args.command);
    event->set_domain(args.positional[0]);
    event->set_event(args.positional[1]);
    event->set_mac(Opt(args, "--mac"));
  }
  return kOk;
}

// suspend, resume and guest-event.
int EndpointCommand(const Args& args) {
  v1::SuspendRequest suspend;
  v1::GuestEventRequest event;
  if (int rc = EndpointRequests(args, &suspend, &event); rc != kOk) return rc;
  std::string target;
  if (int rc = HostTarget(args, &target); rc != kOk) return rc;
  Client client(args.tls_dir, target);
  if (int rc = client.Connect(); rc != kOk) return rc;
  if (args.command == "guest-event") {
    v1::GuestEventResponse out;
    const grpc::Status st = client.Call(&v1::Operator::Stub::GuestEvent, event, &out);
    return st.ok() ? kOk : client.Failed("guest-event", st);
  }
  v1::GuestReport out;
  grpc::Status st;
  if (args.command == "suspend") {
    st = client.Call(&v1::Operator::Stub::Suspend, suspend, &out);
  } else {
    v1::ResumeRequest req;
    req.set_device(Opt(args, "--device"));
    st = client.Call(&v1::Operator::Stub::Resume, req, &out);
  }
  if (!st.ok()) return client.Failed(args.command.c_str(), st);
  Show(args.json, out, GuestReportText);
  return out.ok() ? kOk : kFailed;
}

}  // namespace

bool IsGuestCommand(const std::string& command) { return GuestOptions().contains(command); }

int GuestCommand(const Args& args) {
  if (int rc = CheckGuestOptions(args); rc != kOk) return rc;
  if (args.command == "snapshot" || args.command == "revert") return SnapshotCommand(args);
  if (args.command == "vm-migrate" || args.command == "drain") return VmCommand(args);
  return EndpointCommand(args);
}

}  // namespace rdmavirt::ctl
