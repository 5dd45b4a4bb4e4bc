// Guests: the two halves of moving or snapshotting a VM whose programs use
// RDMA (docs/vms.md).
//
// Guest side, run by the migrator inside the guest: Suspend quiesces each
// endpoint with its peers (wherever they are) and releases it, exactly as
// the first half of a process move does, but the process keeps running
// here: the guest's RDMA NIC can then be unplugged, or its memory
// snapshotted, with no device open. Resume is the second half of a
// rollback: each endpoint comes back on the device the guest has now (for
// a moved VM a NIC of the destination, so a new GID), its peers are
// re-pointed at it and everything resumes. The suspended moves live in
// memory, so they travel with the guest's memory through a live migration
// or a snapshot; their records in the state directory let a restarted
// migrator put the endpoints back (Recover).
//
// Host side: the NICs a host gives its RDMA guests, counted against its
// capacity; the libvirt hook reports starts and stops, the CLI asks for a
// NIC for a guest that moves in.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "migrator/host/inventory.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator.h"
#include "migrator/move/migrator_internal.h"
#include "migrator/move/record_store.h"

namespace rdmavirt::migrator {
namespace {

constexpr char kGuestNicsFile[] = "/guests.pb";

}  // namespace

void Migrator::LoadGuestNics() {
  std::ifstream in(options_.state_dir + kGuestNicsFile, std::ios::binary);
  if (!in) return;
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  absl::MutexLock lock(&guests_mu_);
  if (!guest_nics_.ParseFromString(data)) {
    Log("%s%s does not parse: starting with no guests", options_.state_dir, kGuestNicsFile);
    guest_nics_.Clear();
  }
}

// ---- guest side ------------------------------------------------------------

absl::StatusOr<v1::GuestReport> Migrator::Suspend(const v1::SuspendRequest& request) {
  const absl::Time start = absl::Now();
  absl::MutexLock serial(&suspend_mu_);
  absl::StatusOr<std::vector<pid_t>> pids = SuspendSet(request);
  if (!pids.ok()) return pids.status();
  if (absl::Status st = RefuseConnectedPair(*pids); !st.ok()) return st;
  {
    absl::MutexLock lock(&mu_);
    for (pid_t pid : *pids)
      if (moving_.contains(pid))
        return absl::FailedPreconditionError(absl::StrCat("process ", pid, " is moving"));
    for (pid_t pid : *pids) moving_.insert(pid);
  }
  v1::GuestReport out;
  const absl::Status failure = SuspendEach(*pids, &out);
  if (!failure.ok()) out.set_error(std::string(failure.message()));
  out.set_ok(failure.ok());
  out.set_elapsed_us(MicrosSince(start));
  if (!failure.ok()) return failure;
  return out;
}

absl::StatusOr<std::vector<pid_t>> Migrator::SuspendSet(const v1::SuspendRequest& request) {
  std::vector<pid_t> pids;
  if (request.pids_size() > 0) {
    for (int32_t pid : request.pids()) {
      if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("invalid pid ", pid));
      if (suspended_.contains(pid)) continue;
      if (absl::Status st = CheckShim(pid); !st.ok()) return st;
      pids.push_back(pid);
    }
  } else {
    for (const ShimInfo& s : shims_->Connected())
      if (s.phase == v1::ENDPOINT_PHASE_RUNNING && !suspended_.contains(s.pid))
        pids.push_back(s.pid);
  }
  std::sort(pids.begin(), pids.end());
  return pids;
}

absl::Status Migrator::RefuseConnectedPair(const std::vector<pid_t>& pids) {
  // Two endpoints of the set connected to each other would each be
  // re-pointed at the other's released QPs: refused, before anything.
  std::map<std::string, pid_t> by_gid;
  std::vector<v1::EndpointSummary> described;
  for (pid_t pid : pids) {
    absl::StatusOr<v1::EndpointSummary> e = Describe(pid);
    if (!e.ok()) return e.status();
    by_gid[e->mapping().virtual_gid()] = pid;
    described.push_back(*std::move(e));
  }
  for (size_t i = 0; i < pids.size(); ++i)
    for (const v1::QpSummary& q : described[i].qps()) {
      auto it = by_gid.find(q.remote_virtual_gid());
      if (it != by_gid.end() && it->second != pids[i])
        return absl::FailedPreconditionError(absl::StrCat(
            "processes ", pids[i], " and ", it->second,
            " are connected to each other on this host; suspending both is not supported"));
    }
  return absl::OkStatus();
}

