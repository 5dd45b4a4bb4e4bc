#include "migrator/move/migrator.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/addresses.h"
#include "migrator/host/containers.h"
#include "migrator/host/failpoints.h"
#include "migrator/host/inventory.h"
#include "migrator/host/log.h"
#include "migrator/host/rdma_devices.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/move/record_store.h"

namespace rdmavirt::migrator {

namespace {

constexpr size_t kRecentReports = 32;
constexpr absl::Duration kDescribeTimeout = absl::Seconds(10);
constexpr uint32_t kQpTypeUd = 4;  // IBV_QPT_UD (QpSummary.qp_type)

Migrator::Options WithDefaults(Migrator::Options o) {
  if (o.host_name.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    o.host_name = name;
  }
  if (!o.list_devices) o.list_devices = ListRdmaDevices;
  if (!o.address_toward) o.address_toward = LocalAddressToward;
  if (o.max_precopy_iterations == 0) o.max_precopy_iterations = 3;
  if (o.drain_timeout_ms == 0) o.drain_timeout_ms = 10000;
  if (!o.locate_peer && o.inventory != nullptr) {
    Inventory* inventory = o.inventory;
    const std::string self = o.host_name;
    o.locate_peer = [inventory, self](const std::string& gid) -> absl::StatusOr<std::string> {
      absl::StatusOr<v1::InventoryHost> owner = inventory->OwnerOfGid(gid);
      if (!owner.ok()) return owner.status();
      return owner->name() == self ? "" : owner->address();
    };
  }
  if (!o.list_hosts && o.inventory != nullptr) {
    Inventory* inventory = o.inventory;
    const std::string self = o.host_name;
    o.list_hosts = [inventory, self]() -> absl::StatusOr<std::vector<std::string>> {
      absl::StatusOr<std::vector<v1::InventoryHost>> hosts = inventory->Hosts();
      if (!hosts.ok()) return hosts.status();
      std::vector<std::string> out;
      for (const v1::InventoryHost& h : *hosts)
        if (h.name() != self && !h.address().empty()) out.push_back(h.address());
      return out;
    };
  }
  if (!o.locate_peer) {
    const int port = o.port;
    o.locate_peer = [port](const std::string& gid) -> absl::StatusOr<std::string> {
      const std::string ip = GidIpv4(gid);
      if (ip.empty() || IsLocalAddress(ip)) return "";
      return absl::StrCat(ip, ":", port);
    };
  }
  return o;
}

}  // namespace

absl::Status Annotate(const absl::Status& st, absl::string_view context) {
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat(context, ": ", st.message()));
}

absl::Status FromGrpc(const grpc::Status& st, absl::string_view context) {
  if (st.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                      absl::StrCat(context, ": ", st.error_message()));
}

Migrator::Migrator(Options options, ShimChannel* shims, Checkpointer* criu, ProcessControl* procs)
    : options_(WithDefaults(std::move(options))),
      shims_(shims),
      criu_(criu),
      procs_(procs),
      own_addresses_(options_.addresses == nullptr ? NewNetlinkAddressControl() : nullptr),
      addresses_(options_.addresses != nullptr ? options_.addresses : own_addresses_.get()) {
  std::error_code ec;
  std::filesystem::create_directories(options_.state_dir + "/migrations", ec);
  std::filesystem::create_directories(options_.state_dir + "/incoming", ec);
  // Finished moves of earlier runs, for Status.
  std::vector<v1::MigrationReport> old;
  for (auto& [dir, rec] : ListRecords(options_.state_dir + "/migrations"))
    if (rec.done()) old.push_back(rec.report());
  std::sort(old.begin(), old.end(),
            [](const auto& a, const auto& b) { return a.started_at() > b.started_at(); });
  LoadGuestNics();
  absl::MutexLock lock(&mu_);
  for (auto& r : old) {
    if (recent_.size() >= kRecentReports) break;
    recent_.push_back(std::move(r));
  }
}

