#include "tools/rdmavirtctl/vm_migrate.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "migrator/move/migrator.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/domain_xml.h"
#include "tools/rdmavirtctl/format.h"
#include "tools/rdmavirtctl/guest_agent.h"
#include "tools/rdmavirtctl/libvirt.h"

namespace rdmavirt::ctl {
namespace {

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

// One vm-migrate, step by step. Each step returns kOk to go on, else the
// exit code of the move (its failure already in the report).
class VmMove {
 public:
  VmMove(const VmOptions& o, v1::VmReport* rep)
      : o_(o), rep_(*rep), dest_migrator_(o.tls_dir, o.to_migrator) {
    rep_.set_kind("vm-migrate");
    rep_.set_domain(o.domain);
    rep_.set_source(o.connect);
    rep_.set_destination(o.to);
  }

  int Run() {
    // ---- checks: nothing is touched until both sides said yes.
    if (int rc = CheckDomain(); rc != kOk) return rc;
    if (int rc = FindRdmaNic(); rc != kOk) return rc;
    if (int rc = CheckDestination(); rc != kOk) return rc;
    if (int rc = AllocateNic(); rc != kOk) return rc;
    // Until the guest runs there, the NIC it holds is given back on failure.
    absl::Cleanup give_back = [this] {
      if (!moved_) GiveBackNic();
    };
    // ---- suspend, unplug
    if (int rc = Suspend(); rc != kOk) return rc;
    if (int rc = UnplugNic(); rc != kOk) return rc;
    // ---- migrate
    if (int rc = Migrate(); rc != kOk) return rc;
    // ---- plug, resume: the VM runs on the destination from here on.
    if (int rc = PlugNic(); rc != kOk) return rc;
    return Resume();
  }

 private:
  void Step(const std::string& what) {
    fprintf(stderr, "%s: %s\n", o_.domain.c_str(), what.c_str());
  }

  int Fail(const std::string& why, bool rolled_back) {
    rep_.set_ok(false);
    rep_.set_error(why);
    rep_.set_rolled_back(rolled_back);
    rep_.set_total_us(MicrosSince(start_));
    fprintf(stderr, "rdmavirtctl: vm-migrate %s: %s\n", o_.domain.c_str(), why.c_str());
    return kFailed;
  }

  // The domain runs here, is an RDMA guest and has no snapshots.
  int CheckDomain() {
    absl::StatusOr<Conn> src = Open(o_.connect);
    if (!src.ok()) return Fail(std::string(src.status().message()), false);
    src_ = *std::move(src);
    dom_.reset(lv->virDomainLookupByName(src_.get(), o_.domain.c_str()));
    if (dom_ == nullptr) return Fail(LibvirtError(absl::StrCat("domain ", o_.domain)), false);
    if (lv->virDomainIsActive(dom_.get()) != 1)
      return Fail(absl::StrCat("domain ", o_.domain, " is not running"), false);
    persistent_ = lv->virDomainIsPersistent(dom_.get()) == 1;
    if (const int n = lv->virDomainSnapshotNum(dom_.get(), 0); n > 0)
      return Fail(absl::StrCat("domain ", o_.domain, " has ", n,
                               " snapshot(s), and libvirt does not migrate a domain with "
                               "snapshots; delete them first (virsh snapshot-delete)"),
                  false);
    if (!IsRdmaGuest(dom_.get()))
      return Fail(
          absl::StrCat("domain ", o_.domain, " is not an RDMA guest (no <metadata> element in ",
                       kGuestMetadataUri, "); migrate it with virsh"),
          false);
    return kOk;
  }

