// The VM workflows of rdmavirtctl, through the libvirt API (docs/vms.md).
// The guest side runs in the guest, reached through its guest agent: a
// command (rdmavirt-guest) that suspends or resumes every RDMA endpoint of
// the guest through the guest's own rdmavirt-migratord.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_VM_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_VM_H_

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rdmavirt/v1/migrator.pb.h"

namespace rdmavirt::ctl {

// The namespace of the <metadata> element that marks a domain as an RDMA
// guest (its NIC is the <interface> with alias migrator::kGuestNicAlias).
inline constexpr char kGuestMetadataUri[] = "urn:rdmavirt:guest:1";

struct VmOptions {
  std::string domain;
  std::string connect = "qemu:///system";  // the source's libvirt
  std::string tls_dir;
  bool json = false;
  // The guest-side command, a path inside the guest.
  std::string guest_command = "/usr/sbin/rdmavirt-guest";
  // vm-migrate
  std::string to;           // the destination's libvirt URI
  std::string to_migrator;  // its rdmavirt-migratord, HOST[:PORT]
  std::string migrate_uri;  // libvirt's VIR_MIGRATE_PARAM_URI, if set
  bool unsafe = false;
};

// Live-migrates an RDMA guest: guest endpoints suspended, its NIC
// unplugged, the VM migrated, a NIC of the destination plugged, the
// endpoints resumed there. A failure before the VM has moved puts it back
// as it was. Returns an exit code (cli.h).
int VmMigrate(const VmOptions& o);
// The same without printing the report: it goes to `report`.
int RunVmMigrate(const VmOptions& o, v1::VmReport* report);

// Moves every RDMA guest of --connect's libvirt and every process under the
// shim on `host` (its migrator, HOST:PORT) off this host: to o.to (and
// o.to_migrator), or with `candidates` ("URI MIGRATOR" each) to the one with
// the most free RDMA NICs for each guest. `dry_run` only says what it would
// do. Exit code: kOk when nothing stayed.
struct DrainOptions {
  VmOptions vm;
  std::string host;
  std::vector<std::pair<std::string, std::string>> candidates;
  // Candidates from the inventory of `host`'s migrator, read again before
  // each move: only live hosts are picked.
  bool from_inventory = false;
  bool dry_run = false;
};
int Drain(const DrainOptions& o);
// Where a drained process goes: of the inventory's live `hosts`, one that is
// not `self`, not in `dead` (a move to it could not start), and can take a
// process (CRIU works, an RDMA port is active), with the fewest of the
// drain's processes so far (`placed`, by name), by name on a tie. Its
// migrator's address; "" if none.
std::string PickProcessHost(const std::vector<v1::InventoryHost>& hosts, const std::string& self,
                            const std::set<std::string>& dead,
                            const std::map<std::string, int>& placed);

// "URI MIGRATOR" lines of a hosts file (# comments); INVALID_ARGUMENT saying
// which line is wrong.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseHostsFile(
    absl::string_view text);

// Snapshots of RDMA guests whose endpoints talk to each other, taken
// together at one cut: every member's endpoints (and their peers) suspended,
// an internal snapshot NAME of each member (memory and disks: its disks must
// be qcow2), every member resumed. A failure deletes the snapshots taken and
// resumes every member. The snapshot's description names the group, so that
// revert brings every member back to the same cut: all reverted, then
// resumed, each reconnecting to the others. Members are the domain of
// vm.domain on vm.connect and `with` ("DOMAIN" on vm.connect, or
// "DOMAIN@URI"). Return exit codes (cli.h).
struct SnapshotOptions {
  VmOptions vm;
  std::string name;
  std::vector<std::string> with;
};
int Snapshot(const SnapshotOptions& o);
int Revert(const SnapshotOptions& o);

// "DOMAIN@URI" -> {DOMAIN, URI}; "DOMAIN" -> {DOMAIN, default_uri}. The
// first '@' splits.
std::pair<std::string, std::string> ParseMember(absl::string_view member,
                                                const std::string& default_uri);
// A group snapshot's description, listing its members ("DOMAIN@URI"), and
// back; no members when the description is not one.
std::string GroupDescription(const std::vector<std::string>& members);
std::vector<std::string> GroupMembers(absl::string_view description);
// Whether `name` may name a snapshot here: letters, digits, '.', '_', '-'.
bool ValidSnapshotName(absl::string_view name);

// "qemu+ssh://host/system" -> "host"; "" without a host part.
std::string UriHost(absl::string_view uri);

// The <interface> of `domain_xml` whose alias is `alias`, "" if none.
std::string InterfaceWithAlias(absl::string_view domain_xml, absl::string_view alias);
// The value of attribute `attr` of the first element `tag` in `xml`
// ("<mac address='...'/>"): "" if absent.
std::string ElementAttribute(absl::string_view xml, absl::string_view tag, absl::string_view attr);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_VM_H_
