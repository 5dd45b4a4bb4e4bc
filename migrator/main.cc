// rdmavirt-migratord: the per-host migrator daemon (see migrator.h and
// docs/migrator.md). Serves this host's shims on a Unix socket and the
// Operator and Transfer services over gRPC with mutual TLS.
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "migrator/criu/checkpointer.h"
#include "migrator/host/addresses.h"
#include "migrator/host/containers.h"
#include "migrator/host/failpoints.h"
#include "migrator/host/inventory.h"
#include "migrator/host/log.h"
#include "migrator/host/process_control.h"
#include "migrator/host/service_address.h"
#include "migrator/move/migrator.h"
#include "migrator/transport/certificates.h"
#include "migrator/transport/grpc_service.h"
#include "migrator/transport/shim_server.h"
#include "migrator/transport/tls.h"

namespace rdmavirt::migrator {
namespace {

constexpr char kUsage[] =
    "usage: rdmavirt-migratord [options]\n"
    "  --listen ADDR:PORT    gRPC (mutual TLS) listen address (default 0.0.0.0:7700)\n"
    "  --socket PATH         Unix socket for the shims (default /run/rdmavirt/migratord.sock)\n"
    "  --state-dir DIR       migration records and images (default /var/lib/rdmavirt)\n"
    "  --tls-dir DIR         ca.pem, host.pem, host.key (default /etc/rdmavirt/tls)\n"
    "  --criu-log-dir DIR    CRIU's logs (default STATE-DIR/criu-logs)\n"
    "  --criu-plugin-dir DIR  CRIU plugins for rdmavirt's CRIU calls only (default: criu-plugins\n"
    "                        beside this program, else /usr/local/lib/rdmavirt/criu-plugins)\n"
    "  --host-name NAME      this host's name in reports (default: hostname)\n"
    "  --max-precopy N       pre-dump iterations at most (default 3)\n"
    "  --guest-nic-bridge BR  this host gives its RDMA guests NICs on bridge BR\n"
    "  --guest-nic-first A.B.C.D/LEN\n"
    "                        the first of the guests' fabric addresses (with BR)\n"
    "  --guest-nic-capacity N  RDMA guests this host can run (with BR, default 8)\n"
    "  --inventory URL[,URL...]  etcd endpoints (https://HOST:PORT with this host's\n"
    "                        certificate, or http://): register this host there, find\n"
    "                        peers' hosts by their GIDs, record moves (docs/migrator.md)\n"
    "  --advertise HOST:PORT  where other migrators reach this one (the management\n"
    "                        network; with --inventory, default the --listen address)\n"
    "  --inventory-prefix P  keys under P (default /rdmavirt/)\n"
    "  --inventory-ttl S     seconds a dead migrator stays listed (default 10)\n"
    "  --libvirt-uri URI     where guests moving to this host go, for drain --auto\n"
    "  --podman PATH         the podman that runs this host's containers, for their moves\n"
    "                        (default: podman on PATH; \"none\": containers are refused)\n"
    "SIGTERM or SIGINT stops it cleanly.\n";

struct Flags {
  std::string listen = "0.0.0.0:7700";
  std::string socket = "/run/rdmavirt/migratord.sock";
  std::string state_dir = "/var/lib/rdmavirt";
  std::string tls_dir = "/etc/rdmavirt/tls";
  std::string criu_log_dir;
  std::string criu_plugin_dir;
  std::string host_name;
  uint32_t max_precopy = 3;
  std::string guest_nic_bridge;
  std::string guest_nic_first;
  uint32_t guest_nic_capacity = 8;
  std::string inventory;
  std::string advertise;
  std::string inventory_prefix = "/rdmavirt/";
  uint32_t inventory_ttl_s = 10;
  std::string libvirt_uri;
  std::string podman;
};

// One flag's value into `f`: 0, or 2 (the exit code) with what is wrong
// said.
int SetFlag(const std::string& name, const std::string& value, Flags* f) {
  if (name == "--listen")
    f->listen = value;
  else if (name == "--socket")
    f->socket = value;
  else if (name == "--state-dir")
    f->state_dir = value;
  else if (name == "--tls-dir")
    f->tls_dir = value;
  else if (name == "--criu-log-dir")
    f->criu_log_dir = value;
  else if (name == "--criu-plugin-dir")
    f->criu_plugin_dir = value;
  else if (name == "--host-name")
    f->host_name = value;
  else if (name == "--max-precopy") {
    if (!absl::SimpleAtoi(value, &f->max_precopy) || f->max_precopy == 0 || f->max_precopy > 64) {
      fprintf(stderr, "rdmavirt-migratord: --max-precopy takes 1..64\n");
      return 2;
    }
  } else if (name == "--guest-nic-bridge") {
    f->guest_nic_bridge = value;
  } else if (name == "--guest-nic-first") {
    f->guest_nic_first = value;
  } else if (name == "--guest-nic-capacity") {
    if (!absl::SimpleAtoi(value, &f->guest_nic_capacity) || f->guest_nic_capacity == 0 ||
        f->guest_nic_capacity > 4096) {
      fprintf(stderr, "rdmavirt-migratord: --guest-nic-capacity takes 1..4096\n");
      return 2;
    }
  } else if (name == "--inventory") {
    f->inventory = value;
  } else if (name == "--advertise") {
    f->advertise = value;
  } else if (name == "--inventory-prefix") {
    f->inventory_prefix = value;
  } else if (name == "--inventory-ttl") {
    if (!absl::SimpleAtoi(value, &f->inventory_ttl_s) || f->inventory_ttl_s < 3 ||
        f->inventory_ttl_s > 3600) {
      fprintf(stderr, "rdmavirt-migratord: --inventory-ttl takes 3..3600 seconds\n");
      return 2;
    }
  } else if (name == "--libvirt-uri") {
    f->libvirt_uri = value;
  } else if (name == "--podman") {
    f->podman = value;
  } else {
    fprintf(stderr, "rdmavirt-migratord: unknown option %s\n%s", name.c_str(), kUsage);
    return 2;
  }
  return 0;
}

// The flags that depend on each other, and the defaults that follow from
// others: 0, or 2 with what is wrong said.
int CheckFlags(Flags* f) {
  if (!f->guest_nic_bridge.empty()) {
    // A Linux interface name: it goes into the guests' domain XML as is.
    const bool name_ok =
        f->guest_nic_bridge.size() <= 15 &&
        std::all_of(f->guest_nic_bridge.begin(), f->guest_nic_bridge.end(), [](char c) {
          return isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
        });
    if (!name_ok) {
      fprintf(stderr, "rdmavirt-migratord: --guest-nic-bridge: not an interface name: %s\n",
              f->guest_nic_bridge.c_str());
      return 2;
    }
    absl::StatusOr<ServiceAddress> first = ParseServiceAddress(f->guest_nic_first);
    if (!first.ok()) {
      fprintf(stderr, "rdmavirt-migratord: --guest-nic-first: %s\n",
              std::string(first.status().message()).c_str());
      return 2;
    }
  } else if (!f->guest_nic_first.empty()) {
    fprintf(stderr, "rdmavirt-migratord: --guest-nic-first needs --guest-nic-bridge\n");
    return 2;
  }
  if (f->inventory.empty() && (!f->advertise.empty() || !f->libvirt_uri.empty())) {
    fprintf(stderr, "rdmavirt-migratord: --advertise and --libvirt-uri need --inventory\n");
    return 2;
  }
  if (f->criu_log_dir.empty()) f->criu_log_dir = f->state_dir + "/criu-logs";
  return 0;
}

// 0 to go on, else the exit code.
int ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      fputs(kUsage, stdout);
      return -1;
    }
    std::string name = a, value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      fprintf(stderr, "rdmavirt-migratord: %s needs a value\n%s", a.c_str(), kUsage);
      return 2;
    }
    if (int rc = SetFlag(name, value, f); rc != 0) return rc;
  }
  return CheckFlags(f);
}

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Where rdmavirt's CRIU plugin is: the flag's, else criu-plugins beside
// this program (a build tree), else the installed one. Empty if none.
std::string CriuPluginDir(const std::string& flag) {
  if (!flag.empty()) return flag;
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<size_t>(n));
    dir = dir.substr(0, dir.rfind('/')) + "/criu-plugins";
    if (IsDir(dir)) return dir;
  }
  const std::string installed = "/usr/local/lib/rdmavirt/criu-plugins";
  return IsDir(installed) ? installed : std::string();
}

