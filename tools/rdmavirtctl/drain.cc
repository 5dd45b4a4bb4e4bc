#include "tools/rdmavirtctl/drain.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "migrator/host/addresses.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/libvirt.h"

namespace rdmavirt::ctl {

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseHostsFile(
    absl::string_view text) {
  std::vector<std::pair<std::string, std::string>> out;
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.size() != 2 || !absl::StrContains(f[0], "://") || !migrator::ParseHostPort(f[1]).ok())
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", n, ": want \"LIBVIRT-URI MIGRATOR-HOST:PORT\", got \"", line, "\""));
    out.emplace_back(std::string(f[0]), std::string(f[1]));
  }
  if (out.empty()) return absl::InvalidArgumentError("no hosts listed");
  return out;
}

std::string PickProcessHost(const std::vector<v1::InventoryHost>& hosts, const std::string& self,
                            const std::set<std::string>& dead,
                            const std::map<std::string, int>& placed) {
  const v1::InventoryHost* best = nullptr;
  int best_count = 0;
  for (const v1::InventoryHost& h : hosts) {
    if (h.name() == self || dead.contains(h.name()) || h.address().empty()) continue;
    if (!h.info().criu_ok() || h.active_ports() == 0) continue;
    const auto it = placed.find(h.name());
    const int count = it == placed.end() ? 0 : it->second;
    if (best == nullptr || count < best_count || (count == best_count && h.name() < best->name())) {
      best = &h;
      best_count = count;
    }
  }
  return best == nullptr ? "" : best->address();
}

namespace {

// Free RDMA NICs for guests at a migrator; -1 when it cannot say.
int FreeGuestNics(const std::string& tls_dir, const std::string& target) {
  Client c(tls_dir, target);
  if (c.Connect() != kOk) return -1;
  v1::HostInfo info;
  if (!c.Call(&v1::Operator::Stub::GetHostInfo, v1::HostInfoRequest(), &info, 20).ok() ||
      !info.has_guest_nics())
    return -1;
  return static_cast<int>(info.guest_nics().capacity()) -
         static_cast<int>(info.guest_nics().in_use());
}

// The inventory's live hosts, as --host's migrator reads them.
absl::StatusOr<std::vector<v1::InventoryHost>> LiveHosts(Client* here) {
  v1::ListHostsResponse out;
  const grpc::Status st =
      here->Call(&v1::Operator::Stub::ListHosts, v1::ListHostsRequest(), &out, 30);
  if (!st.ok())
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  return std::vector<v1::InventoryHost>(out.hosts().begin(), out.hosts().end());
}

void PrintDrainReport(const DrainOptions& o, const v1::DrainReport& rep) {
  if (o.vm.json) {
    printf("%s\n", Json(rep).c_str());
    return;
  }
  for (const std::string& p : rep.plan())
    printf("%s%s\n", o.dry_run ? "would move " : "", p.c_str());
  if (o.dry_run) return;
  printf("drain: %d guests and %d processes moved, %d stayed\n",
         rep.vms_size() - static_cast<int>(std::count_if(rep.vms().begin(), rep.vms().end(),
                                                         [](const auto& v) { return !v.ok(); })),
         rep.processes_size() -
             static_cast<int>(std::count_if(rep.processes().begin(), rep.processes().end(),
                                            [](const auto& p) { return !p.ok(); })),
         rep.stayed_size());
  for (const std::string& s : rep.moved_by_another())
    printf("  moved by another move meanwhile: %s\n", s.c_str());
  for (const std::string& s : rep.stayed()) printf("  stayed: %s\n", s.c_str());
}

// One drain, step by step: what is here, then where each goes, guests
// first. A guest or process that cannot move stays, with the reason in the
// report; the drain goes on with the next.
class DrainRun {
 public:
  explicit DrainRun(const DrainOptions& o) : o_(o), here_(o.vm.tls_dir, o.host) {
    rep_.set_dry_run(o.dry_run);
  }

