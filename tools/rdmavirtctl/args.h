// rdmavirtctl's command line: the options it was given, the help texts and
// the usage errors (exit code kUsage). Pure functions but for the usage
// errors, which print to stderr; called from the main thread.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_ARGS_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_ARGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rdmavirt::ctl {

struct Args {
  std::string host = "127.0.0.1:7700";
  std::string tls_dir = "/etc/rdmavirt/tls";
  bool json = false;
  std::string command;
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;  // --to, --dir, --on, ...
  bool leave_running = false;
  bool postcopy = false;
  bool unsafe = false;
  bool dry_run = false;
  bool auto_pick = false;
  bool wait = false;
  bool help = false;
  bool all = false;
};

// `rdmavirtctl --help`.
extern const char kUsageText[];
// Each command's help, by command: `rdmavirtctl help COMMAND`.
const std::map<std::string, std::string>& CommandHelp();

// Says `message` and the help of `command` (or where to find usage) on
// stderr; kUsage.
int UsageError(const std::string& message, const std::string& command = "");

// The command line into `a`: 0 to go on, else an exit code (after printing
// why). --address and --with may be given more than once.
int ParseArgs(int argc, char** argv, Args* a);

// A process id (a positive integer); INVALID_ARGUMENT saying what it is not.
absl::StatusOr<int> ParsePid(const std::string& s);
// The value of option `name`, 1..max; INVALID_ARGUMENT naming the range.
absl::StatusOr<uint32_t> ParseCount(const std::string& name, const std::string& s, uint32_t max);
// The value of option `name`; "" when not given.
std::string Opt(const Args& a, const std::string& name);
// The migrator of --host as a gRPC target into `target`: kOk, or kUsage
// after saying why.
int HostTarget(const Args& a, std::string* target);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_ARGS_H_
