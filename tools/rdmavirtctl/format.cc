#include "tools/rdmavirtctl/format.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace rdmavirt::ctl {
namespace {

std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    if (width.size() < r.size()) width.resize(r.size(), 0);
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string Phase(const v1::EndpointSummary& e) {
  std::string p = e.phase() == v1::ENDPOINT_PHASE_RELEASED  ? "released"
                  : e.phase() == v1::ENDPOINT_PHASE_RUNNING ? "running"
                                                            : "?";
  if (e.suspended() && e.phase() != v1::ENDPOINT_PHASE_RELEASED) p = "suspended";
  return p;
}

}  // namespace

std::string Bytes(uint64_t n) {
  if (n < 1024) return absl::StrCat(n, " B");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n) / 1024;
  int u = 0;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, units[u]);
}

std::string Micros(uint64_t us) {
  if (us < 1000) return absl::StrCat(us, " us");
  if (us < 1000000) return absl::StrFormat("%.1f ms", static_cast<double>(us) / 1000);
  return absl::StrFormat("%.2f s", static_cast<double>(us) / 1e6);
}

std::string EndpointTable(const v1::ListEndpointsResponse& list) {
  std::vector<std::vector<std::string>> rows = {
      {"PID", "PROGRAM", "CONTAINER", "ENDPOINT", "PHASE", "QPS", "MRS", "REG MEM", "CQ PENDING"}};
  for (const v1::EndpointSummary& e : list.endpoints()) {
    rows.push_back({absl::StrCat(e.pid()), e.program().empty() ? "-" : e.program(),
                    e.container().empty() ? "-" : e.container(), e.endpoint_id().substr(0, 12),
                    Phase(e), absl::StrCat(e.counts().qps()), absl::StrCat(e.counts().mrs()),
                    Bytes(e.counts().registered_bytes()),
                    absl::StrCat(e.counts().pending_completions())});
  }
  if (list.endpoints().empty()) return "no process on this host is under the rdmavirt shim\n";
  return Table(rows);
}

std::string HostText(const v1::HostInfo& h) {
  std::string out = absl::StrCat(h.hostname(), " (rdmavirt ", h.version(), ")\n");
  absl::StrAppend(&out, "  CRIU: ", h.criu_ok() ? "ok" : "NOT usable",
                  h.criu_version().empty() ? "" : absl::StrCat(" (", h.criu_version(), ")"), "\n");
  if (h.devices().empty()) absl::StrAppend(&out, "  no RDMA device\n");
  for (const v1::RdmaDevice& d : h.devices()) {
    absl::StrAppend(&out, "  ", d.name(), "  node_guid ", d.node_guid(), "  max_qp ", d.max_qp(),
                    "  max_mr ", d.max_mr(), "  max_cq ", d.max_cq(), "\n");
    for (const v1::RdmaPort& p : d.ports())
      absl::StrAppend(&out, "    port ", p.port_num(), ": ", p.state(), ", ", p.link_layer(),
                      p.gids().empty() ? "" : ", GIDs ", absl::StrJoin(p.gids(), " "), "\n");
  }
  return out;
}