  int Run() {
    // ---- what is here (--connect none: a host without libvirt, processes only)
    if (int rc = ListGuests(); rc != kOk) return Finish(rc);
    if (here_.Connect() != kOk) return Finish(kUnreachable);
    if (int rc = ListProcesses(); rc != kOk) return Finish(rc);
    // ---- where each goes
    if (o_.from_inventory) {
      if (int rc = ReadInventory(); rc != kOk) return Finish(rc);
    }
    for (const std::string& g : guests_) MoveGuest(g);
    for (const Unit& u : Units()) MoveProcess(u);
    return Finish(kOk);
  }

 private:
  int Finish(int rc) {
    rep_.set_ok(rc == kOk && rep_.stayed_size() == 0);
    PrintDrainReport(o_, rep_);
    if (rc != kOk) return rc;
    return rep_.ok() ? kOk : kFailed;
  }

  // The running RDMA guests of this host's libvirt, by name.
  int ListGuests() {
    if (o_.vm.connect == "none") return kOk;
    absl::StatusOr<Conn> src = Open(o_.vm.connect);
    if (!src.ok()) {
      fprintf(stderr, "rdmavirtctl: drain: %s (--connect none drains processes only)\n",
              std::string(src.status().message()).c_str());
      return kUnreachable;
    }
    src_ = *std::move(src);
    virDomainPtr* doms = nullptr;
    const int n = lv->virConnectListAllDomains(src_.get(), &doms, VIR_CONNECT_LIST_DOMAINS_ACTIVE);
    for (int i = 0; i < n; ++i) {
      if (IsRdmaGuest(doms[i])) guests_.push_back(lv->virDomainGetName(doms[i]));
      lv->virDomainFree(doms[i]);
    }
    free(doms);
    std::sort(guests_.begin(), guests_.end());
    return kOk;
  }

  int ListProcesses() {
    v1::ListEndpointsResponse list;
    grpc::Status st =
        here_.Call(&v1::Operator::Stub::ListEndpoints, v1::ListEndpointsRequest(), &list);
    if (!st.ok()) return here_.Failed("drain: listing the processes", st);
    procs_.assign(list.endpoints().begin(), list.endpoints().end());
    return kOk;
  }

  // This host's name in the inventory, and the inventory's live hosts.
  int ReadInventory() {
    v1::HostInfo info;
    grpc::Status st = here_.Call(&v1::Operator::Stub::GetHostInfo, v1::HostInfoRequest(), &info);
    if (!st.ok()) return here_.Failed("drain: asking this host's name", st);
    self_ = info.hostname();
    return Refresh() ? kOk : kFailed;
  }

  // The inventory again, before each move: a host that died meanwhile is
  // gone from it once its lease expires.
  bool Refresh() {
    if (!o_.from_inventory) return true;
    absl::StatusOr<std::vector<v1::InventoryHost>> hosts = LiveHosts(&here_);
    if (!hosts.ok()) {
      fprintf(stderr, "rdmavirtctl: drain: the inventory: %s\n",
              std::string(hosts.status().message()).c_str());
      return false;
    }
    live_ = *std::move(hosts);
    return true;
  }

  std::vector<std::pair<std::string, std::string>> GuestCandidates() const {
    if (!o_.from_inventory) return o_.candidates;
    std::vector<std::pair<std::string, std::string>> c;
    for (const v1::InventoryHost& h : live_)
      if (h.name() != self_ && !dead_.contains(h.name()) && !h.libvirt_uri().empty())
        c.emplace_back(h.libvirt_uri(), h.address());
    return c;
  }

  // The destination of a guest: --to, or the candidate with the most free
  // RDMA NICs for guests; false when none has one.
  bool PickGuestHost(std::string* uri, std::string* migrator_target) const {
    if (!o_.vm.to.empty()) {
      *uri = o_.vm.to;
      *migrator_target = o_.vm.to_migrator;
      return true;
    }
    int best = 0;
    for (const auto& [u, m] : GuestCandidates()) {
      const int free_nics = FreeGuestNics(o_.vm.tls_dir, m);
      if (free_nics > best) {
        best = free_nics;
        *uri = u;
        *migrator_target = m;
      }
    }
    return best > 0;
  }