absl::Status Migrator::SuspendEach(const std::vector<pid_t>& pids, v1::GuestReport* out) {
  absl::Status failure;
  std::vector<pid_t> done;
  for (pid_t pid : pids) {
    std::unique_ptr<Move> m = NewMove("suspend", pid, nullptr);
    m->rec.mutable_report()->set_destination("suspended");
    v1::EndpointSummary released;
    absl::Status st = QuiesceAndRelease(m.get(), &released);
    if (!st.ok()) {
      failure = st;
      RollBack(m.get(), st);
      *out->add_endpoints() = m->rec.report();
      absl::MutexLock lock(&mu_);
      moving_.erase(pid);
      break;
    }
    SetPhase(m.get(), "suspended");
    *out->add_endpoints() = m->rec.report();
    suspended_[pid] = std::move(m);
    done.push_back(pid);
    absl::MutexLock lock(&mu_);
    held_peers_[pid];
  }
  if (failure.ok()) return failure;
  // All or nothing: the ones suspended before the failure come back.
  for (pid_t pid : done) {
    std::unique_ptr<Move> m = std::move(suspended_[pid]);
    suspended_.erase(pid);
    {
      absl::MutexLock lock(&mu_);
      held_peers_.erase(pid);
    }
    RollBack(m.get(), absl::AbortedError(absl::StrCat("suspending process ", pids.back(),
                                                      " failed: ", failure.message())));
    absl::MutexLock lock(&mu_);
    moving_.erase(pid);
  }
  return failure;
}

void Migrator::ResumeOne(Move* m, const std::string& device, v1::MigrationReport* out) {
  const pid_t pid = m->rec.report().pid();
  v1::Breakdown* b = m->rec.mutable_report()->mutable_breakdown();
  SetPhase(m, "restore", device);
  const absl::Time r0 = absl::Now();
  std::vector<v1::Mapping> peers;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [vgid, mapping] : held_peers_[pid]) peers.push_back(mapping);
  }
  absl::StatusOr<v1::EndpointSummary> e = BringBack(pid, device, peers);
  if (!e.ok()) {
    // Still released: it stays suspended, and so do its peers.
    SetPhase(m, "suspended", absl::StrCat("restore failed: ", e.status().message()));
    *out = m->rec.report();
    out->set_ok(false);
    out->set_error(
        absl::StrCat("restoring process ", pid, " on ", device, ": ", e.status().message()));
    return;
  }
  b->set_rdma_restore_us(MicrosSince(r0));
  m->rec.set_released(false);
  {
    absl::MutexLock lock(&mu_);
    held_peers_.erase(pid);
  }
  *m->rec.mutable_new_mapping() = e->mapping();
  SetPhase(m, "reconnect");
  const absl::Time c0 = absl::Now();
  // The connections the suspend made went out of an address this host may
  // not have any more (a VM's NIC swapped): new ones.
  m->stubs.clear();
  uint32_t waiting = 0;
  absl::Status st = ReconnectAll(m, e->mapping(), false, &waiting);
  m->rec.mutable_report()->set_peers_waiting(waiting);
  if (waiting > 0) {
    // A peer is suspended too: it connects to this endpoint when it comes
    // back, and only then may this one post toward it (PeerReconnect lifts
    // the pause).
    Log("%s: process %d restored; paused until %u suspended peer(s) resume",
        m->rec.report().migration_id(), pid, waiting);
  } else {
    st = ResumeAfter(pid, st);
  }
  FinishReconnected(m, c0, st);
  *out = m->rec.report();
}

