#include "tests/migrator/fake_host.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace rdmavirt::migrator::testing {
namespace {

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

std::string Relative(const std::string& dir, const std::string& parent) {
  return std::filesystem::relative(parent, dir).string();
}

}  // namespace

std::string Gid(int n) {
  std::string g(16, '\0');
  g[10] = g[11] = static_cast<char>(0xff);
  g[12] = 10;
  g[15] = static_cast<char>(n);
  return g;
}

FakeHost::FakeHost(int n) : gid_(Gid(n)), n_(n) {
  HoldAddress("eth0", absl::StrCat("10.0.0.", n, "/24"));
}

void FakeHost::HoldAddress(const std::string& ifname, const std::string& address) {
  absl::StatusOr<ServiceAddress> a = ParseServiceAddress(address);
  absl::MutexLock lock(&mu_);
  if (a.ok()) addrs_[a->addr] = {ifname, a->prefix};
}

std::vector<std::string> FakeHost::Addresses() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [addr, where] : addrs_)
    out.push_back(absl::StrCat(ServiceAddress{addr, where.second}.Text(), "@", where.first));
  return out;
}

std::vector<std::string> FakeHost::Events() {
  absl::MutexLock lock(&mu_);
  return events_;
}

absl::StatusOr<std::string> FakeHost::Holder(ServiceAddress* a) {
  absl::MutexLock lock(&mu_);
  auto it = addrs_.find(a->addr);
  if (it == addrs_.end()) return absl::NotFoundError(absl::StrCat(a->Text(), " is not here"));
  a->prefix = it->second.second;
  return it->second.first;
}

absl::StatusOr<std::string> FakeHost::Home(const ServiceAddress& a) {
  absl::MutexLock lock(&mu_);
  if (addrs_.contains(a.addr)) return absl::AlreadyExistsError(absl::StrCat(a.Text(), " is here"));
  for (const auto& [addr, where] : addrs_)
    if (a.SameSubnet(addr)) return where.first;
  return absl::FailedPreconditionError(absl::StrCat("no interface on the subnet of ", a.Text()));
}

absl::Status FakeHost::Add(const std::string& ifname, const ServiceAddress& a) {
  absl::MutexLock lock(&mu_);
  if (!add_address_error.ok()) return add_address_error;
  addrs_[a.addr] = {ifname, a.prefix};
  events_.push_back(absl::StrCat("add ", a.Text(), "@", ifname));
  return absl::OkStatus();
}

absl::Status FakeHost::Remove(const std::string& ifname, const ServiceAddress& a) {
  absl::MutexLock lock(&mu_);
  addrs_.erase(a.addr);
  events_.push_back(absl::StrCat("remove ", a.Text(), "@", ifname));
  return absl::OkStatus();
}

absl::Status FakeHost::ForgetCachedRoutes() {
  absl::MutexLock lock(&mu_);
  ++routes_forgotten_;
  return absl::OkStatus();
}

void FakeHost::SetTcpAddress(pid_t pid, const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (plain_.contains(pid) && !eps_.contains(pid))
    plain_tcp_[pid] = address;
  else
    eps_[pid].tcp_address = address;
}

absl::StatusOr<std::vector<ServiceAddress>> FakeHost::Secondaries() {
  absl::MutexLock lock(&mu_);
  // All but the host's own 10.0.0.N.
  const uint32_t own = (10u << 24) | static_cast<uint32_t>(n_);
  std::vector<ServiceAddress> out;
  for (const auto& [addr, where] : addrs_)
    if (addr != own) out.push_back({addr, where.second});
  return out;
}

void FakeHost::SetProgram(pid_t pid, const std::string& comm) {
  absl::MutexLock lock(&mu_);
  programs_[pid] = comm;
}

pid_t FakeHost::Parent(pid_t pid) {
  absl::MutexLock lock(&mu_);
  for (const auto& [parent, child] : children_)
    if (child == pid) return parent;
  return (plain_.contains(pid) || eps_.contains(pid)) ? 1 : 0;
}

std::string FakeHost::Program(pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto it = programs_.find(pid);
  return it == programs_.end() ? "" : it->second;
}

std::set<uint32_t> FakeHost::TcpAddresses(pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto ep = eps_.find(pid);
  auto plain = plain_tcp_.find(pid);
  const std::string text = ep != eps_.end()            ? ep->second.tcp_address
                           : plain != plain_tcp_.end() ? plain->second
                                                       : "";
  absl::StatusOr<ServiceAddress> a = ParseServiceAddress(text);
  if (text.empty() || !a.ok()) return {};
  return {a->addr};
}