  // Its RDMA NIC: on a bridge, with an address the guest agent reports.
  int FindRdmaNic() {
    absl::StatusOr<std::string> xml = DomainXml(dom_.get());
    if (!xml.ok()) return Fail(std::string(xml.status().message()), false);
    const std::string old_iface = InterfaceWithAlias(*xml, migrator::kGuestNicAlias);
    if (old_iface.empty())
      return Fail(absl::StrCat("domain ", o_.domain, " has no RDMA NIC (an <interface> with alias ",
                               migrator::kGuestNicAlias, ")"),
                  false);
    old_mac_ = ElementAttribute(old_iface, "mac", "address");
    old_bridge_ = ElementAttribute(old_iface, "source", "bridge");
    if (old_bridge_.empty())
      return Fail(absl::StrCat("the RDMA NIC of ", o_.domain,
                               " is not on a bridge (<interface type='bridge'>), the only kind "
                               "this version moves"),
                  false);
    old_addr_ = GuestAddress(dom_.get(), old_mac_);
    if (old_addr_.empty())
      return Fail(absl::StrCat("the guest agent of ", o_.domain,
                               " does not answer or the guest has no IPv4 address on its RDMA NIC ",
                               old_mac_),
                  false);
    rep_.set_old_nic(absl::StrCat(old_mac_, " ", old_addr_));
    return kOk;
  }

  // The destination's migrator answers and has RDMA NICs for guests; its
  // libvirt opens.
  int CheckDestination() {
    if (int rc = dest_migrator_.Connect(); rc != kOk) {
      rep_.set_error(absl::StrCat("the destination's rdmavirt-migratord (", o_.to_migrator,
                                  ") is unreachable; nothing was suspended"));
      return rc;
    }
    grpc::Status st = dest_migrator_.Call(&v1::Operator::Stub::GetHostInfo, v1::HostInfoRequest(),
                                          &dest_info_, 30);
    if (!st.ok())
      return Fail(absl::StrCat("the destination's migrator: ", st.error_message()), false);
    if (!dest_info_.has_guest_nics())
      return Fail(absl::StrCat("the destination ", dest_info_.hostname(),
                               " has no RDMA device for guests; nothing was suspended"),
                  false);
    absl::StatusOr<Conn> dst = Open(o_.to);
    if (!dst.ok())
      return Fail(absl::StrCat(dst.status().message(), "; nothing was suspended"), false);
    dst_ = *std::move(dst);
    return kOk;
  }

  // A NIC of the destination, held for the guest.
  int AllocateNic() {
    v1::AllocateGuestNicRequest req;
    req.set_domain(o_.domain);
    grpc::Status st = dest_migrator_.Call(&v1::Operator::Stub::AllocateGuestNic, req, &nic_, 30);
    if (!st.ok())
      return Fail(absl::StrCat("the destination ", dest_info_.hostname(), ": ", st.error_message(),
                               "; nothing was suspended"),
                  false);
    rep_.set_new_nic(absl::StrCat(nic_.mac(), " ", nic_.address()));
    return kOk;
  }

  void GiveBackNic() {
    v1::GuestEventRequest req;
    req.set_domain(o_.domain);
    req.set_event("stopped");
    v1::GuestEventResponse out;
    (void)dest_migrator_.Call(&v1::Operator::Stub::GuestEvent, req, &out, 10);
  }

  int Suspend() {
    Step("suspending its RDMA endpoints and their peers");
    const absl::Time t = absl::Now();
    absl::StatusOr<v1::GuestReport> suspended =
        GuestStep(dom_.get(), o_.guest_command, {"suspend", "--json"});
    rep_.set_suspend_us(MicrosSince(t));
    if (!suspended.ok())
      return Fail(absl::StrCat(suspended.status().message(),
                               " (the guest put back what it had "
                               "suspended)"),
                  true);
    *rep_.mutable_suspended() = *suspended;
    return kOk;
  }

  int UnplugNic() {
    Step(absl::StrCat("unplugging its RDMA NIC ", old_mac_));
    const absl::Time t = absl::Now();
    if (absl::Status st = Unplug(dom_.get(), migrator::kGuestNicAlias, absl::Seconds(60)); !st.ok())
      return ResumeHere(std::string(st.message()));
    unplugged_ = true;
    rep_.set_detach_us(MicrosSince(t));
    return kOk;
  }

