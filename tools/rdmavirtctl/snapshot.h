// snapshot and revert: snapshots of RDMA guests whose endpoints talk to
// each other, taken together at one cut and reverted together, through the
// libvirt API and each guest's agent. Called from the CLI's main thread;
// each call blocks until every member is done.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_SNAPSHOT_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_SNAPSHOT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "tools/rdmavirtctl/vm_migrate.h"

namespace rdmavirt::ctl {

// Snapshot: every member's endpoints (and their peers) suspended, an
// internal snapshot NAME of each member (memory and disks: its disks must
// be qcow2), every member resumed. A failure deletes the snapshots taken and
// resumes every member. The snapshot's description names the group, so that
// revert brings every member back to the same cut: all reverted, then
// resumed, each reconnecting to the others; every member's snapshot is
// checked before anything is reverted. Members are the domain of vm.domain
// on vm.connect and `with` ("DOMAIN" on vm.connect, or "DOMAIN@URI").
// Progress and the failure go to stderr, the report to stdout. Return exit
// codes (cli.h).
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

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_SNAPSHOT_H_