  void MoveGuest(const std::string& g) {
    std::string uri, m;
    if (!o_.dry_run) Refresh();
    if (!PickGuestHost(&uri, &m)) {
      rep_.add_stayed(absl::StrCat(g, ": no candidate host has a free RDMA NIC for guests"));
      return;
    }
    rep_.add_plan(absl::StrCat(g, " -> ", uri));
    if (o_.dry_run) return;
    fprintf(stderr, "drain: [%d/%zu] %s -> %s\n", rep_.vms_size() + 1, guests_.size(), g.c_str(),
            uri.c_str());
    VmOptions vo = o_.vm;
    vo.domain = g;
    vo.to = uri;
    vo.to_migrator = m;
    v1::VmReport* r = rep_.add_vms();
    if (RunVmMigrate(vo, r) != kOk || !r->ok()) rep_.add_stayed(absl::StrCat(g, ": ", r->error()));
  }

  // What moves as one: a process of no MPI job alone; the ranks of a job
  // with their launcher or daemon's tree (orted's, hydra_pmi_proxy's), by
  // its root, with the service addresses its TCP connections are on. A
  // rank moved alone would lose its daemon, its shared memory with the
  // other ranks of the host, and its connections to them. A container
  // whole, by its name, with the service addresses of its connections.
  struct Unit {
    int32_t pid;
    std::string what;  // "mpi_verify", "orted's job tree: ranks 501, 502"
    std::vector<std::string> addresses;
    std::string container;  // "" for a process tree
  };
  std::vector<Unit> Units() const {
    std::vector<Unit> out;
    std::map<int32_t, size_t> jobs;  // root -> index in out
    for (const v1::EndpointSummary& e : procs_) {
      if (!e.container().empty()) {
        out.push_back({e.pid(),
                       absl::StrCat("container ", e.container(), ": ", e.program()),
                       {e.addresses().begin(), e.addresses().end()},
                       e.container()});
        continue;
      }
      if (e.job_root_pid() == 0) {
        out.push_back({e.pid(), e.program(), {}, ""});
        continue;
      }
      auto [it, first] = jobs.try_emplace(e.job_root_pid(), out.size());
      if (first) {
        out.push_back({e.job_root_pid(),
                       absl::StrCat(e.job_root_program(), "'s job tree: ranks"),
                       {e.job_addresses().begin(), e.job_addresses().end()},
                       ""});
        absl::StrAppend(&out.back().what, " ", e.pid());
      } else {
        absl::StrAppend(&out[it->second].what, ", ", e.pid());
      }
    }
    for (Unit& u : out)
      if (!u.addresses.empty())
        absl::StrAppend(&u.what, "; with ", absl::StrJoin(u.addresses, ", "));
    return out;
  }

  std::string NameOf(const std::string& address) const {
    for (const v1::InventoryHost& h : live_)
      if (h.address() == address) return h.name();
    return address;
  }

  // The destination of a process: --to-migrator, the inventory's pick, or
  // the first candidate; "" if none.
  std::string ProcessHost() const {
    if (!o_.vm.to_migrator.empty()) return o_.vm.to_migrator;
    if (o_.from_inventory) return PickProcessHost(live_, self_, dead_, placed_);
    return o_.candidates.empty() ? "" : o_.candidates[0].second;
  }

  void MoveProcess(const Unit& e) {
    if (!o_.dry_run) Refresh();
    for (;;) {
      const std::string dest = ProcessHost();
      if (dest.empty()) {
        rep_.add_stayed(absl::StrCat("pid ", e.pid, ": no destination",
                                     o_.from_inventory ? " (no other live host can take it)" : ""));
        return;
      }
      rep_.add_plan(absl::StrCat("pid ", e.pid, " (", e.what, ") -> ", dest));
      ++placed_[NameOf(dest)];
      if (o_.dry_run) return;
      if (!CouldNotStartOn(e, dest)) return;
    }
  }

