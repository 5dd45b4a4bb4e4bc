// The commands of a host's processes, from the command line to the result:
// ps, status, host, hosts (listings) and migrate, checkpoint, restore
// (moves, followed to their end), each one call to --host's migrator.
// Called from the main thread.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_HOST_COMMANDS_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_HOST_COMMANDS_H_

#include "tools/rdmavirtctl/args.h"

namespace rdmavirt::ctl {

// Runs args.command, one of them: everything is checked before connecting
// (kUsage after saying why). Returns an exit code (cli.h).
int HostCommand(const Args& args);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_HOST_COMMANDS_H_