// This host's certificate and key, checked; 1 (the daemon's exit code)
// when they cannot serve.
int LoadHostTls(const Flags& flags, TlsFiles* out) {
  absl::StatusOr<TlsFiles> tls = LoadTls(flags.tls_dir, "host.pem", "host.key");
  if (!tls.ok()) {
    Log("cannot start: %s", tls.status().message());
    return 1;
  }
  if (absl::Status own =
          CheckOwnCertificate(*tls, flags.tls_dir + "/host.pem", CertRole::kHost, absl::Now());
      !own.ok()) {
    Log("cannot start: %s", own.message());
    return 1;
  }
  if (absl::StatusOr<CertInfo> mine = InspectCertificate(tls->cert);
      mine.ok() && mine->not_after - absl::Now() < absl::Hours(24 * 30))
    Log("warning: %s/host.pem expires on %s; make a new one before then", flags.tls_dir,
        absl::FormatTime("%Y-%m-%d", mine->not_after, absl::UTCTimeZone()));
  *out = *std::move(tls);
  return 0;
}

// Every CRIU this daemon runs (libcriu's `criu swrk`, a child) loads its
// plugins from here: set before any thread starts. 2 for a bad flag.
int SetCriuPluginDir(const Flags& flags) {
  const std::string plugins = CriuPluginDir(flags.criu_plugin_dir);
  if (!flags.criu_plugin_dir.empty() && !IsDir(plugins)) {
    fprintf(stderr, "rdmavirt-migratord: --criu-plugin-dir: %s is not a directory\n",
            plugins.c_str());
    return 2;
  }
  if (!plugins.empty()) {
    setenv("CRIU_LIBS_DIR", plugins.c_str(), 1);
    Log("CRIU plugins from %s", plugins);
  } else {
    Log("no CRIU plugin directory: pre-copy is skipped for processes that map an RDMA device");
  }
  return 0;
}

