#include "tools/rdmavirtctl/args.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "migrator/host/addresses.h"
#include "tools/rdmavirtctl/cli.h"

namespace rdmavirt::ctl {

const char kUsageText[] =
    "usage: rdmavirtctl [--host HOST[:PORT]] [--tls-dir DIR] [--json] COMMAND [ARGS]\n"
    "\n"
    "Talks to the rdmavirt-migratord of HOST (default 127.0.0.1:7700) over mutual TLS\n"
    "with DIR/ca.pem, DIR/cli.pem, DIR/cli.key (default DIR /etc/rdmavirt/tls).\n"
    "\n"
    "commands:\n"
    "  ps                                   processes under the shim on HOST\n"
    "  migrate (PID | --container NAME) --to HOST[:PORT] [--address A.B.C.D/LEN]\n"
    "                                       live-migrate PID (or a container) to another host\n"
    "  checkpoint (PID | --container NAME) --dir DIR [--leave-running]\n"
    "                                       checkpoint PID (or a container) into DIR on HOST\n"
    "  restore --dir DIR [--on HOST[:PORT]] restore a checkpoint of HOST (on another host)\n"
    "  status [--all]                       moves in flight and recent, and HostInfo\n"
    "                                       (--all: every move in flight in the cluster)\n"
    "  host                                 HostInfo: RDMA devices, ports, GIDs, CRIU\n"
    "  hosts                                the live hosts of HOST's inventory\n"
    "\n"
    "VMs (libvirt; HOST's migrator is the destination's):\n"
    "  vm-migrate DOMAIN --to URI [--to-migrator HOST[:PORT]] [--connect URI]\n"
    "                                       live-migrate an RDMA guest, its connections kept\n"
    "  drain (--to URI | --auto | --connect none --to-migrator HOST) [--dry-run]\n"
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

namespace {

// The host's own commands: its processes and containers, and the host.
std::map<std::string, std::string> HostCommandHelp() {
  return {
      {"ps",
       "usage: rdmavirtctl ps\n"
       "Lists the processes of HOST that are under the rdmavirt shim: PID, PROGRAM,\n"
       "CONTAINER (the Podman container it runs in), ENDPOINT (its stable id), PHASE\n"
       "(running, suspended, released), QPS, MRS, REG MEM (registered memory), CQ\n"
       "PENDING (completions held in shadow CQs).\n"},
      {"migrate",
       "usage: rdmavirtctl migrate PID --to HOST[:PORT] [--max-precopy N] [--drain-timeout-ms MS]\n"
       "                           [--address A.B.C.D/LEN[,...]] [--postcopy] [--wait]\n"
       "       rdmavirtctl migrate --container NAME --to HOST[:PORT] [--drain-timeout-ms MS]\n"
       "                           [--address A.B.C.D/LEN[,...]] [--wait]\n"
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
       "that and prints the outcome as if the move had ended normally.\n"
       "--container NAME moves the Podman container NAME (or id) of --host whole, with\n"
       "the one process in it under the shim: Podman's own checkpoint (runc, CRIU) dumps\n"
       "it in the blackout, and `podman container restore` makes it again on the\n"
       "destination, with its name, mounts and devices. The destination must have its\n"
       "image, its devices and the paths mounted into it, and no container of that name:\n"
       "this is checked before anything is touched. No pre-copy, no --postcopy.\n"},
      {"checkpoint",
       "usage: rdmavirtctl checkpoint (PID | --container NAME) --dir DIR [--leave-running]\n"
       "Checkpoints process PID into DIR (an absolute path on --host, absent or empty).\n"
       "Without --leave-running the process is gone afterwards and its peers stay\n"
       "suspended until it is restored.\n"
       "--container NAME checkpoints the Podman container NAME whole (Podman's export,\n"
       "in DIR); without --leave-running the container is removed afterwards, and\n"
       "`restore --dir DIR` makes it again, with its name, here or --on another host.\n"},
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
      {"host",
       "usage: rdmavirtctl host\n"
       "HostInfo of --host: name, version, RDMA devices with their ports and GIDs, and\n"
       "whether CRIU works there.\n"},
  };
}

// VMs, and the commands run in a guest or for its hooks.
std::map<std::string, std::string> GuestCommandHelp() {
  return {
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
       "                         [--connect URI] [--migrate-uri URI] [--max-precopy N]\n"
       "                         [--dry-run]\n"
       "       rdmavirtctl drain --connect none --to-migrator HOST[:PORT] [--max-precopy N]\n"
       "                         [--dry-run]\n"
       "Moves every RDMA guest of the libvirt at --connect (default qemu:///system; none:\n"
       "this host runs no libvirt) with vm-migrate, and every process under the shim on\n"
       "--host with migrate, off this host: to --to (guests) and --to-migrator\n"
       "(processes; default the host of --to, port 7700), or with --auto, to the live\n"
       "hosts of --host's inventory (its migrator's --inventory, read again before each\n"
       "move): each guest to the host with the most free RDMA NICs for guests (of those\n"
       "registered with a libvirt URI), processes spread over the hosts where CRIU works\n"
       "and an RDMA port is active, a host a move could not start on not picked again.\n"
       "--auto --hosts FILE takes the hosts from FILE instead (\"LIBVIRT-URI\n"
       "MIGRATOR-HOST:PORT\" lines; processes go to the first). The ranks of an MPI job\n"
       "move with their launcher's or daemon's tree (orted, prted, hydra_pmi_proxy,\n"
       "mpirun), as one, to one host, with the service addresses (secondary addresses of\n"
       "this host) that tree's TCP connections are on. A process in a Podman container\n"
       "moves with its container, whole (migrate --container), with the service\n"
       "addresses its connections are on. --max-precopy N goes to each\n"
       "process's move (migrate's). One at a time, with progress on stderr and a\n"
       "summary; --dry-run prints the plan (each process or job tree and where it goes)\n"
       "and moves nothing. A process in the middle of another move is waited for (up\n"
       "to 30 minutes): moved away, it is listed as moved by another move; rolled back,\n"
       "it moves with the drain. Exit code 1 if anything stayed.\n"},
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
  };
}

}  // namespace