  // Moves `e` to `dest`, its outcome in the report. True when the
  // destination did not answer before anything was touched: it is not
  // picked again, and the process tries the next host. A process in the
  // middle of another move (an operator's, racing the drain) is asked for
  // again every 2 s until that move ends: moved away, it has left the host
  // (NOT_FOUND here), and it is listed as moved by another; rolled back, it
  // moves with the drain.
  bool CouldNotStartOn(const Unit& e, const std::string& dest) {
    fprintf(stderr, "drain: pid %d (%s) -> %s\n", e.pid, e.what.c_str(), dest.c_str());
    const absl::Time give_up = absl::Now() + kOtherMoveWait;
    v1::MigrationReport r;
    grpc::Status st;
    for (bool waited = false;; waited = true) {
      st = Ask(e, dest, &r);
      if (waited && st.error_code() == grpc::StatusCode::NOT_FOUND) {
        rep_.add_moved_by_another(absl::StrCat("pid ", e.pid, ": ", st.error_message()));
        fprintf(stderr, "drain: pid %d left this host with the other move\n", e.pid);
        return false;
      }
      if (st.error_code() != grpc::StatusCode::FAILED_PRECONDITION ||
          !absl::StrContains(st.error_message(), "is already moving") || absl::Now() >= give_up)
        break;
      if (!waited)
        fprintf(stderr, "drain: pid %d is in the middle of another move: waiting for its end\n",
                e.pid);
      absl::SleepFor(absl::Seconds(2));
    }
    *rep_.add_processes() = r;
    if (st.ok() && r.ok()) return false;
    if (o_.from_inventory && st.error_code() == grpc::StatusCode::UNAVAILABLE && !r.rolled_back()) {
      fprintf(stderr, "drain: %s cannot take it (%s); trying another host\n", dest.c_str(),
              st.error_message().c_str());
      dead_.insert(NameOf(dest));
      --placed_[NameOf(dest)];
      return true;
    }
    rep_.add_stayed(absl::StrCat("pid ", e.pid, ": ", st.ok() ? r.error() : st.error_message()));
    return false;
  }

  // One Migrate of `e` to `dest`: its status, and its report in `r`.
  grpc::Status Ask(const Unit& e, const std::string& dest, v1::MigrationReport* r) {
    grpc::ClientContext ctx;
    v1::MigrateRequest req;
    if (e.container.empty())
      req.set_pid(e.pid);
    else
      req.set_container(e.container);
    req.set_destination(dest);
    for (const std::string& a : e.addresses) req.add_addresses(a);
    if (o_.max_precopy >= 0) req.set_max_precopy_iterations(o_.max_precopy);
    std::unique_ptr<grpc::ClientReader<v1::Progress>> reader = here_.stub()->Migrate(&ctx, req);
    v1::Progress p;
    *r = v1::MigrationReport();
    while (reader->Read(&p))
      if (p.has_report()) *r = p.report();
    return reader->Finish();
  }

  // How long a process in the middle of another move is waited for: the
  // longest a move's transfer may take (the migrator's transfer_timeout).
  static constexpr absl::Duration kOtherMoveWait = absl::Minutes(30);

  const DrainOptions& o_;
  v1::DrainReport rep_;
  Conn src_;  // this host's libvirt, held for the drain
  std::vector<std::string> guests_;
  Client here_;
  std::vector<v1::EndpointSummary> procs_;
  std::string self_;            // this host's name in the inventory
  std::set<std::string> dead_;  // hosts a move could not start on
  std::map<std::string, int> placed_;
  std::vector<v1::InventoryHost> live_;
};

}  // namespace

int Drain(const DrainOptions& o) { return DrainRun(o).Run(); }

}  // namespace rdmavirt::ctl