Migrator::~Migrator() {
  stopping_.Notify();
  absl::MutexLock lock(&watchers_mu_);
  for (std::thread& t : watchers_) t.join();
}

std::string Migrator::NewId() {
  static absl::Mutex id_mu(absl::kConstInit);
  static absl::BitGen* gen ABSL_PT_GUARDED_BY(id_mu) = new absl::BitGen;
  absl::MutexLock lock(&id_mu);
  return absl::StrFormat("%s-%06x",
                         absl::FormatTime("%Y%m%d-%H%M%S", absl::Now(), absl::UTCTimeZone()),
                         absl::Uniform<uint32_t>(*gen, 0, 1u << 24));
}

absl::StatusOr<std::string> Migrator::PeerTarget(const std::string& gid) {
  return options_.locate_peer(gid);
}

absl::StatusOr<Migrator::PeerHostSet> Migrator::PeerHosts(const v1::EndpointSummary& e) {
  PeerHostSet hosts;
  bool ud = false;
  for (const v1::QpSummary& q : e.qps()) {
    ud |= q.qp_type() == kQpTypeUd;
    if (q.remote_physical_gid().empty()) continue;
    absl::StatusOr<std::string> t = PeerTarget(q.remote_physical_gid());
    if (!t.ok()) return t.status();
    hosts.named.insert(*t);
  }
  for (const std::string& gid : e.ud_peer_physical_gids()) {
    absl::StatusOr<std::string> t = PeerTarget(gid);
    if (t.ok()) hosts.named.insert(*t);
  }
  if (ud && options_.list_hosts) {
    absl::StatusOr<std::vector<std::string>> all = options_.list_hosts();
    if (!all.ok())
      return Annotate(all.status(), "listing the hosts that may send datagrams to its UD QPs");
    for (const std::string& t : *all)
      if (!hosts.named.contains(t)) hosts.listed.insert(t);
  }
  return hosts;
}

absl::Status Migrator::CheckPeersLocatable(const v1::EndpointSummary& e) {
  std::set<std::string> asked;
  for (const v1::QpSummary& q : e.qps()) {
    if (q.remote_physical_gid().empty() || !asked.insert(q.remote_physical_gid()).second) continue;
    absl::StatusOr<std::string> t = PeerTarget(q.remote_physical_gid());
    if (!t.ok())
      return Annotate(t.status(), absl::StrCat("the host of QP ", q.virtual_qpn(), "'s peer"));
  }
  return absl::OkStatus();
}

absl::Status Migrator::ClaimMove(Move* m) {
  if (options_.inventory == nullptr) return absl::OkStatus();
  const v1::MigrationReport& r = m->rec.report();
  v1::MoveClaim claim;
  claim.set_subject(absl::StrCat("endpoint/", r.endpoint_id()));
  claim.set_migration_id(r.migration_id());
  claim.set_kind(r.kind());
  claim.set_pid(r.pid());
  claim.set_source(options_.host_name);
  claim.set_destination(r.destination());
  claim.set_started_at(r.started_at());
  return options_.inventory->Claim(claim);
}

void Migrator::UnclaimMove(Move* m) {
  if (options_.inventory == nullptr) return;
  const v1::MigrationReport& r = m->rec.report();
  // A claim left behind goes with this host's lease; say so, nothing more.
  if (absl::Status st =
          options_.inventory->Unclaim(absl::StrCat("endpoint/", r.endpoint_id()), r.migration_id());
      !st.ok())
    Log("migration %s: %s", r.migration_id(), st.message());
}