const std::map<std::string, std::string>& CommandHelp() {
  static const auto* help = [] {
    auto* all = new std::map<std::string, std::string>(HostCommandHelp());
    all->merge(GuestCommandHelp());
    return all;
  }();
  return *help;
}

int UsageError(const std::string& message, const std::string& command) {
  fprintf(stderr, "rdmavirtctl: %s\n", message.c_str());
  auto it = CommandHelp().find(command);
  fprintf(stderr, "%s",
          it != CommandHelp().end() ? it->second.c_str() : "run `rdmavirtctl --help` for usage\n");
  return kUsage;
}

namespace {

// The options that take no value: where each is recorded, or null for an
// argument that is not one.
bool* Flag(Args* a, const std::string& arg) {
  static constexpr std::pair<const char*, bool Args::*> kFlags[] = {
      {"-h", &Args::help},
      {"--help", &Args::help},
      {"--json", &Args::json},
      {"--leave-running", &Args::leave_running},
      {"--postcopy", &Args::postcopy},
      {"--unsafe", &Args::unsafe},
      {"--dry-run", &Args::dry_run},
      {"--auto", &Args::auto_pick},
      {"--wait", &Args::wait},
      {"--all", &Args::all},
  };
  for (const auto& [name, member] : kFlags)
    if (arg == name) return &(a->*member);
  return nullptr;
}

// The option at argv[*i] ("--name=value" or "--name value", which moves *i
// on): 0, or an exit code after printing why.
int ValuedOption(int argc, char** argv, int* i, Args* a) {
  static const std::vector<std::string> kValued = {
      "--host",        "--tls-dir",          "--to",          "--dir",           "--on",
      "--max-precopy", "--drain-timeout-ms", "--address",     "--device",        "--mac",
      "--to-migrator", "--connect",          "--migrate-uri", "--guest-command", "--with",
      "--container"};
  const std::string arg = argv[*i];
  std::string value;
  const size_t eq = arg.find('=');
  std::string name = arg.substr(0, eq);
  if (std::find(kValued.begin(), kValued.end(), name) == kValued.end())
    return UsageError(absl::StrCat("unknown option ", name), a->command);
  if (eq != std::string::npos) {
    value = arg.substr(eq + 1);
  } else if (*i + 1 < argc) {
    value = argv[++*i];
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
  return 0;
}

}  // namespace

int ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (bool* flag = Flag(a, arg); flag != nullptr) {
      *flag = true;
      continue;
    }
    if (arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
      if (int rc = ValuedOption(argc, argv, &i, a); rc != 0) return rc;
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

std::string Opt(const Args& a, const std::string& name) {
  auto it = a.options.find(name);
  return it == a.options.end() ? std::string() : it->second;
}

int HostTarget(const Args& a, std::string* target) {
  absl::StatusOr<migrator::HostPort> host = migrator::ParseHostPort(a.host);
  if (!host.ok()) return UsageError(absl::StrCat("--host: ", host.status().message()));
  *target = host->Target();
  return kOk;
}

}  // namespace rdmavirt::ctl