FakeEndpoint& FakeHost::Add(pid_t pid, const std::string& vgid, std::vector<FakeQp> qps) {
  absl::MutexLock lock(&mu_);
  FakeEndpoint& e = eps_[pid];
  e.pid = pid;
  e.endpoint_id = absl::StrCat("ep", pid);
  e.vgid = vgid;
  e.qps = std::move(qps);
  e.qpn_base = 100 * static_cast<uint32_t>(n_);
  return e;
}

FakeEndpoint FakeHost::Get(pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto it = eps_.find(pid);
  return it == eps_.end() ? FakeEndpoint{} : it->second;
}

void FakeHost::Fail(pid_t pid, const std::string& command, absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  eps_[pid].fail[command] = code;
}

void FakeHost::AddPlainProcess(pid_t pid) {
  absl::MutexLock lock(&mu_);
  plain_.insert(pid);
}

void FakeHost::AddChild(pid_t parent, pid_t child) {
  absl::MutexLock lock(&mu_);
  children_.emplace(parent, child);
}

std::vector<pid_t> FakeHost::Descendants(pid_t pid) {
  absl::MutexLock lock(&mu_);
  return DescendantsLocked(pid);
}

std::vector<pid_t> FakeHost::DescendantsLocked(pid_t pid) {
  std::vector<pid_t> out;
  for (size_t i = 0;; ++i) {
    const pid_t parent = i == 0 ? pid : out[i - 1];
    for (auto [it, end] = children_.equal_range(parent); it != end; ++it) out.push_back(it->second);
    if (i >= out.size()) break;
  }
  return out;
}

void FakeHost::ReusePid(pid_t pid) {
  absl::MutexLock lock(&mu_);
  eps_.erase(pid);
  plain_.insert(pid);
  ++incarnation_[pid];
}

void FakeHost::SetTerminal(pid_t pid, const std::string& tty) {
  absl::MutexLock lock(&mu_);
  terminals_[pid] = tty;
}

void FakeHost::AddPtyMaster(pid_t pid, int index) {
  absl::MutexLock lock(&mu_);
  pty_masters_[pid].insert(index);
}

void FakeHost::AddDeviceFile(pid_t pid, const std::string& path) {
  absl::MutexLock lock(&mu_);
  device_files_[pid].push_back(path);
}

std::vector<std::string> FakeHost::DeviceFiles(pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto it = device_files_.find(pid);
  return it == device_files_.end() ? std::vector<std::string>{} : it->second;
}

std::set<int> FakeHost::PtyMasters(pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto it = pty_masters_.find(pid);
  return it == pty_masters_.end() ? std::set<int>{} : it->second;
}

std::vector<std::string> FakeHost::Terminals(pid_t pid, const std::set<int>& masters_in_tree) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  auto it = terminals_.find(pid);
  if (it == terminals_.end()) return out;
  for (absl::string_view tty : absl::StrSplit(it->second, ',', absl::SkipEmpty())) {
    int index = -1;
    if (absl::SimpleAtoi(absl::StripPrefix(tty, "/dev/pts/"), &index) &&
        masters_in_tree.contains(index))
      continue;
    out.emplace_back(tty);
  }
  return out;
}

v1::EndpointSummary FakeHost::Summary(const FakeEndpoint& e) const {
  v1::EndpointSummary s;
  s.set_endpoint_id(e.endpoint_id);
  s.set_pid(e.pid);
  s.set_phase(e.released ? v1::ENDPOINT_PHASE_RELEASED : v1::ENDPOINT_PHASE_RUNNING);
  s.set_suspended(e.paused);
  s.mutable_counts()->set_qps(static_cast<uint32_t>(e.qps.size()));
  s.mutable_counts()->set_mrs(2);
  s.mutable_counts()->set_registered_bytes(1 << 20);
  s.mutable_mapping()->set_virtual_gid(e.vgid);
  if (!e.released) s.mutable_mapping()->set_physical_gid(gid_);
  uint32_t i = 0;
  for (const FakeQp& q : e.qps) {
    v1::QpSummary* x = s.add_qps();
    x->set_virtual_qpn(q.virtual_qpn);
    x->set_physical_qpn(e.released ? 0 : e.qpn_base + i);
    x->set_qp_type(q.type);
    x->set_remote_virtual_gid(q.remote_vgid);
    x->set_remote_virtual_qpn(q.remote_vqpn);
    x->set_remote_physical_gid(q.remote_pgid);
    if (!e.released) {
      v1::IdPair* p = s.mutable_mapping()->add_qpns();
      p->set_virtual_id(q.virtual_qpn);
      p->set_physical_id(e.qpn_base + i);
    }
    ++i;
  }
  for (const std::string& g : e.ud_peer_pgids) s.add_ud_peer_physical_gids(g);
  s.set_device(e.released ? "" : "fake0");
  return s;
}

