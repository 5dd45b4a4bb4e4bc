#include "tools/rdmavirtctl/vm.h"

#include <dlfcn.h>
#include <libvirt/libvirt-qemu.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "migrator/host/addresses.h"
#include "migrator/move/migrator.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/format.h"

namespace rdmavirt::ctl {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

uint64_t MicrosSince(absl::Time t) {
  return static_cast<uint64_t>(absl::ToInt64Microseconds(absl::Now() - t));
}

// libvirt's functions, looked up when the first VM command opens a
// connection (Open). rdmavirtctl is not linked with libvirt: its
// libraries (47 more, glib, gnutls and krb5 among them) made every
// command, VM or not, load them at start (68 million instructions before
// main against 26 million without, most of them symbol lookups; on a lab
// host, 0.50 to 0.70 s per `--help` against 0.66 to 1.0 s).
#define RDMAVIRT_LIBVIRT_FUNCTIONS(X)     \
  X(kCore, virConnectClose)               \
  X(kCore, virConnectListAllDomains)      \
  X(kCore, virConnectOpen)                \
  X(kCore, virDomainAttachDeviceFlags)    \
  X(kCore, virDomainDetachDeviceAlias)    \
  X(kCore, virDomainFree)                 \
  X(kCore, virDomainGetMetadata)          \
  X(kCore, virDomainGetName)              \
  X(kCore, virDomainGetXMLDesc)           \
  X(kCore, virDomainInterfaceAddresses)   \
  X(kCore, virDomainInterfaceFree)        \
  X(kCore, virDomainIsActive)             \
  X(kCore, virDomainIsPersistent)         \
  X(kCore, virDomainLookupByName)         \
  X(kCore, virDomainMigrate3)             \
  X(kCore, virDomainRevertToSnapshot)     \
  X(kCore, virDomainSnapshotCreateXML)    \
  X(kCore, virDomainSnapshotDelete)       \
  X(kCore, virDomainSnapshotFree)         \
  X(kCore, virDomainSnapshotGetXMLDesc)   \
  X(kCore, virDomainSnapshotLookupByName) \
  X(kCore, virDomainSnapshotNum)          \
  X(kCore, virGetLastErrorMessage)        \
  X(kCore, virSetErrorFunc)               \
  X(kCore, virTypedParamsAddString)       \
  X(kCore, virTypedParamsFree)            \
  X(kQemu, virDomainQemuAgentCommand)

// The libraries, by the index the list names them with: libvirt-qemu's
// one function drives the guest agent.
constexpr int kCore = 0;
constexpr int kQemu = 1;
constexpr const char* kLibvirtFiles[] = {"libvirt.so.0", "libvirt-qemu.so.0"};

struct Libvirt {
#define RDMAVIRT_LIBVIRT_FIELD(lib, name) decltype(&::name) name = nullptr;
  RDMAVIRT_LIBVIRT_FUNCTIONS(RDMAVIRT_LIBVIRT_FIELD)
#undef RDMAVIRT_LIBVIRT_FIELD
};
// Set by LoadLibvirt; every other use of libvirt follows a connection
// Open made.
const Libvirt* lv = nullptr;

// Loads both libraries (once per process) and looks their functions up.
absl::Status LoadLibvirt() {
  static const absl::Status loaded = []() -> absl::Status {
    void* handles[2];
    for (int i : {kCore, kQemu}) {
      handles[i] = dlopen(kLibvirtFiles[i], RTLD_NOW | RTLD_GLOBAL);
      if (handles[i] == nullptr)
        return absl::FailedPreconditionError(
            absl::StrCat("VM commands need libvirt (Debian: libvirt0): ", dlerror()));
    }
    static Libvirt api;
#define RDMAVIRT_LIBVIRT_FIND(lib, name)                                       \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(handles[lib], #name)); \
  if (api.name == nullptr)                                                     \
    return absl::FailedPreconditionError(absl::StrCat(kLibvirtFiles[lib], " has no ", #name));
    RDMAVIRT_LIBVIRT_FUNCTIONS(RDMAVIRT_LIBVIRT_FIND)
#undef RDMAVIRT_LIBVIRT_FIND
    lv = &api;
    return absl::OkStatus();
  }();
  return loaded;
}

std::string LibvirtError(absl::string_view what) {
  const char* m = lv->virGetLastErrorMessage();
  return absl::StrCat(what, ": ", m != nullptr ? m : "unknown libvirt error");
}

struct ConnDeleter {
  void operator()(virConnectPtr c) const { lv->virConnectClose(c); }
};
struct DomainDeleter {
  void operator()(virDomainPtr d) const { lv->virDomainFree(d); }
};
using Conn = std::unique_ptr<virConnect, ConnDeleter>;
using Domain = std::unique_ptr<virDomain, DomainDeleter>;

// libvirt prints every error to stderr unless told otherwise; ours are
// reported once, with their context (LibvirtError).
void QuietLibvirtError(void*, virErrorPtr) {}

absl::StatusOr<Conn> Open(const std::string& uri) {
  if (absl::Status st = LoadLibvirt(); !st.ok()) return st;
  static const bool quiet = (lv->virSetErrorFunc(nullptr, QuietLibvirtError), true);
  (void)quiet;
  Conn c(lv->virConnectOpen(uri.c_str()));
  if (c == nullptr) return absl::UnavailableError(LibvirtError(absl::StrCat("libvirt at ", uri)));
  return c;
}

absl::StatusOr<std::string> DomainXml(virDomainPtr d) {
  char* x = lv->virDomainGetXMLDesc(d, 0);
  if (x == nullptr) return absl::UnavailableError(LibvirtError("the domain's XML"));
  std::string out(x);
  free(x);
  return out;
}

std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// One command to the guest agent; its "return" value.
absl::StatusOr<Value> Agent(virDomainPtr d, const std::string& json, int timeout_s) {
  char* r = lv->virDomainQemuAgentCommand(d, json.c_str(), timeout_s, 0);
  if (r == nullptr) return absl::UnavailableError(LibvirtError("the guest agent"));
  std::string text(r);
  free(r);
  Struct reply;
  if (!google::protobuf::util::JsonStringToMessage(text, &reply).ok())
    return absl::InternalError(absl::StrCat("the guest agent answered ", text));
  auto it = reply.fields().find("return");
  if (it == reply.fields().end())
    return absl::InternalError(absl::StrCat("the guest agent answered ", text));
  return it->second;
}

struct ExecResult {
  int exitcode = -1;
  std::string out, err;
};

// Runs PATH ARGS in the guest (guest-exec) and waits for it to end.
absl::StatusOr<ExecResult> GuestExec(virDomainPtr d, const std::string& path,
                                     const std::vector<std::string>& args, absl::Duration timeout) {
  std::string argv;
  for (const std::string& a : args) absl::StrAppend(&argv, argv.empty() ? "" : ",", JsonQuote(a));
  absl::StatusOr<Value> started =
      Agent(d,
            absl::StrCat(R"({"execute":"guest-exec","arguments":{"path":)", JsonQuote(path),
                         R"(,"arg":[)", argv, R"(],"capture-output":true}})"),
            10);
  if (!started.ok()) return started.status();
  auto pid_it = started->struct_value().fields().find("pid");
  if (pid_it == started->struct_value().fields().end())
    return absl::InternalError("guest-exec gave no pid");
  const int pid = static_cast<int>(pid_it->second.number_value());
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<Value> st = Agent(
        d, absl::StrCat(R"({"execute":"guest-exec-status","arguments":{"pid":)", pid, "}}"), 10);
    if (!st.ok()) return st.status();
    const auto& f = st->struct_value().fields();
    auto exited = f.find("exited");
    if (exited != f.end() && exited->second.bool_value()) {
      ExecResult r;
      if (auto c = f.find("exitcode"); c != f.end()) r.exitcode = c->second.number_value();
      if (auto c = f.find("signal"); c != f.end())
        r.exitcode = 128 + static_cast<int>(c->second.number_value());
      if (auto o = f.find("out-data"); o != f.end())
        absl::Base64Unescape(o->second.string_value(), &r.out);
      if (auto e = f.find("err-data"); e != f.end())
        absl::Base64Unescape(e->second.string_value(), &r.err);
      return r;
    }
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(absl::StrCat(path, " in the guest did not finish within ",
                                                      absl::FormatDuration(timeout)));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// The guest-side command with --json; its GuestReport.
absl::StatusOr<v1::GuestReport> GuestStep(virDomainPtr d, const VmOptions& o,
                                          const std::vector<std::string>& args) {
  absl::StatusOr<ExecResult> r = GuestExec(d, o.guest_command, args, absl::Minutes(3));
  if (!r.ok()) return r.status();
  v1::GuestReport report;
  const bool parsed =
      !r->out.empty() && google::protobuf::util::JsonStringToMessage(r->out, &report).ok();
  if (r->exitcode != 0 || !parsed) {
    std::string why = r->err.empty() ? r->out : r->err;
    while (!why.empty() && why.back() == '\n') why.pop_back();
    if (parsed && !report.error().empty()) why = report.error();
    return absl::AbortedError(absl::StrCat("`", o.guest_command, " ", args[0],
                                           "` in the guest exited ", r->exitcode, ": ", why));
  }
  return report;
}

// The fabric address (a.b.c.d/len) the guest has on interface MAC, from
// its agent.
std::string GuestAddress(virDomainPtr d, const std::string& mac) {
  virDomainInterfacePtr* ifaces = nullptr;
  const int n =
      lv->virDomainInterfaceAddresses(d, &ifaces, VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT, 0);
  std::string out;
  for (int i = 0; i < n; ++i) {
    if (ifaces[i]->hwaddr != nullptr && absl::EqualsIgnoreCase(ifaces[i]->hwaddr, mac)) {
      for (unsigned j = 0; j < ifaces[i]->naddrs; ++j)
        if (ifaces[i]->addrs[j].type == VIR_IP_ADDR_TYPE_IPV4 && out.empty())
          out = absl::StrCat(ifaces[i]->addrs[j].addr, "/", ifaces[i]->addrs[j].prefix);
    }
    lv->virDomainInterfaceFree(ifaces[i]);
  }
  free(ifaces);
  return out;
}

// Unplugs the device with `alias` and waits until it is gone (the guest
// lets go of it asynchronously).
absl::Status Unplug(virDomainPtr d, const std::string& alias, absl::Duration timeout) {
  if (lv->virDomainDetachDeviceAlias(d, alias.c_str(), VIR_DOMAIN_AFFECT_LIVE) < 0)
    return absl::UnavailableError(LibvirtError("unplugging the RDMA NIC"));
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<std::string> x = DomainXml(d);
    if (!x.ok()) return x.status();
    if (InterfaceWithAlias(*x, alias).empty()) return absl::OkStatus();
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(absl::StrCat(
          "the guest did not let go of its RDMA NIC within ", absl::FormatDuration(timeout)));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

absl::Status Plug(virDomainPtr d, const std::string& xml, bool persistent) {
  unsigned flags = VIR_DOMAIN_AFFECT_LIVE;
  if (persistent) flags |= VIR_DOMAIN_AFFECT_CONFIG;
  if (lv->virDomainAttachDeviceFlags(d, xml.c_str(), flags) < 0)
    return absl::UnavailableError(LibvirtError("plugging the RDMA NIC"));
  return absl::OkStatus();
}

uint64_t LongestBlackout(const v1::GuestReport& r) {
  uint64_t m = 0;
  for (const v1::MigrationReport& e : r.endpoints())
    m = std::max<uint64_t>(m, e.breakdown().blackout_us());
  return m;
}

void PrintReport(const VmOptions& o, const v1::VmReport& r) {
  if (o.json) {
    printf("%s\n", Json(r).c_str());
    return;
  }
  printf("%s of %s %s%s\n", r.kind().c_str(), r.domain().c_str(),
         r.ok() ? "done" : (r.rolled_back() ? "FAILED, rolled back" : "FAILED"),
         r.ok() ? "" : absl::StrCat(": ", r.error()).c_str());
  printf("  %s -> %s\n", r.source().c_str(), r.destination().c_str());
  printf("  endpoints %d, RDMA blackout %s (the longest a peer waited)\n",
         r.suspended().endpoints_size(), Micros(r.blackout_us()).c_str());
  printf("  suspend %s, unplug %s, migrate %s, plug %s, resume %s, total %s\n",
         Micros(r.suspend_us()).c_str(), Micros(r.detach_us()).c_str(),
         Micros(r.migrate_us()).c_str(), Micros(r.attach_us()).c_str(),
         Micros(r.resume_us()).c_str(), Micros(r.total_us()).c_str());
  if (!r.old_nic().empty() || !r.new_nic().empty())
    printf("  RDMA NIC %s -> %s\n", r.old_nic().c_str(), r.new_nic().c_str());
}

void Step(const VmOptions& o, const std::string& what) {
  fprintf(stderr, "%s: %s\n", o.domain.c_str(), what.c_str());
}

}  // namespace

std::string UriHost(absl::string_view uri) {
  size_t p = uri.find("://");
  if (p == absl::string_view::npos) return "";
  absl::string_view rest = uri.substr(p + 3);
  rest = rest.substr(0, rest.find_first_of("/?"));
  if (size_t at = rest.find('@'); at != absl::string_view::npos) rest = rest.substr(at + 1);
  if (!rest.empty() && rest[0] != '[') rest = rest.substr(0, rest.find(':'));
  return std::string(rest);
}

std::string InterfaceWithAlias(absl::string_view xml, absl::string_view alias) {
  for (size_t from = 0;;) {
    const size_t start = xml.find("<interface ", from);
    if (start == absl::string_view::npos) return "";
    const size_t end = xml.find("</interface>", start);
    if (end == absl::string_view::npos) return "";
    absl::string_view block = xml.substr(start, end + 12 - start);
    if (absl::StrContains(block, absl::StrCat("<alias name='", alias, "'/>")) ||
        absl::StrContains(block, absl::StrCat("<alias name=\"", alias, "\"/>")))
      return std::string(block);
    from = end;
  }
}

std::string ElementAttribute(absl::string_view xml, absl::string_view tag, absl::string_view attr) {
  const size_t t = xml.find(absl::StrCat("<", tag, " "));
  if (t == absl::string_view::npos) return "";
  const size_t close = xml.find('>', t);
  absl::string_view el = xml.substr(t, close == absl::string_view::npos ? xml.npos : close - t);
  for (char q : {'\'', '"'}) {
    const std::string key = absl::StrCat(" ", attr, "=", std::string(1, q));
    const size_t a = el.find(key);
    if (a == absl::string_view::npos) continue;
    const size_t v = a + key.size();
    const size_t e = el.find(q, v);
    if (e != absl::string_view::npos) return std::string(el.substr(v, e - v));
  }
  return "";
}

int VmMigrate(const VmOptions& o) {
  v1::VmReport rep;
  const int rc = RunVmMigrate(o, &rep);
  PrintReport(o, rep);
  return rc;
}

int RunVmMigrate(const VmOptions& o, v1::VmReport* out) {
  const absl::Time start = absl::Now();
  v1::VmReport& rep = *out;
  rep.set_kind("vm-migrate");
  rep.set_domain(o.domain);
  rep.set_source(o.connect);
  rep.set_destination(o.to);
  auto fail = [&](const std::string& why, bool rolled_back) {
    rep.set_ok(false);
    rep.set_error(why);
    rep.set_rolled_back(rolled_back);
    rep.set_total_us(MicrosSince(start));
    fprintf(stderr, "rdmavirtctl: vm-migrate %s: %s\n", o.domain.c_str(), why.c_str());
    return kFailed;
  };

  // ---- checks: nothing is touched until both sides said yes.
  absl::StatusOr<Conn> src = Open(o.connect);
  if (!src.ok()) return fail(std::string(src.status().message()), false);
  Domain dom(lv->virDomainLookupByName(src->get(), o.domain.c_str()));
  if (dom == nullptr) return fail(LibvirtError(absl::StrCat("domain ", o.domain)), false);
  if (lv->virDomainIsActive(dom.get()) != 1)
    return fail(absl::StrCat("domain ", o.domain, " is not running"), false);
  const bool persistent = lv->virDomainIsPersistent(dom.get()) == 1;
  if (const int n = lv->virDomainSnapshotNum(dom.get(), 0); n > 0)
    return fail(absl::StrCat("domain ", o.domain, " has ", n,
                             " snapshot(s), and libvirt does not migrate a domain with "
                             "snapshots; delete them first (virsh snapshot-delete)"),
                false);
  char* meta = lv->virDomainGetMetadata(dom.get(), VIR_DOMAIN_METADATA_ELEMENT, kGuestMetadataUri,
                                        VIR_DOMAIN_AFFECT_LIVE);
  if (meta == nullptr)
    return fail(
        absl::StrCat("domain ", o.domain, " is not an RDMA guest (no <metadata> element in ",
                     kGuestMetadataUri, "); migrate it with virsh"),
        false);
  free(meta);
  absl::StatusOr<std::string> xml = DomainXml(dom.get());
  if (!xml.ok()) return fail(std::string(xml.status().message()), false);
  const std::string old_iface = InterfaceWithAlias(*xml, migrator::kGuestNicAlias);
  if (old_iface.empty())
    return fail(absl::StrCat("domain ", o.domain, " has no RDMA NIC (an <interface> with alias ",
                             migrator::kGuestNicAlias, ")"),
                false);
  const std::string old_mac = ElementAttribute(old_iface, "mac", "address");
  const std::string old_bridge = ElementAttribute(old_iface, "source", "bridge");
  if (old_bridge.empty())
    return fail(absl::StrCat("the RDMA NIC of ", o.domain,
                             " is not on a bridge (<interface type='bridge'>), the only kind "
                             "this version moves"),
                false);
  const std::string old_addr = GuestAddress(dom.get(), old_mac);
  if (old_addr.empty())
    return fail(
        absl::StrCat("the guest agent of ", o.domain,
                     " does not answer or the guest has no IPv4 address on its RDMA NIC ", old_mac),
        false);
  rep.set_old_nic(absl::StrCat(old_mac, " ", old_addr));

  Client dest_migrator(o.tls_dir, o.to_migrator);
  if (int rc = dest_migrator.Connect(); rc != kOk) {
    rep.set_error(absl::StrCat("the destination's rdmavirt-migratord (", o.to_migrator,
                               ") is unreachable; nothing was suspended"));
    return rc;
  }
  v1::HostInfo dest_info;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status st = dest_migrator.stub()->GetHostInfo(&ctx, v1::HostInfoRequest(), &dest_info);
    if (!st.ok())
      return fail(absl::StrCat("the destination's migrator: ", st.error_message()), false);
  }
  if (!dest_info.has_guest_nics())
    return fail(absl::StrCat("the destination ", dest_info.hostname(),
                             " has no RDMA device for guests; nothing was suspended"),
                false);
  absl::StatusOr<Conn> dst = Open(o.to);
  if (!dst.ok())
    return fail(absl::StrCat(dst.status().message(), "; nothing was suspended"), false);
  v1::GuestNic nic;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::AllocateGuestNicRequest req;
    req.set_domain(o.domain);
    grpc::Status st = dest_migrator.stub()->AllocateGuestNic(&ctx, req, &nic);
    if (!st.ok())
      return fail(absl::StrCat("the destination ", dest_info.hostname(), ": ", st.error_message(),
                               "; nothing was suspended"),
                  false);
  }
  rep.set_new_nic(absl::StrCat(nic.mac(), " ", nic.address()));
  // Until the guest runs there, the NIC it holds is given back on failure.
  bool moved = false;
  absl::Cleanup give_back = [&] {
    if (moved) return;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GuestEventRequest req;
    req.set_domain(o.domain);
    req.set_event("stopped");
    v1::GuestEventResponse out;
    (void)dest_migrator.stub()->GuestEvent(&ctx, req, &out);
  };

  // ---- suspend, unplug
  Step(o, "suspending its RDMA endpoints and their peers");
  absl::Time t = absl::Now();
  absl::StatusOr<v1::GuestReport> suspended = GuestStep(dom.get(), o, {"suspend", "--json"});
  rep.set_suspend_us(MicrosSince(t));
  if (!suspended.ok())
    return fail(absl::StrCat(suspended.status().message(),
                             " (the guest put back what it had "
                             "suspended)"),
                true);
  *rep.mutable_suspended() = *suspended;
  const std::string old_nic_arg = absl::StrCat(old_mac, "=", old_addr);
  bool unplugged = false;
  auto resume_here = [&](const std::string& cause) {
    Step(o, absl::StrCat("rolling back: ", cause));
    if (unplugged) {
      if (absl::Status st =
              Plug(dom.get(), migrator::GuestInterfaceXml(old_bridge, old_mac), false);
          !st.ok())
        return fail(absl::StrCat(cause, " (rollback: ", st.message(),
                                 "; the guest's endpoints stay suspended)"),
                    false);
    }
    absl::StatusOr<v1::GuestReport> back =
        GuestStep(dom.get(), o, {"resume", "--nic", old_nic_arg, "--json"});
    if (!back.ok())
      return fail(absl::StrCat(cause, " (rollback: ", back.status().message(), ")"), false);
    *rep.mutable_resumed() = *back;
    rep.set_blackout_us(LongestBlackout(*back));
    return fail(cause, true);
  };
  Step(o, absl::StrCat("unplugging its RDMA NIC ", old_mac));
  t = absl::Now();
  if (absl::Status st = Unplug(dom.get(), migrator::kGuestNicAlias, absl::Seconds(60)); !st.ok())
    return resume_here(std::string(st.message()));
  unplugged = true;
  rep.set_detach_us(MicrosSince(t));

  // ---- migrate
  Step(o, absl::StrCat("live-migrating to ", o.to));
  t = absl::Now();
  virTypedParameterPtr params = nullptr;
  int nparams = 0, maxparams = 0;
  if (!o.migrate_uri.empty())
    lv->virTypedParamsAddString(&params, &nparams, &maxparams, VIR_MIGRATE_PARAM_URI,
                                o.migrate_uri.c_str());
  unsigned flags = VIR_MIGRATE_LIVE;
  if (persistent) flags |= VIR_MIGRATE_PERSIST_DEST | VIR_MIGRATE_UNDEFINE_SOURCE;
  if (o.unsafe) flags |= VIR_MIGRATE_UNSAFE;
  Domain ddom(lv->virDomainMigrate3(dom.get(), dst->get(), params, nparams, flags));
  lv->virTypedParamsFree(params, nparams);
  if (ddom == nullptr) return resume_here(LibvirtError("libvirt's migration"));
  rep.set_migrate_us(MicrosSince(t));
  moved = true;

  // ---- plug, resume: the VM runs on the destination from here on.
  Step(o, absl::StrCat("plugging a NIC of the destination: ", nic.mac(), " ", nic.address()));
  t = absl::Now();
  if (absl::Status st = Plug(ddom.get(), nic.interface_xml(), persistent); !st.ok())
    return fail(absl::StrCat(st.message(),
                             "; the guest runs on the destination with its endpoints suspended: "
                             "plug a NIC and run `",
                             o.guest_command, " resume` in it"),
                false);
  rep.set_attach_us(MicrosSince(t));
  Step(o, "resuming its RDMA endpoints; their peers reconnect");
  t = absl::Now();
  absl::StatusOr<v1::GuestReport> resumed = GuestStep(
      ddom.get(), o, {"resume", "--nic", absl::StrCat(nic.mac(), "=", nic.address()), "--json"});
  rep.set_resume_us(MicrosSince(t));
  if (!resumed.ok())
    return fail(absl::StrCat(resumed.status().message(),
                             "; the guest runs on the destination, its endpoints suspended"),
                false);
  *rep.mutable_resumed() = *resumed;
  rep.set_blackout_us(LongestBlackout(*resumed));
  rep.set_ok(resumed->ok());
  rep.set_error(resumed->error());
  rep.set_total_us(MicrosSince(start));
  return rep.ok() ? kOk : kFailed;
}

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

namespace {

// Free RDMA NICs for guests at a migrator; -1 when it cannot say.
int FreeGuestNics(const std::string& tls_dir, const std::string& target) {
  Client c(tls_dir, target);
  if (c.Connect() != kOk) return -1;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::HostInfo info;
  if (!c.stub()->GetHostInfo(&ctx, v1::HostInfoRequest(), &info).ok() || !info.has_guest_nics())
    return -1;
  return static_cast<int>(info.guest_nics().capacity()) -
         static_cast<int>(info.guest_nics().in_use());
}

// The inventory's live hosts, as --host's migrator reads them.
absl::StatusOr<std::vector<v1::InventoryHost>> LiveHosts(Client* here) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListHostsResponse out;
  const grpc::Status st = here->stub()->ListHosts(&ctx, v1::ListHostsRequest(), &out);
  if (!st.ok())
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  return std::vector<v1::InventoryHost>(out.hosts().begin(), out.hosts().end());
}

}  // namespace

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

int Drain(const DrainOptions& o) {
  v1::DrainReport rep;
  rep.set_dry_run(o.dry_run);
  auto finish = [&](int rc) {
    rep.set_ok(rc == kOk && rep.stayed_size() == 0);
    if (o.vm.json) {
      printf("%s\n", Json(rep).c_str());
    } else {
      for (const std::string& p : rep.plan())
        printf("%s%s\n", o.dry_run ? "would move " : "", p.c_str());
      if (!o.dry_run) {
        printf(
            "drain: %d guests and %d processes moved, %d stayed\n",
            rep.vms_size() - static_cast<int>(std::count_if(rep.vms().begin(), rep.vms().end(),
                                                            [](const auto& v) { return !v.ok(); })),
            rep.processes_size() -
                static_cast<int>(std::count_if(rep.processes().begin(), rep.processes().end(),
                                               [](const auto& p) { return !p.ok(); })),
            rep.stayed_size());
        for (const std::string& s : rep.stayed()) printf("  stayed: %s\n", s.c_str());
      }
    }
    if (rc != kOk) return rc;
    return rep.ok() ? kOk : kFailed;
  };

  // ---- what is here (--connect none: a host without libvirt, processes only)
  std::vector<std::string> guests;
  absl::StatusOr<Conn> src = absl::NotFoundError("no libvirt");
  if (o.vm.connect != "none") {
    src = Open(o.vm.connect);
    if (!src.ok()) {
      fprintf(stderr, "rdmavirtctl: drain: %s (--connect none drains processes only)\n",
              std::string(src.status().message()).c_str());
      return finish(kUnreachable);
    }
  }
  virDomainPtr* doms = nullptr;
  const int n =
      src.ok() ? lv->virConnectListAllDomains(src->get(), &doms, VIR_CONNECT_LIST_DOMAINS_ACTIVE)
               : 0;
  for (int i = 0; i < n; ++i) {
    char* meta = lv->virDomainGetMetadata(doms[i], VIR_DOMAIN_METADATA_ELEMENT, kGuestMetadataUri,
                                          VIR_DOMAIN_AFFECT_LIVE);
    if (meta != nullptr) {
      guests.push_back(lv->virDomainGetName(doms[i]));
      free(meta);
    }
    lv->virDomainFree(doms[i]);
  }
  free(doms);
  std::sort(guests.begin(), guests.end());
  Client here(o.vm.tls_dir, o.host);
  std::vector<v1::EndpointSummary> procs;
  if (here.Connect() != kOk) return finish(kUnreachable);
  {
    grpc::ClientContext ctx;
    v1::ListEndpointsResponse list;
    grpc::Status st = here.stub()->ListEndpoints(&ctx, v1::ListEndpointsRequest(), &list);
    if (!st.ok()) return finish(here.Failed("drain: listing the processes", st));
    procs.assign(list.endpoints().begin(), list.endpoints().end());
  }

  // ---- where each goes
  std::string self;            // this host's name in the inventory
  std::set<std::string> dead;  // hosts a move could not start on
  std::map<std::string, int> placed;
  std::vector<v1::InventoryHost> live;
  // The inventory again, before each move: a host that died meanwhile is
  // gone from it once its lease expires.
  auto refresh = [&]() -> bool {
    if (!o.from_inventory) return true;
    absl::StatusOr<std::vector<v1::InventoryHost>> hosts = LiveHosts(&here);
    if (!hosts.ok()) {
      fprintf(stderr, "rdmavirtctl: drain: the inventory: %s\n",
              std::string(hosts.status().message()).c_str());
      return false;
    }
    live = *std::move(hosts);
    return true;
  };
  if (o.from_inventory) {
    grpc::ClientContext ctx;
    v1::HostInfo info;
    grpc::Status st = here.stub()->GetHostInfo(&ctx, v1::HostInfoRequest(), &info);
    if (!st.ok()) return finish(here.Failed("drain: asking this host's name", st));
    self = info.hostname();
    if (!refresh()) return finish(kFailed);
  }
  auto guest_candidates = [&] {
    if (!o.from_inventory) return o.candidates;
    std::vector<std::pair<std::string, std::string>> c;
    for (const v1::InventoryHost& h : live)
      if (h.name() != self && !dead.contains(h.name()) && !h.libvirt_uri().empty())
        c.emplace_back(h.libvirt_uri(), h.address());
    return c;
  };
  auto pick = [&](std::string* uri, std::string* migrator_target) -> bool {
    if (!o.vm.to.empty()) {
      *uri = o.vm.to;
      *migrator_target = o.vm.to_migrator;
      return true;
    }
    int best = 0;
    for (const auto& [u, m] : guest_candidates()) {
      const int free_nics = FreeGuestNics(o.vm.tls_dir, m);
      if (free_nics > best) {
        best = free_nics;
        *uri = u;
        *migrator_target = m;
      }
    }
    return best > 0;
  };
  for (const std::string& g : guests) {
    std::string uri, m;
    if (!o.dry_run) refresh();
    if (!pick(&uri, &m)) {
      rep.add_stayed(absl::StrCat(g, ": no candidate host has a free RDMA NIC for guests"));
      continue;
    }
    rep.add_plan(absl::StrCat(g, " -> ", uri));
    if (o.dry_run) continue;
    fprintf(stderr, "drain: [%d/%zu] %s -> %s\n", rep.vms_size() + 1, guests.size(), g.c_str(),
            uri.c_str());
    VmOptions vo = o.vm;
    vo.domain = g;
    vo.to = uri;
    vo.to_migrator = m;
    v1::VmReport* r = rep.add_vms();
    if (RunVmMigrate(vo, r) != kOk || !r->ok()) rep.add_stayed(absl::StrCat(g, ": ", r->error()));
  }
  auto name_of = [&](const std::string& address) {
    for (const v1::InventoryHost& h : live)
      if (h.address() == address) return h.name();
    return address;
  };
  auto process_host = [&]() -> std::string {
    if (!o.vm.to_migrator.empty()) return o.vm.to_migrator;
    if (o.from_inventory) return PickProcessHost(live, self, dead, placed);
    return o.candidates.empty() ? "" : o.candidates[0].second;
  };
  for (const v1::EndpointSummary& e : procs) {
    if (!o.dry_run) refresh();
    for (;;) {
      const std::string dest = process_host();
      if (dest.empty()) {
        rep.add_stayed(absl::StrCat("pid ", e.pid(), ": no destination",
                                    o.from_inventory ? " (no other live host can take it)" : ""));
        break;
      }
      rep.add_plan(absl::StrCat("pid ", e.pid(), " (", e.program(), ") -> ", dest));
      ++placed[name_of(dest)];
      if (o.dry_run) break;
      fprintf(stderr, "drain: pid %d (%s) -> %s\n", e.pid(), e.program().c_str(), dest.c_str());
      grpc::ClientContext ctx;
      v1::MigrateRequest req;
      req.set_pid(e.pid());
      req.set_destination(dest);
      std::unique_ptr<grpc::ClientReader<v1::Progress>> reader = here.stub()->Migrate(&ctx, req);
      v1::Progress p;
      v1::MigrationReport* r = rep.add_processes();
      while (reader->Read(&p))
        if (p.has_report()) *r = p.report();
      const grpc::Status st = reader->Finish();
      if (st.ok() && r->ok()) break;
      // The destination did not answer before anything was touched: it is
      // not picked again, and the process tries the next host.
      if (o.from_inventory && st.error_code() == grpc::StatusCode::UNAVAILABLE &&
          !r->rolled_back()) {
        fprintf(stderr, "drain: %s cannot take it (%s); trying another host\n", dest.c_str(),
                st.error_message().c_str());
        dead.insert(name_of(dest));
        --placed[name_of(dest)];
        continue;
      }
      rep.add_stayed(
          absl::StrCat("pid ", e.pid(), ": ", st.ok() ? r->error() : st.error_message()));
      break;
    }
  }
  return finish(kOk);
}

// ---- snapshot, revert ---------------------------------------------------------

namespace {

constexpr char kGroupHeader[] = "rdmavirt group:";

struct SnapshotDeleter {
  void operator()(virDomainSnapshotPtr s) const { lv->virDomainSnapshotFree(s); }
};
using Snap = std::unique_ptr<virDomainSnapshot, SnapshotDeleter>;

struct Member {
  std::string domain, uri;
  Conn conn;
  Domain dom;
  std::string Label() const { return absl::StrCat(domain, "@", uri); }
};

std::string XmlEscape(absl::string_view s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

// The text of the first element `tag` of `xml`, unescaped; "" if none.
std::string ElementText(absl::string_view xml, absl::string_view tag) {
  const std::string open = absl::StrCat("<", tag, ">"), close = absl::StrCat("</", tag, ">");
  const size_t a = xml.find(open);
  if (a == absl::string_view::npos) return "";
  const size_t b = xml.find(close, a + open.size());
  if (b == absl::string_view::npos) return "";
  return absl::StrReplaceAll(
      xml.substr(a + open.size(), b - a - open.size()),
      {{"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&apos;", "'"}, {"&amp;", "&"}});
}

// Opens each "DOMAIN[@URI]" of `labels` and finds its domain; with
// `running`, it must run and be an RDMA guest.
absl::Status OpenMembers(const std::vector<std::string>& labels, const std::string& default_uri,
                         bool running, std::vector<Member>* out) {
  for (const std::string& label : labels) {
    Member m;
    std::tie(m.domain, m.uri) = ParseMember(label, default_uri);
    if (m.domain.empty() || m.uri.empty())
      return absl::InvalidArgumentError(absl::StrCat("\"", label, "\" names no domain"));
    for (const Member& other : *out)
      if (other.Label() == m.Label())
        return absl::InvalidArgumentError(absl::StrCat(m.Label(), " is named twice"));
    absl::StatusOr<Conn> c = Open(m.uri);
    if (!c.ok()) return c.status();
    m.conn = *std::move(c);
    m.dom.reset(lv->virDomainLookupByName(m.conn.get(), m.domain.c_str()));
    if (m.dom == nullptr)
      return absl::NotFoundError(LibvirtError(absl::StrCat("domain ", m.domain, " at ", m.uri)));
    if (running) {
      if (lv->virDomainIsActive(m.dom.get()) != 1)
        return absl::FailedPreconditionError(absl::StrCat("domain ", m.domain, " is not running"));
      char* meta = lv->virDomainGetMetadata(m.dom.get(), VIR_DOMAIN_METADATA_ELEMENT,
                                            kGuestMetadataUri, VIR_DOMAIN_AFFECT_LIVE);
      if (meta == nullptr)
        return absl::FailedPreconditionError(
            absl::StrCat("domain ", m.domain, " is not an RDMA guest (no <metadata> element in ",
                         kGuestMetadataUri, "); snapshot it with virsh"));
      free(meta);
    }
    out->push_back(std::move(m));
  }
  return absl::OkStatus();
}

// Waits until the guest agent answers (after a revert the agent channel
// comes back with the guest).
absl::Status WaitAgent(virDomainPtr d, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<Value> r = Agent(d, R"({"execute":"guest-ping"})", 5);
    if (r.ok()) return absl::OkStatus();
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(absl::StrCat("the guest agent did not answer within ",
                                                      absl::FormatDuration(timeout), ": ",
                                                      r.status().message()));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

void PrintSnapshotReport(const SnapshotOptions& o, const v1::SnapshotReport& r) {
  if (o.vm.json) {
    printf("%s\n", Json(r).c_str());
    return;
  }
  printf("%s %s of %s %s%s\n", r.kind().c_str(), r.name().c_str(),
         r.members().empty() ? o.vm.domain.c_str() : absl::StrJoin(r.members(), ", ").c_str(),
         r.ok() ? "done" : (r.rolled_back() ? "FAILED, rolled back" : "FAILED"),
         r.ok() ? "" : absl::StrCat(": ", r.error()).c_str());
  int endpoints = 0;
  for (const v1::GuestReport& g : r.resumed()) endpoints += g.endpoints_size();
  printf("  endpoints %d, RDMA blackout %s (the longest a peer waited)\n", endpoints,
         Micros(r.blackout_us()).c_str());
  printf("  suspend %s, %s %s, resume %s, total %s\n", Micros(r.suspend_us()).c_str(),
         r.kind().c_str(), Micros(r.snapshot_us()).c_str(), Micros(r.resume_us()).c_str(),
         Micros(r.total_us()).c_str());
}

// Resumes the first `n` members, in order (a member whose peers are still
// suspended waits, paused, for them); "" or what failed.
std::string ResumeMembers(const SnapshotOptions& o, std::vector<Member>& members, size_t n,
                          v1::SnapshotReport* rep) {
  std::vector<std::string> errors;
  for (size_t i = 0; i < n; ++i) {
    fprintf(stderr, "%s: resuming its RDMA endpoints; their peers reconnect\n",
            members[i].domain.c_str());
    absl::StatusOr<v1::GuestReport> back =
        GuestStep(members[i].dom.get(), o.vm, {"resume", "--json"});
    if (!back.ok()) {
      errors.push_back(absl::StrCat(members[i].domain, ": ", back.status().message()));
      continue;
    }
    rep->set_blackout_us(std::max(rep->blackout_us(), LongestBlackout(*back)));
    *rep->add_resumed() = *std::move(back);
  }
  return absl::StrJoin(errors, "; ");
}

// A snapshot or revert under way: its report, printed once, at the end.
struct GroupRun {
  GroupRun(const SnapshotOptions& options, const char* kind) : o(options) {
    rep.set_kind(kind);
    rep.set_name(o.name);
  }
  int Fail(const std::string& why, bool rolled_back) {
    rep.set_ok(false);
    rep.set_error(why);
    rep.set_rolled_back(rolled_back);
    fprintf(stderr, "rdmavirtctl: %s %s: %s\n", rep.kind().c_str(), o.name.c_str(), why.c_str());
    return End(kFailed);
  }
  int Done() {
    rep.set_ok(true);
    return End(kOk);
  }
  int End(int rc) {
    rep.set_total_us(MicrosSince(start));
    PrintSnapshotReport(o, rep);
    return rc;
  }

  const SnapshotOptions& o;
  const absl::Time start = absl::Now();
  v1::SnapshotReport rep;
};

}  // namespace

std::pair<std::string, std::string> ParseMember(absl::string_view member,
                                                const std::string& default_uri) {
  const size_t at = member.find('@');
  if (at == absl::string_view::npos) return {std::string(member), default_uri};
  return {std::string(member.substr(0, at)), std::string(member.substr(at + 1))};
}

std::string GroupDescription(const std::vector<std::string>& members) {
  return absl::StrCat(kGroupHeader, "\n", absl::StrJoin(members, "\n"));
}

std::vector<std::string> GroupMembers(absl::string_view description) {
  std::vector<std::string> out;
  std::vector<absl::string_view> lines = absl::StrSplit(description, '\n');
  if (lines.empty() || absl::StripAsciiWhitespace(lines[0]) != kGroupHeader) return out;
  for (size_t i = 1; i < lines.size(); ++i) {
    absl::string_view l = absl::StripAsciiWhitespace(lines[i]);
    if (!l.empty()) out.emplace_back(l);
  }
  return out;
}

bool ValidSnapshotName(absl::string_view name) {
  if (name.empty() || name.size() > 200 || name[0] == '.' || name[0] == '-') return false;
  for (char c : name)
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-')
      return false;
  return true;
}

int Snapshot(const SnapshotOptions& o) {
  GroupRun run(o, "snapshot");
  v1::SnapshotReport& rep = run.rep;
  auto fail = [&](const std::string& why, bool rolled_back) { return run.Fail(why, rolled_back); };

  // ---- checks: every member runs, is an RDMA guest, has no snapshot NAME.
  std::vector<std::string> labels = {o.vm.domain};
  labels.insert(labels.end(), o.with.begin(), o.with.end());
  std::vector<Member> members;
  if (absl::Status st = OpenMembers(labels, o.vm.connect, true, &members); !st.ok())
    return fail(absl::StrCat(st.message(), "; nothing was suspended"), false);
  std::vector<std::string> names;
  for (const Member& m : members) {
    names.push_back(m.Label());
    rep.add_members(m.Label());
    Snap existing(lv->virDomainSnapshotLookupByName(m.dom.get(), o.name.c_str(), 0));
    if (existing != nullptr)
      return fail(
          absl::StrCat(m.domain, " already has a snapshot ", o.name, "; nothing was suspended"),
          false);
  }

  // ---- suspend every member: from here on nothing moves between them.
  absl::Time t = absl::Now();
  for (size_t i = 0; i < members.size(); ++i) {
    fprintf(stderr, "%s: suspending its RDMA endpoints and their peers\n",
            members[i].domain.c_str());
    absl::StatusOr<v1::GuestReport> s =
        GuestStep(members[i].dom.get(), o.vm, {"suspend", "--json"});
    if (!s.ok()) {
      const std::string back = ResumeMembers(o, members, i, &rep);
      return fail(absl::StrCat(s.status().message(), back.empty() ? "" : " (resuming: ", back,
                               back.empty() ? "" : ")"),
                  back.empty());
    }
    *rep.add_suspended() = *std::move(s);
  }
  rep.set_suspend_us(MicrosSince(t));

  // ---- one internal snapshot of each: memory and disks.
  t = absl::Now();
  const std::string xml =
      absl::StrCat("<domainsnapshot><name>", o.name, "</name><description>",
                   XmlEscape(GroupDescription(names)), "</description></domainsnapshot>");
  std::vector<Snap> taken;
  for (Member& m : members) {
    fprintf(stderr, "%s: taking snapshot %s (memory and disks)\n", m.domain.c_str(),
            o.name.c_str());
    Snap s(lv->virDomainSnapshotCreateXML(m.dom.get(), xml.c_str(), 0));
    if (s == nullptr) {
      const std::string cause = LibvirtError(absl::StrCat("snapshot of ", m.domain));
      for (Snap& done : taken) lv->virDomainSnapshotDelete(done.get(), 0);
      const std::string back = ResumeMembers(o, members, members.size(), &rep);
      return fail(
          absl::StrCat(cause, back.empty() ? "" : " (resuming: ", back, back.empty() ? "" : ")"),
          back.empty());
    }
    taken.push_back(std::move(s));
  }
  rep.set_snapshot_us(MicrosSince(t));

  // ---- resume: each reconnects to the others.
  t = absl::Now();
  const std::string back = ResumeMembers(o, members, members.size(), &rep);
  rep.set_resume_us(MicrosSince(t));
  if (!back.empty())
    return fail(absl::StrCat("the snapshots are taken, but resuming failed: ", back, "; run `",
                             o.vm.guest_command, " resume` in those guests"),
                false);
  return run.Done();
}

int Revert(const SnapshotOptions& o) {
  GroupRun run(o, "revert");
  v1::SnapshotReport& rep = run.rep;
  auto fail = [&](const std::string& why) { return run.Fail(why, false); };

  // ---- checks: the group the snapshot names, each member with its snapshot.
  std::vector<Member> first;
  if (absl::Status st = OpenMembers({o.vm.domain}, o.vm.connect, false, &first); !st.ok())
    return fail(absl::StrCat(st.message(), "; nothing was reverted"));
  Snap own(lv->virDomainSnapshotLookupByName(first[0].dom.get(), o.name.c_str(), 0));
  if (own == nullptr)
    return fail(LibvirtError(absl::StrCat("snapshot ", o.name, " of ", o.vm.domain)) +
                "; nothing was reverted");
  char* desc = lv->virDomainSnapshotGetXMLDesc(own.get(), 0);
  if (desc == nullptr) return fail(LibvirtError(absl::StrCat("snapshot ", o.name)));
  const std::vector<std::string> labels = GroupMembers(ElementText(desc, "description"));
  free(desc);
  if (labels.empty())
    return fail(absl::StrCat("snapshot ", o.name, " of ", o.vm.domain,
                             " was not taken by `rdmavirtctl snapshot`: its RDMA connections "
                             "were live in it and cannot come back; nothing was reverted"));
  // The member named on the command line is reached the way it was named.
  std::vector<std::string> others;
  bool found = false;
  for (const std::string& l : labels) {
    if (!found && ParseMember(l, "").first == o.vm.domain) {
      found = true;
      continue;
    }
    others.push_back(l);
  }
  std::vector<Member> members = std::move(first);
  if (absl::Status st = OpenMembers(others, o.vm.connect, false, &members); !st.ok())
    return fail(absl::StrCat("a member of the group: ", st.message(), "; nothing was reverted"));
  std::vector<Snap> snaps;
  for (const Member& m : members) {
    rep.add_members(m.Label());
    Snap s(lv->virDomainSnapshotLookupByName(m.dom.get(), o.name.c_str(), 0));
    if (s == nullptr)
      return fail(absl::StrCat(m.domain, " (", m.uri, ") has no snapshot ", o.name,
                               "; nothing was reverted"));
    snaps.push_back(std::move(s));
  }

  // ---- revert every member: its endpoints come back released, as taken.
  absl::Time t = absl::Now();
  for (size_t i = 0; i < members.size(); ++i) {
    fprintf(stderr, "%s: reverting to %s\n", members[i].domain.c_str(), o.name.c_str());
    if (lv->virDomainRevertToSnapshot(snaps[i].get(), VIR_DOMAIN_SNAPSHOT_REVERT_RUNNING) < 0) {
      std::string done;
      for (size_t j = 0; j < i; ++j) absl::StrAppend(&done, j ? ", " : "", members[j].domain);
      return fail(absl::StrCat(LibvirtError(absl::StrCat("reverting ", members[i].domain)),
                               done.empty() ? "; nothing was reverted"
                                            : absl::StrCat("; reverted already: ", done,
                                                           ", their endpoints suspended until "
                                                           "this revert is run again")));
    }
  }
  for (const Member& m : members)
    if (absl::Status st = WaitAgent(m.dom.get(), absl::Minutes(2)); !st.ok())
      return fail(absl::StrCat(m.domain, " reverted, but ", st.message()));
  rep.set_snapshot_us(MicrosSince(t));

  // ---- resume, in order: the last one back reconnects them all.
  t = absl::Now();
  const std::string back = ResumeMembers(o, members, members.size(), &rep);
  rep.set_resume_us(MicrosSince(t));
  if (!back.empty())
    return fail(absl::StrCat("reverted, but resuming failed: ", back, "; run `", o.vm.guest_command,
                             " resume` in those guests"));
  return run.Done();
}

}  // namespace rdmavirt::ctl