  // The guest back on the source as it was: its NIC plugged again if it
  // was unplugged, its endpoints resumed on it.
  int ResumeHere(const std::string& cause) {
    Step(absl::StrCat("rolling back: ", cause));
    if (unplugged_) {
      if (absl::Status st =
              Plug(dom_.get(), migrator::GuestInterfaceXml(old_bridge_, old_mac_), false);
          !st.ok())
        return Fail(absl::StrCat(cause, " (rollback: ", st.message(),
                                 "; the guest's endpoints stay suspended)"),
                    false);
    }
    absl::StatusOr<v1::GuestReport> back =
        GuestStep(dom_.get(), o_.guest_command,
                  {"resume", "--nic", absl::StrCat(old_mac_, "=", old_addr_), "--json"});
    if (!back.ok())
      return Fail(absl::StrCat(cause, " (rollback: ", back.status().message(), ")"), false);
    *rep_.mutable_resumed() = *back;
    rep_.set_blackout_us(LongestBlackout(*back));
    return Fail(cause, true);
  }

  int Migrate() {
    Step(absl::StrCat("live-migrating to ", o_.to));
    const absl::Time t = absl::Now();
    virTypedParameterPtr params = nullptr;
    int nparams = 0, maxparams = 0;
    if (!o_.migrate_uri.empty())
      lv->virTypedParamsAddString(&params, &nparams, &maxparams, VIR_MIGRATE_PARAM_URI,
                                  o_.migrate_uri.c_str());
    unsigned flags = VIR_MIGRATE_LIVE;
    if (persistent_) flags |= VIR_MIGRATE_PERSIST_DEST | VIR_MIGRATE_UNDEFINE_SOURCE;
    if (o_.unsafe) flags |= VIR_MIGRATE_UNSAFE;
    ddom_.reset(lv->virDomainMigrate3(dom_.get(), dst_.get(), params, nparams, flags));
    lv->virTypedParamsFree(params, nparams);
    if (ddom_ == nullptr) return ResumeHere(LibvirtError("libvirt's migration"));
    rep_.set_migrate_us(MicrosSince(t));
    moved_ = true;
    return kOk;
  }

  int PlugNic() {
    Step(absl::StrCat("plugging a NIC of the destination: ", nic_.mac(), " ", nic_.address()));
    const absl::Time t = absl::Now();
    if (absl::Status st = Plug(ddom_.get(), nic_.interface_xml(), persistent_); !st.ok())
      return Fail(absl::StrCat(st.message(),
                               "; the guest runs on the destination with its endpoints "
                               "suspended: plug a NIC and run `",
                               o_.guest_command, " resume` in it"),
                  false);
    rep_.set_attach_us(MicrosSince(t));
    return kOk;
  }

  int Resume() {
    Step("resuming its RDMA endpoints; their peers reconnect");
    const absl::Time t = absl::Now();
    absl::StatusOr<v1::GuestReport> resumed =
        GuestStep(ddom_.get(), o_.guest_command,
                  {"resume", "--nic", absl::StrCat(nic_.mac(), "=", nic_.address()), "--json"});
    rep_.set_resume_us(MicrosSince(t));
    if (!resumed.ok())
      return Fail(absl::StrCat(resumed.status().message(),
                               "; the guest runs on the destination, its endpoints suspended"),
                  false);
    *rep_.mutable_resumed() = *resumed;
    rep_.set_blackout_us(LongestBlackout(*resumed));
    rep_.set_ok(resumed->ok());
    rep_.set_error(resumed->error());
    rep_.set_total_us(MicrosSince(start_));
    return rep_.ok() ? kOk : kFailed;
  }

  const VmOptions& o_;
  v1::VmReport& rep_;
  const absl::Time start_ = absl::Now();
  // Each domain before the connection it came from, so that it is freed
  // first.
  Conn src_;
  Domain dom_;
  bool persistent_ = false;
  std::string old_mac_, old_bridge_, old_addr_;
  Client dest_migrator_;
  v1::HostInfo dest_info_;
  Conn dst_;
  Domain ddom_;
  v1::GuestNic nic_;
  bool unplugged_ = false;
  bool moved_ = false;
};

}  // namespace

int VmMigrate(const VmOptions& o) {
  v1::VmReport rep;
  const int rc = RunVmMigrate(o, &rep);
  PrintReport(o, rep);
  return rc;
}

int RunVmMigrate(const VmOptions& o, v1::VmReport* out) { return VmMove(o, out).Run(); }

}  // namespace rdmavirt::ctl