void FakeHost::Tick() {
  for (auto& [pid, e] : eps_) {
    if (e.alive && !e.stopped && e.released && !e.connected && markers_.contains(pid)) {
      e.connected = true;
      e.hello_phase = v1::ENDPOINT_PHASE_RELEASED;
    }
  }
}

std::vector<ShimInfo> FakeHost::Connected() {
  absl::MutexLock lock(&mu_);
  std::vector<ShimInfo> out;
  for (const auto& [pid, e] : eps_)
    if (e.alive && e.connected) out.push_back({pid, e.endpoint_id, "app", e.hello_phase});
  return out;
}

void Rendezvous::Arrive() {
  absl::MutexLock lock(&mu);
  ++arrived;
  const auto all_here = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return arrived >= expected; };
  if (!mu.AwaitWithTimeout(absl::Condition(&all_here), absl::Seconds(5))) all_met = false;
}

namespace {

// The command's name as the endpoint's log and its injected faults say it
// ("" for none).
std::string CommandName(const v1::MigratorToShim& req) {
  switch (req.command_case()) {
    case v1::MigratorToShim::kQuiesce:
      return "quiesce";
    case v1::MigratorToShim::kRelease:
      return "release";
    case v1::MigratorToShim::kRestore:
      return "restore";
    case v1::MigratorToShim::kResume:
      return "resume";
    case v1::MigratorToShim::kPeerQuiesce:
      return "peer_quiesce";
    case v1::MigratorToShim::kPeerReconnect:
      return "peer_reconnect";
    case v1::MigratorToShim::kDescribe:
      return "describe";
    default:
      return "";
  }
}

}  // namespace

absl::StatusOr<v1::Reply> FakeHost::Call(pid_t pid, v1::MigratorToShim req, absl::Duration) {
  if (req.has_peer_reconnect() && reconnect_rendezvous != nullptr) reconnect_rendezvous->Arrive();
  if (req.has_describe() && describe_rendezvous != nullptr) describe_rendezvous->Arrive();
  absl::MutexLock lock(&mu_);
  auto it = eps_.find(pid);
  if (it == eps_.end() || !it->second.alive || !it->second.connected)
    return absl::NotFoundError(absl::StrCat("no shim of process ", pid, " is connected"));
  FakeEndpoint& e = it->second;
  const std::string cmd = CommandName(req);
  if (cmd.empty()) return absl::InvalidArgumentError("no command");
  e.log.push_back(cmd);
  v1::Reply r;
  auto fail = e.fail.find(cmd);
  if (fail != e.fail.end()) {
    r.set_code(static_cast<int>(fail->second));
    r.set_message(absl::StrCat("injected ", cmd, " failure"));
    // NOT_FOUND: the process ended as the command came (its shim gone).
    if (fail->second == absl::StatusCode::kNotFound) e.alive = e.connected = false;
  } else if (cmd == "quiesce" || cmd == "peer_quiesce") {
    if (e.released)
      r.set_code(9), r.set_message("released");
    else
      e.paused = true;
  } else if (cmd == "release") {
    if (!e.paused)
      r.set_code(9), r.set_message("release needs a quiesced endpoint");
    else
      e.released = true;
  } else if (cmd == "restore") {
    if (!e.released)
      r.set_code(9), r.set_message("restore needs a released endpoint");
    else {
      e.released = false;
      e.hello_phase = v1::ENDPOINT_PHASE_RUNNING;  // as ShimServer learns from the reply
      e.qpn_base += 10;                            // new physical identities, every time
      e.restored_with.assign(req.restore().peers().begin(), req.restore().peers().end());
      for (const v1::Mapping& m : req.restore().peers())
        for (FakeQp& q : e.qps)
          if (q.remote_vgid == m.virtual_gid()) q.remote_pgid = m.physical_gid();
    }
  } else if (cmd == "resume") {
    if (e.released)
      r.set_code(9), r.set_message("released");
    else
      e.paused = false;
  } else if (cmd == "peer_reconnect") {
    if (!e.paused || e.released)
      r.set_code(9), r.set_message("peer reconnect needs a paused endpoint");
    else {
      std::vector<v1::Mapping> all = {req.peer_reconnect().mapping()};
      all.insert(all.end(), req.peer_reconnect().more().begin(), req.peer_reconnect().more().end());
      for (const v1::Mapping& m : all) {
        e.reconnected_to.push_back(m);
        for (FakeQp& q : e.qps)
          if (q.remote_vgid == m.virtual_gid()) q.remote_pgid = m.physical_gid();
      }
      if (!req.peer_reconnect().keep_paused()) e.paused = false;
    }
  }
  *r.mutable_summary() = Summary(e);
  r.set_elapsed_us(5);
  // The shim closes its socket once it answered a release.
  if (cmd == "release" && r.code() == 0) e.connected = false;
  return r;
}