std::string StatusText(const v1::StatusResponse& s) {
  std::string out = HostText(s.host());
  auto rows_of = [](const auto& reports) {
    std::vector<std::vector<std::string>> rows = {
        {"ID", "KIND", "PID", "RESULT", "BLACKOUT", "TOTAL", "DESTINATION", "ERROR"}};
    for (const v1::MigrationReport& r : reports) {
      const std::string result = r.ok() ? "ok" : r.rolled_back() ? "rolled back" : "failed";
      rows.push_back({r.migration_id(), r.kind(), absl::StrCat(r.pid()), result,
                      Micros(r.breakdown().blackout_us()), Micros(r.breakdown().total_us()),
                      r.destination(), r.error().substr(0, 60)});
    }
    return rows;
  };
  absl::StrAppend(&out, "\nin flight:", s.in_flight().empty() ? " none\n" : "\n");
  if (!s.in_flight().empty()) absl::StrAppend(&out, Table(rows_of(s.in_flight())));
  absl::StrAppend(&out, "\nrecent:", s.recent().empty() ? " none\n" : "\n");
  if (!s.recent().empty()) absl::StrAppend(&out, Table(rows_of(s.recent())));
  if (!s.inventory().empty()) absl::StrAppend(&out, "\ninventory: ", s.inventory(), "\n");
  if (s.cluster_moves_size() > 0) {
    std::vector<std::vector<std::string>> rows = {
        {"SUBJECT", "MIGRATION", "KIND", "PID", "SOURCE", "DESTINATION", "STARTED"}};
    for (const v1::MoveClaim& c : s.cluster_moves())
      rows.push_back({c.subject(), c.migration_id(), c.kind(), absl::StrCat(c.pid()), c.source(),
                      c.destination(), c.started_at()});
    absl::StrAppend(&out, "\nin flight in the cluster:\n", Table(rows));
  }
  return out;
}

std::string HostsTable(const v1::ListHostsResponse& hosts) {
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "MIGRATOR", "PORTS", "GIDS", "CRIU", "GUEST NICS", "LIBVIRT", "SINCE"}};
  for (const v1::InventoryHost& h : hosts.hosts()) {
    int gids = 0;
    for (const v1::RdmaDevice& d : h.info().devices())
      for (const v1::RdmaPort& p : d.ports()) gids += p.gids_size();
    const v1::GuestNicPool& g = h.info().guest_nics();
    rows.push_back({h.name(), h.address(), absl::StrCat(h.active_ports(), " active"),
                    absl::StrCat(gids), h.info().criu_ok() ? "ok" : "unusable",
                    h.info().has_guest_nics()
                        ? absl::StrCat(g.capacity() - g.in_use(), " free of ", g.capacity())
                        : "-",
                    h.libvirt_uri().empty() ? "-" : h.libvirt_uri(), h.registered_at()});
  }
  return Table(rows);
}