v1::HostInfo Migrator::GetHostInfo(bool wait_for_criu) {
  v1::HostInfo info;
  info.set_hostname(options_.host_name);
  info.set_version(options_.version);
  for (v1::RdmaDevice& d : options_.list_devices()) *info.add_devices() = std::move(d);
  std::optional<absl::Status> criu;  // none: not checked yet
  if (wait_for_criu) {
    bool checked_now = false;
    {
      absl::MutexLock lock(&criu_mu_);
      if (!criu_checked_) {
        // `criu check` takes a while (3 to 15 s on a loaded TCG host); its
        // verdict does not change while we run.
        criu_status_ = criu_->Check();
        criu_checked_ = checked_now = true;
        if (!criu_status_.ok()) Log("CRIU does not work here: %s", criu_status_.ToString());
      }
      criu = criu_status_;
    }
    // The inventory lists the host as not checked yet until told.
    if (checked_now && options_.inventory != nullptr) options_.inventory->Refresh();
  } else if (criu_mu_.TryLock()) {
    if (criu_checked_) criu = criu_status_;
    criu_mu_.Unlock();
  }
  FillGuestNics(&info);
  info.set_criu_ok(criu.has_value() && criu->ok());
  if (!criu.has_value()) {
    info.set_criu_version("not checked yet");
  } else if (!criu->ok()) {
    // The first line says why; the log file it names has the rest.
    const absl::string_view why = criu->message();
    info.set_criu_version(absl::StrCat("unusable: ", why.substr(0, why.find('\n'))));
  }
  return info;
}

std::string Migrator::FirstActiveDeviceName() {
  v1::HostInfo info;
  for (v1::RdmaDevice& d : options_.list_devices()) *info.add_devices() = std::move(d);
  const v1::RdmaDevice* d = FirstActiveDevice(info);
  return d == nullptr ? "" : d->name();
}

absl::StatusOr<v1::Reply> Migrator::Command(pid_t pid, const v1::MigratorToShim& request,
                                            absl::Duration timeout, const char* what) {
  absl::StatusOr<v1::Reply> reply = shims_->Call(pid, request, timeout);
  if (!reply.ok()) return Annotate(reply.status(), absl::StrCat(what, " of process ", pid));
  if (reply->code() != 0)
    return absl::Status(static_cast<absl::StatusCode>(reply->code()),
                        absl::StrCat(what, " of process ", pid, ": ", reply->message()));
  return reply;
}

absl::StatusOr<v1::EndpointSummary> Migrator::Describe(pid_t pid) {
  v1::MigratorToShim req;
  req.mutable_describe();
  absl::StatusOr<v1::Reply> r = Command(pid, req, kDescribeTimeout, "describe");
  if (!r.ok()) return r.status();
  return r->summary();
}

// Every shim is asked at once: one slow to answer (its process stopped,
// its control thread busy) costs its own deadline, not one per shim; a
// peer's quiesce asks every shim of the host, inside the blackout.
std::vector<absl::StatusOr<v1::EndpointSummary>> Migrator::DescribeAll(
    const std::vector<ShimInfo>& shims) {
  constexpr size_t kAtOnce = 64;
  std::vector<absl::StatusOr<v1::EndpointSummary>> out(shims.size(),
                                                       absl::UnknownError("not asked"));
  for (size_t first = 0; first < shims.size(); first += kAtOnce) {
    std::vector<std::thread> asking;
    for (size_t i = first; i < shims.size() && i < first + kAtOnce; ++i)
      asking.emplace_back([this, &shims, &out, i] { out[i] = Describe(shims[i].pid); });
    for (std::thread& t : asking) t.join();
  }
  return out;
}

// A terminal cannot follow a process to another host, nor come back to a
// restore. A pseudo-terminal whose master side stays behind (a shell's,
// an ssh session's, script's) is replaced: CRIU (shell_job) gives the
// restored tree a new one in place of it, one only, made by
// rdmavirt-terminal (CriuDriver::Restore). A pseudo-terminal whose master
// side the tree holds too (an MPI daemon reads its ranks' output through
// one) is dumped and restored as a pair. Any other terminal is refused
// before anything is quiesced: CRIU cannot dump a process holding /dev/tty
// open, nor give back a console or a serial line.
std::vector<pid_t> Migrator::TreeOf(pid_t root) {
  std::vector<pid_t> tree = procs_->Descendants(root);
  tree.insert(tree.begin(), root);
  return tree;
}