absl::Status FakeHost::WaitClosed(pid_t pid, absl::Duration) {
  absl::MutexLock lock(&mu_);
  auto it = eps_.find(pid);
  if (it != eps_.end() && it->second.alive && it->second.connected)
    return absl::DeadlineExceededError("still connected");
  return absl::OkStatus();
}

absl::StatusOr<ShimInfo> FakeHost::WaitHello(pid_t pid, v1::EndpointPhase phase,
                                             absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  struct Arg {
    FakeHost* h;
    pid_t pid;
    v1::EndpointPhase phase;
  } arg{this, pid, phase};
  const bool ok = mu_.AwaitWithTimeout(absl::Condition(
                                           +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                             auto it = a->h->eps_.find(a->pid);
                                             return it != a->h->eps_.end() && it->second.alive &&
                                                    it->second.connected &&
                                                    it->second.hello_phase == a->phase;
                                           },
                                           &arg),
                                       timeout);
  if (!ok) return absl::DeadlineExceededError(absl::StrCat("no Hello from ", pid));
  return ShimInfo{pid, eps_[pid].endpoint_id, "app", phase};
}

absl::Status FakeHost::SetResumeMarker(pid_t pid, bool present) {
  absl::MutexLock lock(&mu_);
  if (present)
    markers_.insert(pid);
  else
    markers_.erase(pid);
  Tick();
  return absl::OkStatus();
}

bool FakeHost::Exists(pid_t pid) {
  absl::MutexLock lock(&mu_);
  auto it = eps_.find(pid);
  return plain_.contains(pid) || (it != eps_.end() && it->second.alive);
}

std::string FakeHost::Identity(pid_t pid) {
  if (!Exists(pid)) return "";
  absl::MutexLock lock(&mu_);
  return absl::StrCat("h", n_, ":", pid, ":", incarnation_[pid]);
}

absl::Status FakeHost::Stop(pid_t pid) {
  absl::MutexLock lock(&mu_);
  std::vector<pid_t> tree = DescendantsLocked(pid);
  tree.push_back(pid);
  for (pid_t p : tree)
    if (eps_.contains(p) || !plain_.contains(p)) eps_[p].stopped = true;
  events_.push_back(absl::StrCat("stop ", pid));
  return absl::OkStatus();
}

absl::Status FakeHost::Continue(pid_t pid) {
  absl::MutexLock lock(&mu_);
  std::vector<pid_t> tree = DescendantsLocked(pid);
  tree.push_back(pid);
  for (pid_t p : tree)
    if (eps_.contains(p) || !plain_.contains(p)) eps_[p].stopped = false;
  events_.push_back(absl::StrCat("continue ", pid));
  Tick();
  return absl::OkStatus();
}

absl::Status FakeHost::Kill(pid_t pid) {
  absl::MutexLock lock(&mu_);
  events_.push_back(absl::StrCat("kill ", pid));
  if (!kill_error.ok()) return kill_error;
  std::vector<pid_t> tree = DescendantsLocked(pid);
  tree.push_back(pid);
  for (pid_t p : tree) {
    plain_.erase(p);
    auto it = eps_.find(p);
    if (it != eps_.end()) {
      it->second.alive = false;
      it->second.connected = false;
    }
  }
  return absl::OkStatus();
}

absl::Status FakeHost::Check() {
  if (check_entered != nullptr) check_entered->Notify();
  if (check_gate != nullptr) check_gate->WaitForNotification();
  return check_error;
}