absl::StatusOr<v1::GuestReport> Migrator::Resume(const v1::ResumeRequest& request) {
  const absl::Time start = absl::Now();
  absl::MutexLock serial(&suspend_mu_);
  v1::GuestReport out;
  if (suspended_.empty()) {
    out.set_ok(true);
    return out;
  }
  const std::string device = request.device().empty() ? FirstActiveDeviceName() : request.device();
  if (device.empty())
    return absl::FailedPreconditionError(
        "no RDMA device with an active port on this host: the suspended endpoints stay "
        "suspended");
  std::vector<std::string> errors;
  for (auto it = suspended_.begin(); it != suspended_.end();) {
    v1::MigrationReport* r = out.add_endpoints();
    ResumeOne(it->second.get(), device, r);
    if (it->second->rec.done()) {
      absl::MutexLock lock(&mu_);
      moving_.erase(it->first);
      if (!r->ok()) errors.push_back(absl::StrCat("process ", it->first, ": ", r->error()));
      it = suspended_.erase(it);
    } else {
      errors.push_back(r->error());
      ++it;
    }
  }
  out.set_ok(errors.empty());
  out.set_error(absl::StrJoin(errors, "; "));
  out.set_elapsed_us(MicrosSince(start));
  return out;
}

// ---- host side ---------------------------------------------------------------

void Migrator::FillGuestNics(v1::HostInfo* info) {
  if (options_.guest_nic_bridge.empty()) return;
  v1::GuestNicPool* p = info->mutable_guest_nics();
  p->set_kind("bridge");
  p->set_source(options_.guest_nic_bridge);
  p->set_subnet(options_.guest_nic_first);
  p->set_capacity(options_.guest_nic_capacity);
  absl::MutexLock lock(&guests_mu_);
  p->set_in_use(guest_nics_.entries_size());
  for (const v1::GuestNicEntry& e : guest_nics_.entries())
    *(e.running() ? p->add_domains() : p->add_reserved()) = e.domain();
}

absl::Status Migrator::SaveGuestNics() {
  absl::Status st =
      WriteFileAtomically(options_.state_dir + kGuestNicsFile, guest_nics_.SerializeAsString());
  if (!st.ok()) Log("cannot save the guests' NICs: %s", st.ToString());
  return Annotate(st, "saving the guests' NICs");
}

absl::Status Migrator::GuestEvent(const v1::GuestEventRequest& request) {
  if (request.domain().empty()) return absl::InvalidArgumentError("no domain");
  absl::MutexLock lock(&guests_mu_);
  auto* entries = guest_nics_.mutable_entries();
  auto it = std::find_if(entries->begin(), entries->end(), [&](const v1::GuestNicEntry& e) {
    return e.domain() == request.domain();
  });
  // A guest that arrived (or went) is no move in flight any more.
  if (options_.inventory != nullptr && it != entries->end() && !it->running())
    (void)options_.inventory->Unclaim(absl::StrCat("guest/", request.domain()),
                                      absl::StrCat("nic-", it->mac()));
  if (request.event() == "started") {
    v1::GuestNicEntry* e = it != entries->end() ? &*it : guest_nics_.add_entries();
    e->set_domain(request.domain());
    if (!request.mac().empty()) e->set_mac(request.mac());
    e->set_running(true);
    Log("guest %s started%s", request.domain(),
        request.mac().empty() ? "" : absl::StrCat(" (RDMA NIC ", request.mac(), ")"));
  } else if (request.event() == "stopped") {
    if (it == entries->end()) return absl::OkStatus();
    entries->erase(it);
    Log("guest %s stopped", request.domain());
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown guest event \"", request.event(), "\" (started, stopped)"));
  }
  // Applied here either way (the guest did start or stop); a restarted
  // migrator would not know it.
  return SaveGuestNics();
}

namespace {

// QEMU's prefix: 0x52 is a locally administered unicast address.
std::string NewGuestMac() {
  static absl::Mutex gen_mu(absl::kConstInit);
  static absl::BitGen* gen ABSL_PT_GUARDED_BY(gen_mu) = new absl::BitGen;
  uint32_t r;
  {
    absl::MutexLock g(&gen_mu);
    r = absl::Uniform<uint32_t>(*gen, 0, 1u << 24);
  }
  return absl::StrFormat("52:54:00:%02x:%02x:%02x", r >> 16, (r >> 8) & 0xff, r & 0xff);
}

}  // namespace

