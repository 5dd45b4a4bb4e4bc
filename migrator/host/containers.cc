#include "migrator/host/containers.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "migrator/host/scoped_fd.h"
#include "migrator/host/spawn.h"

namespace rdmavirt::migrator {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

struct Ran {
  int exit = -1;  // -1: killed (by a signal, or at the deadline)
  bool timed_out = false;
  std::string out;  // stdout and stderr, in the order written
};

// Runs `args` (args[0] found on PATH) with /dev/null as its input and its
// output captured, for at most `timeout` (then SIGKILLed).
absl::StatusOr<Ran> Run(const std::vector<std::string>& args, absl::Duration timeout) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe");
  ScopedFd rd(pipefd[0]);
  ScopedFd wr(pipefd[1]);
  absl::StatusOr<pid_t> spawned =
      SpawnProgram(args, SpawnFds{.output = wr.get(), .search_path = true});
  if (!spawned.ok()) return spawned.status();
  const pid_t pid = *spawned;
  wr = ScopedFd();  // closed here: the read ends when the child exits
  Ran ran;
  const absl::Time deadline = absl::Now() + timeout;
  char buf[4096];
  for (;;) {
    pollfd p{rd.get(), POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) {
      ran.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    const ssize_t got = read(rd.get(), buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    ran.out.append(buf, static_cast<size_t>(got));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ran.exit = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return ran;
}

// The last lines of a command's output, for an error message.
std::string Tail(const std::string& out) {
  std::string s(absl::StripAsciiWhitespace(out));
  if (s.size() > 600) s = "..." + s.substr(s.size() - 600);
  return s;
}

const Value* Field(const Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

std::string Str(const Struct& s, const std::string& name) {
  const Value* v = Field(s, name);
  return v != nullptr && v->has_string_value() ? v->string_value() : "";
}

const Struct* Obj(const Struct& s, const std::string& name) {
  const Value* v = Field(s, name);
  return v != nullptr && v->has_struct_value() ? &v->struct_value() : nullptr;
}

class Podman final : public ContainerRuntime {
 public:
  Podman(std::string path, absl::Duration timeout)
      : path_(path.empty() ? "podman" : std::move(path)), timeout_(timeout) {}

  absl::StatusOr<std::string> Version() override {
    absl::StatusOr<Ran> r = Podman::Call({"version", "--format", "{{.Client.Version}}"});
    if (!r.ok()) return r.status();
    return absl::StrCat("podman ", absl::StripAsciiWhitespace(r->out));
  }

  absl::StatusOr<ContainerInfo> Inspect(const std::string& name) override {
    if (name.empty() || name[0] == '-')
      return absl::InvalidArgumentError(absl::StrCat("not a container name: \"", name, "\""));
    absl::StatusOr<Ran> r = Exec({"container", "inspect", name});
    if (!r.ok()) return r.status();
    if (r->exit != 0) {
      if (absl::StrContains(r->out, "no such container"))
        return absl::NotFoundError(absl::StrCat("no container ", name, " (podman)"));
      return Failed("container inspect", *r);
    }
    Value parsed;
    if (!google::protobuf::util::JsonStringToMessage(r->out, &parsed).ok() ||
        !parsed.has_list_value() || parsed.list_value().values_size() != 1 ||
        !parsed.list_value().values(0).has_struct_value())
      return absl::InternalError(absl::StrCat("podman container inspect ", name,
                                              ": not the JSON expected: ", Tail(r->out)));
    return Parse(parsed.list_value().values(0).struct_value());
  }

  absl::StatusOr<std::vector<ContainerInfo>> List() override {
    absl::StatusOr<Ran> r = Call({"ps", "--format", "{{.Names}}"});
    if (!r.ok()) return r.status();
    std::vector<ContainerInfo> out;
    for (absl::string_view line : absl::StrSplit(r->out, '\n', absl::SkipWhitespace())) {
      absl::StatusOr<ContainerInfo> c = Inspect(std::string(absl::StripAsciiWhitespace(line)));
      if (c.ok() && c->running) out.push_back(*std::move(c));
    }
    return out;
  }

  bool HasImage(const std::string& image_id) override {
    absl::StatusOr<Ran> r = Exec({"image", "exists", image_id});
    return r.ok() && r->exit == 0;
  }

  absl::Status CanCheckpoint(const std::string& runtime) override {
    if (runtime.empty()) return absl::FailedPreconditionError("its OCI runtime is not known");
    absl::StatusOr<Ran> r = Run({runtime, "--version"}, timeout_);
    if (!r.ok() || r->timed_out || r->exit != 0)
      return absl::FailedPreconditionError(
          absl::StrCat("its OCI runtime ", runtime, " does not run here"));
    // crun says "+CRIU" when it has it; runc always has it.
    if (absl::StrContains(runtime, "crun") && !absl::StrContains(r->out, "+CRIU"))
      return absl::FailedPreconditionError(absl::StrCat(
          "its OCI runtime ", runtime,
          " is built without CRIU and cannot checkpoint (run it with --runtime runc)"));
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Checkpoint(const std::string& name, const std::string& file,
                                      bool leave_running, bool tcp_established) override {
    std::vector<std::string> args = {"container", "checkpoint", "--export",
                                     file,        "--compress", "none"};
    if (leave_running) args.push_back("--leave-running");
    if (tcp_established) args.push_back("--tcp-established");
    args.push_back(name);
    absl::StatusOr<Ran> r = Call(args);
    if (!r.ok()) return r.status();
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(file, ec);
    if (ec) return absl::InternalError(absl::StrCat("podman wrote no ", file));
    return static_cast<uint64_t>(size);
  }

  absl::StatusOr<pid_t> Restore(const std::string& name, const std::string& file,
                                bool tcp_established) override {
    std::vector<std::string> args = {"container", "restore", "--import", file};
    if (tcp_established) args.push_back("--tcp-established");
    absl::StatusOr<Ran> r = Call(args);
    if (!r.ok()) return r.status();
    // Made again with the name it had.
    absl::StatusOr<ContainerInfo> c = Inspect(name);
    if (!c.ok()) return c.status();
    if (c->pid <= 0)
      return absl::InternalError(
          absl::StrCat("container ", c->name, " was restored, but runs no process"));
    return c->pid;
  }

  pid_t PidInside(pid_t pid) override { return InnermostPid(pid); }

  pid_t HostPid(pid_t root, pid_t inside) override {
    // Breadth first through /proc/PID/task/*/children.
    std::vector<pid_t> todo = {root};
    for (size_t i = 0; i < todo.size() && i < 100000; ++i) {
      const pid_t p = todo[i];
      if (InnermostPid(p) == inside) return p;
      std::error_code ec;
      for (const auto& t :
           std::filesystem::directory_iterator(absl::StrCat("/proc/", p, "/task"), ec)) {
        std::ifstream children(t.path() / "children");
        pid_t c = 0;
        while (children >> c) todo.push_back(c);
      }
    }
    return 0;
  }

  absl::Status Remove(const std::string& name) override {
    absl::StatusOr<Ran> r = Exec({"container", "rm", "--force", "--time", "0", name});
    if (!r.ok()) return r.status();
    if (r->exit != 0 && !absl::StrContains(r->out, "no such container"))
      return Failed("container rm", *r);
    return absl::OkStatus();
  }

 private:
  // podman with `args`; its output whatever its exit status.
  absl::StatusOr<Ran> Exec(std::vector<std::string> args) {
    args.insert(args.begin(), path_);
    absl::StatusOr<Ran> r = Run(args, timeout_);
    if (!r.ok())
      return absl::FailedPreconditionError(
          absl::StrCat(r.status().message(), " (is podman installed?)"));
    if (r->timed_out)
      return absl::DeadlineExceededError(absl::StrCat(absl::StrJoin(args, " "), ": no end after ",
                                                      absl::FormatDuration(timeout_)));
    return r;
  }

  // podman with `args`, which must succeed.
  absl::StatusOr<Ran> Call(const std::vector<std::string>& args) {
    absl::StatusOr<Ran> r = Exec(args);
    if (r.ok() && r->exit != 0)
      return Failed(absl::StrJoin(args.begin(), args.begin() + 2, " "), *r);
    return r;
  }

  static absl::Status Failed(const std::string& what, const Ran& r) {
    return absl::InternalError(
        absl::StrCat("podman ", what, " failed (exit ", r.exit, "): ", Tail(r.out)));
  }

  static ContainerInfo Parse(const Struct& c) {
    ContainerInfo info;
    info.name = Str(c, "Name");
    info.id = Str(c, "Id");
    info.image = Str(c, "ImageName");
    info.image_id = Str(c, "Image");
    info.runtime = Str(c, "OCIRuntime");
    if (const Struct* state = Obj(c, "State")) {
      const Value* pid = Field(*state, "Pid");
      info.pid =
          pid != nullptr && pid->has_number_value() ? static_cast<pid_t>(pid->number_value()) : 0;
      info.running = Str(*state, "Status") == "running" && info.pid > 0;
    }
    if (const Struct* hc = Obj(c, "HostConfig")) {
      info.host_network = Str(*hc, "NetworkMode") == "host";
      if (const Value* devs = Field(*hc, "Devices"); devs != nullptr && devs->has_list_value())
        for (const Value& d : devs->list_value().values())
          if (d.has_struct_value()) info.devices.push_back(Str(d.struct_value(), "PathOnHost"));
    }
    if (const Struct* config = Obj(c, "Config")) {
      const Value* tty = Field(*config, "Tty");
      info.terminal = tty != nullptr && tty->has_bool_value() && tty->bool_value();
    }
    if (const Value* mounts = Field(c, "Mounts"); mounts != nullptr && mounts->has_list_value())
      for (const Value& m : mounts->list_value().values())
        if (m.has_struct_value() && Str(m.struct_value(), "Type") == "bind")
          info.binds.push_back(Str(m.struct_value(), "Source"));
    return info;
  }

  const std::string path_;
  const absl::Duration timeout_;
};

}  // namespace

std::unique_ptr<ContainerRuntime> NewPodman(const std::string& path, absl::Duration timeout) {
  return std::make_unique<Podman>(path, timeout);
}

pid_t InnermostPid(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "NSpid:")) continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line.substr(6), absl::ByAnyChar(" \t"), absl::SkipEmpty());
    int inner = 0;
    if (fields.empty() || !absl::SimpleAtoi(fields.back(), &inner)) return 0;
    return inner;
  }
  return 0;
}

}  // namespace rdmavirt::migrator
