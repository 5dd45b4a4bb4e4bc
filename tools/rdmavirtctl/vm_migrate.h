// vm-migrate: the live migration of an RDMA guest through the libvirt API
// (docs/vms.md), its RDMA connections kept. The guest side runs in the
// guest, reached through its guest agent (guest_agent.h). Called from the
// CLI's main thread; each call blocks until the move has ended.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_VM_MIGRATE_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_VM_MIGRATE_H_

#include <string>

#include "rdmavirt/v1/migrator.pb.h"

namespace rdmavirt::ctl {

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
// as it was (the report says rolled_back); a failure after leaves it on
// the destination, its endpoints suspended, and says what to run. Says
// each step and the failure on stderr, prints the report on stdout.
// Returns an exit code (cli.h).
int VmMigrate(const VmOptions& o);
// The same without printing the report: it goes to `report`.
int RunVmMigrate(const VmOptions& o, v1::VmReport* report);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_VM_MIGRATE_H_
