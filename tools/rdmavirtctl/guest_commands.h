// The commands of guests and VMs, from the command line to the result:
// vm-migrate, drain, snapshot, revert (through libvirt), and suspend,
// resume, guest-event (to --host's migrator; run in a guest, or on a host
// for its hooks). Called from the main thread.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_GUEST_COMMANDS_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_GUEST_COMMANDS_H_

#include <string>

#include "tools/rdmavirtctl/args.h"

namespace rdmavirt::ctl {

// Whether `command` is one of them.
bool IsGuestCommand(const std::string& command);
// Runs args.command, one of them: every option is checked before anything
// is asked of libvirt or a migrator (kUsage after saying why). Returns an
// exit code (cli.h).
int GuestCommand(const Args& args);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_GUEST_COMMANDS_H_
