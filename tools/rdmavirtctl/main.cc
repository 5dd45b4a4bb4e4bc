// rdmavirtctl: the operator's CLI to a host's rdmavirt-migratord (Operator
// service, mutual TLS). Exit codes: 0 done, 1 the operation failed (rolled
// back or not), 2 usage error, 3 the daemon cannot be reached.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "tools/rdmavirtctl/args.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/guest_commands.h"
#include "tools/rdmavirtctl/host_commands.h"

namespace rdmavirt::ctl {
namespace {

// `help [COMMAND]` and `--help` alone: the usage, or a command's help.
int Help(const Args& args) {
  const std::string topic = !args.positional.empty() ? args.positional[0] : "";
  auto it = CommandHelp().find(topic);
  if (!topic.empty() && it == CommandHelp().end())
    return UsageError(absl::StrCat("no command ", topic));
  printf("%s", it != CommandHelp().end() ? it->second.c_str() : kUsageText);
  return kOk;
}

int Main(int argc, char** argv) {
  Args args;
  if (int rc = ParseArgs(argc, argv, &args); rc != 0) return rc;
  if (args.command == "help" || (args.help && args.command.empty())) return Help(args);
  if (args.command.empty()) return UsageError("no command given");
  auto help = CommandHelp().find(args.command);
  if (help == CommandHelp().end())
    return UsageError(absl::StrCat("unknown command \"", args.command, "\""));
  if (args.help) {
    printf("%s", help->second.c_str());
    return kOk;
  }
  if (IsGuestCommand(args.command)) return GuestCommand(args);
  return HostCommand(args);
}

}  // namespace
}  // namespace rdmavirt::ctl

int main(int argc, char** argv) { return rdmavirt::ctl::Main(argc, argv); }