std::string Migrator::FreeGuestAddress(const ServiceAddress& first,
                                       const std::set<std::string>& taken) const {
  ServiceAddress a = first;
  for (uint32_t i = 0; i < options_.guest_nic_capacity; ++i, ++a.addr) {
    if (!a.SameSubnet(first.addr)) break;
    if (!taken.contains(a.Text())) return a.Text();
  }
  return "";
}

absl::Status Migrator::ClaimGuestMove(const std::string& domain, const v1::GuestNic& nic) {
  // The move, for the cluster to see: a second move of the guest to
  // another host is refused there until this one is over.
  if (options_.inventory == nullptr) return absl::OkStatus();
  v1::MoveClaim claim;
  claim.set_subject(absl::StrCat("guest/", domain));
  claim.set_migration_id(absl::StrCat("nic-", nic.mac()));
  claim.set_kind("vm-migrate");
  claim.set_destination(options_.host_name);
  claim.set_source(options_.host_name);
  claim.set_started_at(absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()));
  return options_.inventory->Claim(claim);
}

absl::StatusOr<v1::GuestNic> Migrator::AllocateGuestNic(
    const v1::AllocateGuestNicRequest& request) {
  if (request.domain().empty()) return absl::InvalidArgumentError("no domain");
  if (options_.guest_nic_bridge.empty())
    return absl::FailedPreconditionError(
        absl::StrCat(options_.host_name, " has no RDMA NICs for guests"));
  absl::StatusOr<ServiceAddress> first = ParseServiceAddress(options_.guest_nic_first);
  if (!first.ok()) return Annotate(first.status(), "the guests' first address");
  absl::MutexLock lock(&guests_mu_);
  std::set<std::string> taken;
  const v1::GuestNicEntry* mine = nullptr;
  for (const v1::GuestNicEntry& e : guest_nics_.entries()) {
    taken.insert(e.address());
    if (e.domain() == request.domain()) mine = &e;
  }
  if (mine != nullptr && !mine->running() && !mine->address().empty()) {
    // Asked again (a retried move): the same NIC.
    v1::GuestNic nic;
    nic.set_mac(mine->mac());
    nic.set_address(mine->address());
    nic.set_interface_xml(GuestInterfaceXml(options_.guest_nic_bridge, mine->mac()));
    return nic;
  }
  if (mine != nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("guest ", request.domain(), " runs on ", options_.host_name, " already"));
  if (static_cast<uint32_t>(guest_nics_.entries_size()) >= options_.guest_nic_capacity)
    return absl::ResourceExhaustedError(absl::StrCat(options_.host_name, " runs ",
                                                     guest_nics_.entries_size(), " RDMA guests, ",
                                                     "its capacity"));
  const std::string text = FreeGuestAddress(*first, taken);
  if (text.empty())
    return absl::ResourceExhaustedError(
        absl::StrCat("no free guest address from ", options_.guest_nic_first));
  v1::GuestNic nic;
  nic.set_mac(NewGuestMac());
  nic.set_address(text);
  nic.set_interface_xml(GuestInterfaceXml(options_.guest_nic_bridge, nic.mac()));
  if (absl::Status st = ClaimGuestMove(request.domain(), nic); !st.ok()) return st;
  v1::GuestNicEntry* e = guest_nics_.add_entries();
  e->set_domain(request.domain());
  e->set_mac(nic.mac());
  e->set_address(nic.address());
  if (absl::Status st = SaveGuestNics(); !st.ok()) {
    // Not saved, not given: a restarted migrator would give it again.
    guest_nics_.mutable_entries()->RemoveLast();
    if (options_.inventory != nullptr)
      (void)options_.inventory->Unclaim(absl::StrCat("guest/", request.domain()),
                                        absl::StrCat("nic-", nic.mac()));
    return st;
  }
  Log("guest %s: NIC %s, address %s", request.domain(), nic.mac(), nic.address());
  return nic;
}

std::string GuestInterfaceXml(const std::string& bridge, const std::string& mac) {
  return absl::StrCat("<interface type='bridge'><source bridge='", bridge, "'/><mac address='", mac,
                      "'/><model type='virtio'/><alias name='", kGuestNicAlias, "'/></interface>");
}

}  // namespace rdmavirt::migrator