absl::StatusOr<std::string> Migrator::TreeTerminal(pid_t pid) {
  const std::vector<pid_t> tree = TreeOf(pid);
  std::set<int> masters;
  for (pid_t p : tree) masters.merge(procs_->PtyMasters(p));
  std::string pty;
  for (pid_t p : tree) {
    for (const std::string& tty : procs_->Terminals(p, masters)) {
      const bool replaceable = absl::StartsWith(tty, "/dev/pts/");
      if (replaceable && (pty.empty() || pty == tty)) {
        pty = tty;
        continue;
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "process ", p, p == pid ? "" : absl::StrCat(" (a descendant of process ", pid, ")"),
          " holds the terminal ", tty,
          replaceable ? absl::StrCat(" besides ", pty, ", and a moved tree gets one new terminal")
                      : ", which cannot follow it (a pseudo-terminal can: it gets a new one)",
          "; nothing was quiesced. Start it without one: "
          "setsid PROGRAM < /dev/null > LOG 2>&1"));
    }
  }
  return pty;
}

absl::Status Migrator::CheckTreeDevices(pid_t root, const std::vector<pid_t>& endpoints) {
  for (pid_t p : TreeOf(root)) {
    const bool shimmed = std::find(endpoints.begin(), endpoints.end(), p) != endpoints.end();
    for (const std::string& file : procs_->DeviceFiles(p)) {
      // The shim releases its devices and its RDMA CM channels (their
      // kernel files; the program's fds are the shim's: shim/cm/cm.h),
      // and refuses at its quiesce an RDMA CM id a move cannot carry.
      if (shimmed &&
          (absl::StartsWith(file, "/dev/infiniband/uverbs") || file == "/dev/infiniband/rdma_cm"))
        continue;
      std::string why;
      if (file == "/dev/infiniband/rdma_cm")
        why =
            ", an RDMA CM channel (librdmacm) of a process not under the rdmavirt shim (or a "
            "descendant, which a checkpoint does not release), whose connections live in the "
            "kernel and cannot be checkpointed";
      else if (absl::StartsWith(file, "/dev/infiniband/uverbs"))
        why =
            ", an RDMA device of a process this step does not release (not under the rdmavirt "
            "shim, or a descendant, which a checkpoint does not release), which CRIU cannot dump";
      else
        why = ", a device CRIU cannot dump";
      return absl::FailedPreconditionError(absl::StrCat(
          "process ", p, p == root ? "" : absl::StrCat(" (a descendant of process ", root, ")"),
          " holds ", file, why, "; nothing was quiesced"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<pid_t>> Migrator::EndpointsOfTree(pid_t root) {
  const absl::Status own = CheckShim(root);
  if (!own.ok() && !absl::IsFailedPrecondition(own)) return own;
  std::set<pid_t> shimmed;
  for (const ShimInfo& s : shims_->Connected()) shimmed.insert(s.pid);
  std::vector<pid_t> found;
  if (own.ok()) found.push_back(root);
  for (pid_t d : procs_->Descendants(root))
    if (shimmed.contains(d)) found.push_back(d);
  if (found.empty()) return own;
  return found;
}

absl::Status Migrator::CheckShim(pid_t pid) {
  if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("invalid pid ", pid));
  for (const ShimInfo& s : shims_->Connected())
    if (s.pid == pid) return absl::OkStatus();
  if (!procs_->Exists(pid))
    return absl::NotFoundError(absl::StrCat("no process ", pid, " on ", options_.host_name));
  return absl::FailedPreconditionError(
      absl::StrCat("process ", pid,
                   " is not under the rdmavirt shim (it was not started with "
                   "LD_PRELOAD=librdmavirt.so while this migrator ran, or it has not opened an "
                   "RDMA device)"));
}

absl::StatusOr<v1::EndpointSummary> Migrator::BringBack(pid_t pid, const std::string& device,
                                                        const std::vector<v1::Mapping>& peers) {
  if (absl::Status st = shims_->SetResumeMarker(pid, true); !st.ok()) return st;
  absl::StatusOr<ShimInfo> hello =
      shims_->WaitHello(pid, v1::ENDPOINT_PHASE_RELEASED, options_.hello_timeout);
  (void)shims_->SetResumeMarker(pid, false);
  if (!hello.ok()) return hello.status();
  v1::MigratorToShim req;
  req.mutable_restore()->set_device(device);
  for (const v1::Mapping& m : peers) *req.mutable_restore()->add_peers() = m;
  absl::StatusOr<v1::Reply> r = Command(pid, req, options_.rpc_timeout, "restore");
  if (!r.ok()) return r.status();
  return r->summary();
}

std::vector<std::pair<pid_t, bool>> Migrator::LocalPeersOf(const std::string& vgid,
                                                           const std::set<uint32_t>& qpns,
                                                           bool with_ud, pid_t exclude) {
  std::vector<ShimInfo> running;
  for (const ShimInfo& s : shims_->Connected())
    if (s.pid != exclude && s.phase == v1::ENDPOINT_PHASE_RUNNING) running.push_back(s);
  const std::vector<absl::StatusOr<v1::EndpointSummary>> described = DescribeAll(running);
  std::vector<std::pair<pid_t, bool>> out;  // pid, suspended
  for (size_t i = 0; i < running.size(); ++i) {
    const ShimInfo& s = running[i];
    const absl::StatusOr<v1::EndpointSummary>& e = described[i];
    if (!e.ok()) {
      Log("peers: cannot describe process %d: %s", s.pid, e.status().ToString());
      continue;
    }
    if (!vgid.empty() && e->mapping().virtual_gid() == vgid) continue;  // the endpoint itself
    bool match = false;
    for (const v1::QpSummary& q : e->qps()) {
      if (with_ud && q.qp_type() == kQpTypeUd) match = true;
      if (!q.remote_virtual_gid().empty() && q.remote_virtual_gid() == vgid &&
          (qpns.empty() || qpns.contains(q.remote_virtual_qpn())))
        match = true;
    }
    if (match) out.emplace_back(s.pid, e->suspended());
  }
  return out;
}

namespace {

// The launchers and per-host daemons of MPI jobs: Open MPI's (ORTE's
// mpirun and orted, PRRTE's prterun and prted) and MPICH's Hydra
// (mpiexec.hydra, hydra_pmi_proxy). comm is cut at 15 characters.
bool IsJobDaemon(const std::string& comm) {
  static const std::set<std::string>* names =
      new std::set<std::string>{"orted",   "prted",         "hydra_pmi_proxy", "mpirun",
                                "mpiexec", "mpiexec.hydra", "orterun",         "prterun"};
  return names->contains(comm);
}

}  // namespace

pid_t Migrator::JobRoot(pid_t pid) {
  pid_t root = 0;
  std::set<pid_t> seen;
  for (pid_t p = procs_->Parent(pid); p > 1 && seen.insert(p).second; p = procs_->Parent(p))
    if (IsJobDaemon(procs_->Program(p))) root = p;
  return root;
}

std::vector<std::string> Migrator::TreeServiceAddresses(pid_t root) {
  absl::StatusOr<std::vector<ServiceAddress>> secondaries = addresses_->Secondaries();
  if (!secondaries.ok()) return {};
  std::vector<pid_t> tree = procs_->Descendants(root);
  tree.insert(tree.begin(), root);
  std::set<uint32_t> used;
  for (pid_t p : tree) used.merge(procs_->TcpAddresses(p));
  std::vector<std::string> out;
  for (const ServiceAddress& a : *secondaries)
    if (used.contains(a.addr)) out.push_back(a.Text());
  return out;
}

v1::ListEndpointsResponse Migrator::ListEndpoints() {
  v1::ListEndpointsResponse out;
  const std::vector<ShimInfo> shims = shims_->Connected();
  std::vector<absl::StatusOr<v1::EndpointSummary>> described = DescribeAll(shims);
  for (size_t i = 0; i < shims.size(); ++i) {
    const ShimInfo& s = shims[i];
    absl::StatusOr<v1::EndpointSummary>& e = described[i];
    if (e.ok()) {
      e->set_program(s.program);
      *out.add_endpoints() = *std::move(e);
      continue;
    }
    // Busy or gone: what its Hello said.
    v1::EndpointSummary* x = out.add_endpoints();
    x->set_pid(s.pid);
    x->set_endpoint_id(s.endpoint_id);
    x->set_phase(s.phase);
    x->set_program(s.program);
  }
  std::sort(out.mutable_endpoints()->begin(), out.mutable_endpoints()->end(),
            [](const auto& a, const auto& b) { return a.pid() < b.pid(); });
  std::map<pid_t, std::vector<std::string>> job_addresses;
  for (v1::EndpointSummary& e : *out.mutable_endpoints()) {
    const pid_t root = JobRoot(e.pid());
    if (root == 0) continue;
    e.set_job_root_pid(root);
    e.set_job_root_program(procs_->Program(root));
    auto [it, first] = job_addresses.try_emplace(root);
    if (first) it->second = TreeServiceAddresses(root);
    for (const std::string& a : it->second) e.add_job_addresses(a);
  }
  NameContainers(&out);
  return out;
}

void Migrator::NameContainers(v1::ListEndpointsResponse* list) {
  // Only a process in a pid namespace of its own can be in a container:
  // the runtime is asked only then.
  if (options_.containers == nullptr) return;
  bool any = false;
  for (const v1::EndpointSummary& e : list->endpoints())
    if (options_.containers->PidInside(e.pid()) != e.pid()) any = true;
  if (!any) return;
  absl::StatusOr<std::vector<ContainerInfo>> running = options_.containers->List();
  if (!running.ok()) {
    Log("listing the containers: %s", running.status().ToString());
    return;
  }
  for (const ContainerInfo& c : *running) {
    const std::vector<pid_t> tree = TreeOf(c.pid);
    for (v1::EndpointSummary& e : *list->mutable_endpoints()) {
      if (std::find(tree.begin(), tree.end(), e.pid()) == tree.end()) continue;
      e.set_container(c.name);
      for (const std::string& a : TreeServiceAddresses(c.pid)) e.add_addresses(a);
    }
  }
}

v1::StatusResponse Migrator::Status(bool all) {
  v1::StatusResponse out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, r] : in_flight_) *out.add_in_flight() = r;
    for (const auto& r : recent_) *out.add_recent() = r;
  }
  *out.mutable_host() = GetHostInfo();
  if (options_.inventory != nullptr) {
    out.set_inventory(options_.inventory->Describe());
    if (all) {
      absl::StatusOr<std::vector<v1::MoveClaim>> moves = options_.inventory->Moves();
      if (moves.ok())
        for (v1::MoveClaim& c : *moves) *out.add_cluster_moves() = std::move(c);
      else
        out.set_inventory(absl::StrCat(out.inventory(), " (", moves.status().message(), ")"));
    }
  }
  return out;
}

absl::StatusOr<v1::ListHostsResponse> Migrator::ListHosts() {
  if (options_.inventory == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat(options_.host_name, "'s migrator has no inventory (--inventory)"));
  absl::StatusOr<std::vector<v1::InventoryHost>> hosts = options_.inventory->Hosts();
  if (!hosts.ok()) return hosts.status();
  v1::ListHostsResponse out;
  for (v1::InventoryHost& h : *hosts) *out.add_hosts() = std::move(h);
  return out;
}

v1::InventoryHost Migrator::DescribeForInventory() {
  v1::InventoryHost h;
  h.set_name(options_.host_name);
  // At once, CRIU's verdict or not: the inventory puts the host again
  // once it has one, and a host without it takes no move meanwhile.
  *h.mutable_info() = GetHostInfo(/*wait_for_criu=*/false);
  uint32_t active = 0;
  for (const v1::RdmaDevice& d : h.info().devices())
    for (const v1::RdmaPort& p : d.ports()) active += p.state() == "ACTIVE";
  h.set_active_ports(active);
  return h;
}

// ---- peers of a moving endpoint on this host (Transfer) ------------------

absl::StatusOr<v1::QuiescePeersResponse> Migrator::QuiescePeers(
    const v1::QuiescePeersRequest& request) {
  if (request.virtual_gid().size() != 16)
    return absl::InvalidArgumentError("virtual_gid must be 16 bytes");
  const std::set<uint32_t> qpns(request.virtual_qpns().begin(), request.virtual_qpns().end());
  const uint32_t drain =
      request.drain_timeout_ms() ? request.drain_timeout_ms() : options_.drain_timeout_ms;
  const std::set<pid_t> tree(request.tree_pids().begin(), request.tree_pids().end());
  v1::QuiescePeersResponse out;
  for (const auto& [pid, suspended] :
       LocalPeersOf(request.virtual_gid(), qpns, /*with_ud=*/true, /*exclude=*/0)) {
    if (tree.contains(pid)) continue;
    {
      absl::MutexLock lock(&mu_);
      // Paused by this move already (asked again after a wait, AskToQuiesce,
      // or for a tree's further endpoint, HolderId): drained again below,
      // toward this endpoint, but not taken twice.
      auto ours = peer_sets_.find(request.migration_id());
      if (ours == peer_sets_.end() || !ours->second.contains(pid)) {
        // Restored and not resumed yet: its move has it.
        if (arriving_.contains(pid))
          return absl::AbortedError(
              absl::StrCat("process ", pid, " on ", options_.host_name, " is moving itself"));
        // Paused by one move at a time: that move's re-point resumes it,
        // and would resume it under this one too. Being quiesced for its
        // own move, it is that move's. (Who waits: AwaitHeld.)
        if (absl::Status st = AwaitHeld(pid, request.migration_id(),
                                        absl::StrCat("on ", options_.host_name, ", process "));
            !st.ok())
          return st;
        peer_sets_[request.migration_id()].insert(pid);
      }
    }
    v1::MigratorToShim req;
    req.mutable_peer_quiesce()->set_virtual_gid(request.virtual_gid());
    req.mutable_peer_quiesce()->set_drain_timeout_ms(drain);
    absl::StatusOr<v1::Reply> r =
        Command(pid, req, absl::Milliseconds(drain) + options_.rpc_timeout, "peer quiesce");
    if (!r.ok()) return Annotate(r.status(), options_.host_name);
    Log("migration %s: peer %d quiesced (%d sends drained)", request.migration_id(), pid,
        r->drained_sends());
    out.add_pids(pid);
  }
  return out;
}

absl::StatusOr<v1::ReconnectPeersResponse> Migrator::ReconnectPeers(
    const v1::ReconnectPeersRequest& request) {
  {
    // A restarted host re-points and resumes nothing before it has found
    // again what its previous run knew: the moves into it, the peers
    // among its shims. Asked again, it finds them; it would not, after.
    absl::MutexLock lock(&mu_);
    if (absl::Status st = AwaitRecovery(request.migration_id(), /*shims_too=*/true); !st.ok())
      return st;
  }
  const std::string key = request.SerializeAsString();
  std::shared_ptr<Answer> answer;
  {
    absl::MutexLock lock(&mu_);
    auto [it, first] = answers_.try_emplace(key, nullptr);
    if (!first) {
      answer = it->second;
      while (!answer->done) answered_.Wait(&mu_);
      return answer->result;
    }
    it->second = answer = std::make_shared<Answer>();
  }
  absl::StatusOr<v1::ReconnectPeersResponse> result = ReconnectHere(request);
  absl::MutexLock lock(&mu_);
  answer->result = result;
  answer->done = true;
  answered_.SignalAll();
  if (!result.ok()) {
    answers_.erase(key);
  } else {
    answered_in_order_.push_back(key);
    if (answered_in_order_.size() > kAnswersKept) {
      answers_.erase(answered_in_order_.front());
      answered_in_order_.pop_front();
    }
  }
  return result;
}

namespace {

// A MigrationRecord.addresses entry: "a.b.c.d/len@interface".
std::string AddressEntry(const ServiceAddress& a, const std::string& ifname) {
  return absl::StrCat(a.Text(), "@", ifname);
}

absl::Status ParseAddressEntry(const std::string& entry, ServiceAddress* a, std::string* ifname) {
  const size_t at = entry.rfind('@');
  if (at == std::string::npos || at + 1 == entry.size())
    return absl::DataLossError(absl::StrCat("bad address entry \"", entry, "\" in a record"));
  absl::StatusOr<ServiceAddress> parsed = ParseServiceAddress(entry.substr(0, at));
  if (!parsed.ok()) return absl::DataLossError(parsed.status().message());
  *a = *parsed;
  *ifname = entry.substr(at + 1);
  return absl::OkStatus();
}

}  // namespace

absl::Status Migrator::LocateAddresses(const v1::MigrateRequest& request,
                                       v1::MigrationRecord* rec) {
  for (const std::string& text : request.addresses()) {
    absl::StatusOr<ServiceAddress> a = ParseServiceAddress(text);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> holder = addresses_->Holder(&*a);
    if (!holder.ok()) {
      if (absl::IsNotFound(holder.status()))
        return absl::FailedPreconditionError(
            absl::StrCat("the service address ", text, " is not on ", options_.host_name,
                         ": it moves from the host that holds it"));
      return holder.status();
    }
    rec->add_addresses(AddressEntry(*a, *holder));
    rec->mutable_report()->add_addresses(a->Text());
  }
  return absl::OkStatus();
}

absl::Status Migrator::HomeAddresses(const v1::PrepareRequest& request, v1::MigrationRecord* rec) {
  for (const std::string& text : request.addresses()) {
    absl::StatusOr<ServiceAddress> a = ParseServiceAddress(text);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> home = addresses_->Home(*a);
    if (!home.ok())
      return absl::Status(home.status().code(), absl::StrCat("host ", options_.host_name,
                                                             " cannot take the service address ",
                                                             text, ": ", home.status().message()));
    rec->add_addresses(AddressEntry(*a, *home));
  }
  return absl::OkStatus();
}

absl::Status Migrator::AddAddresses(const v1::MigrationRecord& rec) {
  std::vector<std::pair<ServiceAddress, std::string>> added;
  absl::Status st;
  for (const std::string& entry : rec.addresses()) {
    ServiceAddress a;
    std::string ifname;
    st = ParseAddressEntry(entry, &a, &ifname);
    if (st.ok()) st = addresses_->Add(ifname, a);
    if (!st.ok()) break;
    added.emplace_back(a, ifname);
  }
  if (st.ok()) return st;
  std::string left;
  for (const auto& [a, ifname] : added)
    if (absl::Status undo = addresses_->Remove(ifname, a); !undo.ok())
      absl::StrAppend(&left, left.empty() ? "" : ", ", a.Text(), " (", undo.message(), ")");
  if (left.empty()) return st;
  return absl::Status(st.code(), absl::StrCat(st.message(),
                                              "; and these added ones could not be "
                                              "removed again: ",
                                              left));
}

absl::Status Migrator::RemoveAddresses(const v1::MigrationRecord& rec) {
  std::vector<std::string> errors;
  for (const std::string& entry : rec.addresses()) {
    ServiceAddress a;
    std::string ifname;
    absl::Status st = ParseAddressEntry(entry, &a, &ifname);
    if (st.ok()) st = addresses_->Remove(ifname, a);
    if (!st.ok()) errors.push_back(std::string(st.message()));
  }
  if (errors.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrJoin(errors, "; "));
}

}  // namespace rdmavirt::migrator
