// drain: every RDMA guest and every process under the shim moved off this
// host, one at a time (vm-migrate for guests, the migrator's Migrate for
// processes), to given hosts or to the live hosts of the inventory. Called
// from the CLI's main thread; blocks until every move has ended.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_DRAIN_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_DRAIN_H_

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rdmavirt/v1/migrator.pb.h"
#include "tools/rdmavirtctl/vm_migrate.h"

namespace rdmavirt::ctl {

// Moves every RDMA guest of --connect's libvirt and every process under the
// shim on `host` (its migrator, HOST:PORT) off this host: to o.to (and
// o.to_migrator), or with `candidates` ("URI MIGRATOR" each) to the one with
// the most free RDMA NICs for each guest. `dry_run` only says what it would
// do. Prints the plan or the summary (what moved, what stayed and why).
// Exit code: kOk when nothing stayed, kFailed when something did,
// kUnreachable when this host's libvirt or migrator cannot be reached.
struct DrainOptions {
  VmOptions vm;
  std::string host;
  std::vector<std::pair<std::string, std::string>> candidates;
  // Candidates from the inventory of `host`'s migrator, read again before
  // each move: only live hosts are picked.
  bool from_inventory = false;
  bool dry_run = false;
  // Each process move's pre-copy rounds at most (migrate --max-precopy);
  // -1: the migrator's default.
  int max_precopy = -1;
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

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_DRAIN_H_