std::string ReportText(const v1::MigrationReport& r) {
  const v1::Breakdown& b = r.breakdown();
  std::string what;
  const std::string container =
      r.container().empty()
          ? ""
          : absl::StrCat("container ", r.container(), " (pid ", r.pid(), " under the shim)");
  if (!container.empty() && r.kind() == "migrate")
    what = absl::StrCat("migration of ", container, " from ", r.source(), " to ", r.destination());
  else if (!container.empty() && r.kind() == "checkpoint")
    what = absl::StrCat("checkpoint of ", container, " into ", r.destination());
  else if (r.kind() == "migrate")
    what = absl::StrCat("migration of pid ",
                        r.tree_root() ? absl::StrCat(r.tree_root(), " with its descendants (pid ",
                                                     r.pid(), " under the shim)")
                                      : absl::StrCat(r.pid()),
                        " from ", r.source(), " to ", r.destination());
  else if (r.kind() == "checkpoint")
    what = absl::StrCat("checkpoint of pid ", r.pid(), " into ", r.destination());
  else
    what = absl::StrCat("restore of ",
                        r.container().empty()
                            ? "endpoint "
                            : absl::StrCat("container ", r.container(), ", endpoint "),
                        r.endpoint_id().substr(0, 12), " on ", r.destination(),
                        r.pid() ? absl::StrCat(" as pid ", r.pid()) : "");
  std::string out;
  if (r.ok()) {
    absl::StrAppend(&out, what, ": done in ", Micros(b.total_us()), "\n");
  } else {
    absl::StrAppend(
        &out, what, ": FAILED after ", Micros(b.total_us()), "\n  error: ", r.error(), "\n  ",
        r.rolled_back() ? "rolled back: the process runs on the source again" : "not rolled back",
        "\n");
  }
  absl::StrAppend(&out, "  blackout ", Micros(b.blackout_us()),
                  " (peers and endpoint suspended)\n");
  std::vector<std::string> parts;
  auto add = [&](const char* name, uint64_t us) {
    if (us) parts.push_back(absl::StrCat(name, " ", Micros(us)));
  };
  add("pre-copy", b.precopy_us());
  add("quiesce", b.quiesce_us());
  add("drain", b.drain_us());
  add("release", b.release_us());
  add("final dump", b.final_dump_us());
  add("transfer", b.transfer_us());
  add("CRIU restore", b.criu_restore_us());
  add("RDMA restore", b.rdma_restore_us());
  add("reconnect", b.reconnect_us());
  if (!parts.empty()) absl::StrAppend(&out, "  breakdown: ", absl::StrJoin(parts, ", "), "\n");
  absl::StrAppend(&out, "  ", r.qps(), " QPs, ", r.mrs(), " MRs, ", Bytes(r.registered_bytes()),
                  " registered; ", r.peers(), " peer(s); ", Bytes(r.bytes_moved()), " moved",
                  r.precopy_iterations()
                      ? absl::StrCat("; ", r.precopy_iterations(), " pre-copy iteration(s)")
                      : "",
                  "\n");
  if (r.precopy_bytes_size() > 0 || r.final_bytes() > 0) {
    std::vector<std::string> rounds;
    for (uint64_t n : r.precopy_bytes()) rounds.push_back(Bytes(n));
    absl::StrAppend(
        &out, "  images sent: ",
        rounds.empty() ? "" : absl::StrCat("pre-copy ", absl::StrJoin(rounds, ", "), "; "),
        "final dump ", Bytes(r.final_bytes()), " (in the blackout)\n");
  }
  if (!r.addresses().empty())
    absl::StrAppend(&out, "  service addresses moved with it: ", absl::StrJoin(r.addresses(), ", "),
                    "\n");
  absl::StrAppend(&out, "  id ", r.migration_id(), "\n");
  return out;
}

std::string ProgressLine(const v1::Progress& p) {
  std::string line = absl::StrCat("[", p.phase(), "]");
  if (!p.detail().empty()) absl::StrAppend(&line, " ", p.detail());
  if (p.bytes_total() || p.bytes_done())
    absl::StrAppend(&line, " ", Bytes(p.bytes_done()),
                    p.bytes_total() ? absl::StrCat(" / ", Bytes(p.bytes_total())) : "");
  return line;
}

std::string GuestReportText(const v1::GuestReport& report) {
  std::string out;
  for (const v1::MigrationReport& e : report.endpoints()) {
    const v1::Breakdown& b = e.breakdown();
    if (!e.error().empty()) {
      absl::StrAppend(&out, "pid ", e.pid(), ": FAILED: ", e.error(),
                      e.rolled_back() ? " (put back)" : "", "\n");
    } else if (e.kind() == "suspend" && !e.ok()) {  // suspended, not finished
      absl::StrAppend(&out, "pid ", e.pid(), ": suspended, ", e.qps(), " QPs, ", e.mrs(), " MRs, ",
                      e.peers(), " peers; quiesce ", Micros(b.quiesce_us()), " (drain ",
                      Micros(b.drain_us()), "), release ", Micros(b.release_us()), "\n");
    } else {
      absl::StrAppend(&out, "pid ", e.pid(), ": resumed, blackout ", Micros(b.blackout_us()),
                      " (RDMA restore ", Micros(b.rdma_restore_us()), ", reconnect ",
                      Micros(b.reconnect_us()), ")\n");
    }
  }
  if (report.endpoints_size() == 0) out = "no endpoints\n";
  if (!report.ok() && !report.error().empty())
    absl::StrAppend(&out, "FAILED: ", report.error(), "\n");
  absl::StrAppend(&out, "in ", Micros(report.elapsed_us()), "\n");
  return out;
}

}  // namespace rdmavirt::ctl