// With --inventory: where other migrators reach this one (`advertise`) and
// the inventory's client; 2 for a bad flag. Without: nothing.
int OpenInventory(const Flags& flags, int listen_port, const TlsFiles& tls, std::string* advertise,
                  std::unique_ptr<Inventory>* inventory) {
  if (flags.inventory.empty()) return 0;
  absl::StatusOr<HostPort> a =
      ParseHostPort(flags.advertise.empty() ? flags.listen : flags.advertise, listen_port);
  if (!a.ok() || a->host == "0.0.0.0" || a->host == "::") {
    fprintf(stderr,
            "rdmavirt-migratord: --advertise %s: give the address other migrators reach this "
            "one at (HOST:PORT on the management network)\n",
            a.ok() ? "is needed when --listen is a wildcard"
                   : std::string(a.status().message()).c_str());
    return 2;
  }
  *advertise = a->Target();
  Inventory::Options io;
  io.endpoints = {flags.inventory};
  io.prefix = flags.inventory_prefix;
  io.ttl = absl::Seconds(flags.inventory_ttl_s);
  io.tls = tls;
  absl::StatusOr<std::unique_ptr<Inventory>> inv = Inventory::Create(io);
  if (!inv.ok()) {
    fprintf(stderr, "rdmavirt-migratord: --inventory: %s\n",
            std::string(inv.status().message()).c_str());
    return 2;
  }
  *inventory = *std::move(inv);
  return 0;
}

Migrator::Options MigratorOptions(const Flags& flags, int port, Inventory* inventory,
                                  const TlsFiles& tls) {
  Migrator::Options mo;
  mo.inventory = inventory;
  mo.host_name = flags.host_name;
  mo.state_dir = flags.state_dir;
  mo.version = RDMAVIRT_VERSION;
  mo.port = port;
  mo.max_precopy_iterations = flags.max_precopy;
  mo.guest_nic_bridge = flags.guest_nic_bridge;
  mo.guest_nic_first = flags.guest_nic_first;
  mo.guest_nic_capacity = flags.guest_nic_capacity;
  std::shared_ptr<grpc::ChannelCredentials> peer_creds = MutualTlsChannelCredentials(tls);
  mo.connect = [peer_creds](const std::string& target) {
    // A channel of its own (no subchannel shared with an earlier one): a
    // guest's address changes under its connections when its NIC is
    // swapped, and a fresh stub must not inherit a dead connection.
    // And no retry by gRPC itself: a step of a move is sent once (the
    // CLI's channel says why).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    return v1::Transfer::NewStub(grpc::CreateCustomChannel(target, peer_creds, args));
  };
  return mo;
}