absl::StatusOr<DumpStats> FakeHost::PreDump(pid_t pid, const std::string& dir,
                                            const std::string& parent) {
  absl::MutexLock lock(&mu_);
  ++predumps;
  if (!predump_error.ok()) return predump_error;
  if (!plain_.contains(pid) && (!eps_.contains(pid) || !eps_[pid].alive))
    return absl::NotFoundError("no such process");
  std::filesystem::create_directories(dir);
  const uint64_t bytes =
      predump_sizes.empty()
          ? predump_bytes
          : predump_sizes[std::min<size_t>(predumps - 1, predump_sizes.size() - 1)];
  WriteFile(dir + "/pages-1.img", std::string(bytes, 'p'));
  if (!parent.empty()) WriteFile(dir + "/parent.path", Relative(dir, parent) + "\n");
  return DumpStats{10, bytes};
}

absl::StatusOr<DumpStats> FakeHost::Dump(pid_t pid, const std::string& dir,
                                         const std::string& parent, bool leave_running,
                                         bool tcp_established) {
  absl::MutexLock lock(&mu_);
  ++dumps;
  if (!dump_error.ok()) return dump_error;
  // The tree's endpoints: its root first if it is one, then descendants.
  const std::vector<pid_t> below = DescendantsLocked(pid);
  std::vector<pid_t> eps;
  if (!plain_.contains(pid)) eps.push_back(pid);
  for (pid_t d : below)
    if (eps_.contains(d) && eps_[d].alive) eps.push_back(d);
  std::string tree;  // "parent child" lines, for the restore
  for (const auto& [parent, child] : children_)
    if (parent == pid || std::find(below.begin(), below.end(), parent) != below.end())
      absl::StrAppend(&tree, parent, " ", child, "\n");
  if (eps.empty()) return absl::NotFoundError("no such process");
  auto it = eps_.find(eps.front());
  if (it == eps_.end() || !it->second.alive) return absl::NotFoundError("no such process");
  for (pid_t e : eps)
    if (eps_[e].connected)
      return absl::FailedPreconditionError("Can't dump: the control socket is still open");
  events_.push_back(absl::StrCat("dump ", pid, tcp_established ? " tcp" : ""));
  if (!it->second.tcp_address.empty() && !tcp_established)
    return absl::FailedPreconditionError(
        "Connected TCP socket, consider using --tcp-established option");
  std::filesystem::create_directories(dir);
  WriteFile(dir + "/core.img", Summary(it->second).SerializeAsString());
  if (!tree.empty()) WriteFile(dir + "/tree.img", tree);
  for (size_t i = 1; i < eps.size(); ++i)
    WriteFile(absl::StrCat(dir, "/core-", eps[i], ".img"),
              Summary(eps_[eps[i]]).SerializeAsString());
  if (!it->second.tcp_address.empty()) WriteFile(dir + "/tcp.img", it->second.tcp_address);
  WriteFile(dir + "/pages-1.img", std::string(4096, 'f'));
  if (!parent.empty()) WriteFile(dir + "/parent.path", Relative(dir, parent) + "\n");
  if (!leave_running) {
    for (pid_t e : eps) eps_[e].alive = false;
    plain_.erase(pid);
  }
  return DumpStats{20, 8192};
}

// One endpoint of a restored tree, released and paused, as a restored
// shim is.
void FakeHost::RestoreEndpoint(const v1::EndpointSummary& s, const std::string& tcp_address) {
  const pid_t p = s.pid();
  ++incarnation_[p];  // a new process, given the old pid
  FakeEndpoint& e = eps_[p];
  auto fail = std::move(e.fail);  // faults set up for the restored process
  e = FakeEndpoint{};
  e.fail = std::move(fail);
  e.pid = p;
  e.tcp_address = tcp_address;
  e.endpoint_id = s.endpoint_id();
  e.vgid = s.mapping().virtual_gid();
  for (const v1::QpSummary& q : s.qps())
    e.qps.push_back({q.virtual_qpn(), q.qp_type(), q.remote_virtual_gid(), q.remote_virtual_qpn(),
                     q.remote_physical_gid()});
  e.qpn_base = 100 * static_cast<uint32_t>(n_) + 50 + static_cast<uint32_t>(p % 10) * 1000;
  e.released = true;
  e.paused = true;
  e.connected = false;
}

// The pages are "served" once `written` returns: the destination's fake
// restore takes none of them.
absl::StatusOr<DumpStats> FakeHost::LazyDump(
    pid_t pid, const std::string& dir, const std::string& parent, bool tcp_established,
    const LazyPages& serve, const std::function<void(const PostCopyHelper&)>& written) {
  absl::StatusOr<DumpStats> d = Dump(pid, dir, parent, /*leave_running=*/true, tcp_established);
  if (!d.ok()) return d;
  {
    absl::MutexLock lock(&mu_);
    events_.push_back(absl::StrCat("serve pages on ", serve.address, ":", serve.port));
  }
  written(PostCopyHelper{});  // none that outlives the migrator
  absl::MutexLock lock(&mu_);
  if (!lazy_serve_error.ok()) return lazy_serve_error;
  return d;
}