// The migrator's entry in the inventory, kept alive until the daemon stops.
void Register(Inventory* inventory, Migrator* migrator, const std::string& advertise,
              const TlsFiles& tls, const Flags& flags) {
  const std::string fingerprint = InspectCertificate(tls.cert).value_or(CertInfo{}).sha256;
  const std::string started = absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone());
  (void)inventory->StartRegistration([migrator, advertise, fingerprint, started, &flags] {
    v1::InventoryHost h = migrator->DescribeForInventory();
    h.set_address(advertise);
    h.set_cert_sha256(fingerprint);
    h.set_libvirt_uri(flags.libvirt_uri);
    h.set_registered_at(started);
    return h;
  });
}

// The operator's and the other migrators' services on `target`, over
// mutual TLS; null (said) when it cannot listen there.
std::unique_ptr<grpc::Server> StartServer(const std::string& target, const TlsFiles& tls,
                                          OperatorService* op, TransferService* transfer) {
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(target, MutualTlsServerCredentials(tls), &bound);
  builder.RegisterService(op);
  builder.RegisterService(transfer);
  builder.SetMaxReceiveMessageSize(8 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    Log("cannot start: cannot listen on %s", target);
    return nullptr;
  }
  return server;
}

// SIGTERM and SIGINT blocked, to be taken by Run's sigwait, in no other
// thread (every thread started after inherits the mask); SIGPIPE ignored.
sigset_t BlockStopSignals() {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return stop;
}

int Run(int argc, char** argv) {
  Flags flags;
  if (int rc = ParseFlags(argc, argv, &flags); rc != 0) return rc < 0 ? 0 : rc;
  absl::StatusOr<HostPort> listen = ParseHostPort(flags.listen);
  if (!listen.ok()) {
    fprintf(stderr, "rdmavirt-migratord: --listen: %s\n",
            std::string(listen.status().message()).c_str());
    return 2;
  }
  TlsFiles tls;
  if (int rc = LoadHostTls(flags, &tls); rc != 0) return rc;
  if (int rc = SetCriuPluginDir(flags); rc != 0) return rc;

  const sigset_t stop = BlockStopSignals();

  ShimServer::Options so;
  so.socket_path = flags.socket;
  absl::StatusOr<std::unique_ptr<ShimServer>> shims = ShimServer::Start(so);
  if (!shims.ok()) {
    Log("cannot start: shim socket: %s", shims.status().ToString());
    return 1;
  }
  std::unique_ptr<Checkpointer> criu = NewCriuCheckpointer(flags.criu_log_dir, flags.tls_dir);
  std::unique_ptr<ProcessControl> procs = NewProcessControl();
  std::string advertise;
  std::unique_ptr<Inventory> inventory;
  if (int rc = OpenInventory(flags, listen->port, tls, &advertise, &inventory); rc != 0) return rc;
  std::unique_ptr<ContainerRuntime> containers;
  if (flags.podman != "none") containers = NewPodman(flags.podman);
  Migrator::Options mo = MigratorOptions(flags, listen->port, inventory.get(), tls);
  mo.containers = containers.get();
  Migrator migrator(std::move(mo), shims->get(), criu.get(), procs.get());

  OperatorService op(&migrator);
  TransferService transfer(&migrator);
  std::unique_ptr<grpc::Server> server = StartServer(listen->Target(), tls, &op, &transfer);
  if (server == nullptr) return 1;
  Log("rdmavirt-migratord %s: listening on %s (mutual TLS), shims on %s, state in %s",
      RDMAVIRT_VERSION, listen->Target(), flags.socket, flags.state_dir);
  if (const std::string points = FailpointsSet(); !points.empty())
    Log("failpoints set (RDMAVIRT_FAILPOINTS, for tests): %s", points);

  // Moves a previous run left in flight; shims reconnect meanwhile.
  std::thread recovery([&migrator] {
    (void)migrator.GetHostInfo();  // runs `criu check` once, before anyone waits for it
    migrator.Recover();
  });
  if (inventory != nullptr) Register(inventory.get(), &migrator, advertise, tls, flags);

  int sig = 0;
  sigwait(&stop, &sig);
  Log("%s: stopping", strsignal(sig));
  // Off the inventory first: no move should pick a host that is going.
  if (inventory != nullptr) inventory->StopRegistration(/*revoke=*/true);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  recovery.join();
  shims->reset();
  Log("stopped");
  return 0;
}

}  // namespace
}  // namespace rdmavirt::migrator

int main(int argc, char** argv) { return rdmavirt::migrator::Run(argc, argv); }