// The endpoints' pids (core.img, core-*.img) and the tree's (tree.img).
absl::StatusOr<std::vector<pid_t>> FakeHost::DumpedPids(const std::string& dir) {
  std::vector<pid_t> pids;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    if (name != "core.img" && name.rfind("core-", 0) != 0) continue;
    std::ifstream in(f.path(), std::ios::binary);
    std::stringstream buf;
    buf << in.rdbuf();
    v1::EndpointSummary s;
    if (!s.ParseFromString(buf.str())) return absl::DataLossError(absl::StrCat("bad ", name));
    pids.push_back(s.pid());
  }
  std::ifstream t(dir + "/tree.img");
  for (pid_t parent, child; t >> parent >> child;) pids.insert(pids.end(), {parent, child});
  return pids;
}

void FakeHost::CancelLazyDump(const LazyPages& serve) {
  absl::MutexLock lock(&mu_);
  events_.push_back(absl::StrCat("cancel pages on ", serve.address, ":", serve.port));
}

absl::StatusOr<pid_t> FakeHost::Restore(const std::string& dir, bool tcp_established,
                                        bool new_terminal, const LazyPages* lazy_from,
                                        PostCopyHelper* /*helper*/) {
  ++restores_started;
  while (stall_restore.load()) absl::SleepFor(absl::Milliseconds(1));
  absl::MutexLock lock(&mu_);
  ++restores;
  events_.push_back(absl::StrCat(
      "restore", tcp_established ? " tcp" : "", new_terminal ? " terminal" : "",
      lazy_from != nullptr ? absl::StrCat(" lazy from ", lazy_from->address, ":", lazy_from->port)
                           : ""));
  if (!restore_error.ok()) {
    if (failed_restore_leaves_process) {
      std::ifstream in(dir + "/core.img", std::ios::binary);
      std::stringstream buf;
      buf << in.rdbuf();
      v1::EndpointSummary s;
      if (s.ParseFromString(buf.str())) RestoreEndpoint(s, "");
    }
    return restore_error;
  }
  std::ifstream in(dir + "/core.img", std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  v1::EndpointSummary s;
  if (!in || !s.ParseFromString(buf.str())) return absl::DataLossError("no core.img");
  const std::string parent_path = dir + "/parent.path";
  if (std::filesystem::exists(parent_path)) {
    std::ifstream p(parent_path);
    std::string rel;
    std::getline(p, rel);
    if (!std::filesystem::exists(dir + "/" + rel + "/pages-1.img"))
      return absl::NotFoundError("parent images missing");
  }
  const pid_t pid = s.pid();
  if (eps_.contains(pid) && eps_[pid].alive) return absl::AlreadyExistsError("pid in use");
  std::string tcp_address;
  if (std::filesystem::exists(dir + "/tcp.img")) {
    std::ifstream t(dir + "/tcp.img");
    std::getline(t, tcp_address);
    absl::StatusOr<ServiceAddress> a = ParseServiceAddress(tcp_address);
    if (!tcp_established || !a.ok() || !addrs_.contains(a->addr))
      return absl::FailedPreconditionError(
          "Can't bind inet socket: Cannot assign requested address");
  }
  RestoreEndpoint(s, tcp_address);
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    if (name.rfind("core-", 0) != 0) continue;
    std::ifstream more(f.path(), std::ios::binary);
    std::stringstream b;
    b << more.rdbuf();
    v1::EndpointSummary other;
    if (!other.ParseFromString(b.str())) return absl::DataLossError(absl::StrCat("bad ", name));
    RestoreEndpoint(other, "");
  }
  // A tree: its plain processes and their links come back too; the root
  // (returned) is the one that is nobody's child.
  std::map<pid_t, pid_t> parent_of;
  std::ifstream t(dir + "/tree.img");
  for (pid_t parent, child; t >> parent >> child;) {
    parent_of[child] = parent;
    if (!eps_.contains(parent)) plain_.insert(parent);
    children_.emplace(parent, child);
  }
  pid_t root = pid;
  while (parent_of.contains(root)) root = parent_of[root];
  Tick();
  return root;
}

}  // namespace rdmavirt::migrator::testing
