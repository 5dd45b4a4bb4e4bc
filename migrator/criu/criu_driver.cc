#include "migrator/criu/criu_driver.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "migrator/criu/pty_images.h"
#include "migrator/host/scoped_fd.h"
#include "migrator/host/spawn.h"

extern "C" {
#include <criu/criu.h>
}

namespace rdmavirt::migrator {
namespace {

namespace fs = std::filesystem;

constexpr int kLogTailLines = 10;

// Numbers each call of the process's drivers: log names stay unique when
// several drivers start calls in the same microsecond.
std::atomic<uint64_t> g_calls{0};

struct OptsDeleter {
  void operator()(criu_opts* o) const { criu_local_free_opts(o); }
};
using OptsPtr = std::unique_ptr<criu_opts, OptsDeleter>;

uint64_t ElapsedUs(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now() - start)
                                   .count());
}

// `CALL-PID-20250102T030405.123456-N.log`: sorts by time, unique per call.
std::string LogName(const std::string& call, pid_t pid) {
  const uint64_t seq = g_calls.fetch_add(1, std::memory_order_relaxed) + 1;
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t{};
  gmtime_r(&ts.tv_sec, &t);
  char when[32];
  strftime(when, sizeof(when), "%Y%m%dT%H%M%S", &t);
  char usec[24];
  snprintf(usec, sizeof(usec), "%06ld", ts.tv_nsec / 1000);
  std::string name = call;
  if (pid > 0) absl::StrAppend(&name, "-", pid);
  absl::StrAppend(&name, "-", when, ".", usec, "-", seq, ".log");
  return name;
}

// The first error CRIU logged (usually the cause) and the last lines.
struct LogExcerpt {
  std::string first_error;
  std::deque<std::string> tail;
  std::string all_errors;  // every "Error" line, for classification
};

LogExcerpt ReadLog(const std::string& path) {
  LogExcerpt ex;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    // CRIU's probes of kernel features log errors that fail nothing (no
    // tun device in the lab's hosts): they are not the cause.
    if (absl::StrContains(line, "Error (") && !absl::StrContains(line, "criu/tun.c")) {
      if (ex.first_error.empty()) ex.first_error = line;
      absl::StrAppend(&ex.all_errors, line, "\n");
    }
    ex.tail.push_back(line);
    if (ex.tail.size() > kLogTailLines) ex.tail.pop_front();
  }
  return ex;
}

std::string Describe(const std::string& what, const std::string& log_path, const LogExcerpt& ex) {
  std::string msg = absl::StrCat(what, " (log ", log_path, ")");
  if (!ex.first_error.empty() &&
      std::find(ex.tail.begin(), ex.tail.end(), ex.first_error) == ex.tail.end()) {
    absl::StrAppend(&msg, "\nfirst error: ", ex.first_error);
  }
  if (ex.tail.empty()) {
    absl::StrAppend(&msg, "\n(the log is empty or missing)");
  } else {
    absl::StrAppend(&msg, "\nlog tail:\n", absl::StrJoin(ex.tail, "\n"));
  }
  return msg;
}

bool ContainsAny(const std::string& text, std::initializer_list<const char*> needles) {
  for (const char* n : needles) {
    if (absl::StrContains(text, n)) return true;
  }
  return false;
}

enum class Call { kCheck, kPreDump, kDump, kRestore };

// Turns a failed libcriu call into a status. `ret` is libcriu's return,
// `cr_errno` the errno CRIU reported with its answer (0 if none).
absl::Status CriuFailure(Call call, int ret, int cr_errno, const std::string& what,
                         const std::string& log_path) {
  const LogExcerpt ex = ReadLog(log_path);
  const std::string msg = Describe(what, log_path, ex);
  switch (ret) {
    case -ECONNREFUSED:
      return absl::FailedPreconditionError(absl::StrCat("cannot start criu swrk: ", msg));
    case -ECOMM:
      return absl::InternalError(
          absl::StrCat("lost criu swrk (it could not start or it crashed): ", msg));
    case -EINVAL:
    case -EBADMSG:
      return absl::InternalError(
          absl::StrCat("criu does not understand the request (version mismatch?): ", msg));
    default:
      break;
  }
  if (cr_errno == ESRCH) return absl::NotFoundError(absl::StrCat("no such process: ", msg));
  if (cr_errno == EEXIST && call == Call::kRestore) {
    return absl::AlreadyExistsError(
        absl::StrCat("a pid of the dumped tree is in use on this host: ", msg));
  }
  const std::string& errs = ex.all_errors;
  if (absl::StrContains(errs, "criu itself is within dumped tree")) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tree to dump holds the migrator itself: ", msg));
  }
  if (call == Call::kRestore &&
      ContainsAny(errs, {"agic doesn't match", "Unexpected EOF", "Img trimmed", "Failed unpacking",
                         "Corrupted", "Too old image", "Not supported images version",
                         "in parent pagemap", "No parent for snapshot", "No parent image found",
                         "Can't read mapping page", "Reached EOF unexpectedly", "Page read err",
                         "Wrong object requested", "bytes while"})) {
    return absl::DataLossError(absl::StrCat("the images do not parse: ", msg));
  }
  if (call == Call::kRestore && ContainsAny(errs, {"Can't fork for"}) &&
      absl::StrContains(errs, "File exists")) {
    return absl::AlreadyExistsError(
        absl::StrCat("a pid of the dumped tree is in use on this host: ", msg));
  }
  if (call != Call::kRestore &&
      ContainsAny(errs, {"Can't dump file", "non-regular mapping", "Unsupported", "unsupported",
                         "Can't dump half of stream", "External socket", "TCP connection",
                         "Connected TCP socket", "Can't seize", "Unable to seize", "file locks",
                         "Dirty tracking", "track-mem", "outside of its pid namespace", "tty"})) {
    return absl::FailedPreconditionError(absl::StrCat("CRIU refuses the process as it is: ", msg));
  }
  if (call == Call::kCheck) return absl::FailedPreconditionError(msg);
  return absl::InternalError(msg);
}

// The sizes of the regular files directly in dir (CRIU's images are flat).
std::map<std::string, uint64_t> RegularFiles(const std::string& dir) {
  std::map<std::string, uint64_t> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code ec2;
    if (e.is_symlink(ec2) || !e.is_regular_file(ec2)) continue;
    const uint64_t size = e.file_size(ec2);
    if (!ec2) files[e.path().filename().string()] = size;
  }
  return files;
}

uint64_t BytesWritten(const std::map<std::string, uint64_t>& before,
                      const std::map<std::string, uint64_t>& after) {
  uint64_t total = 0;
  for (const auto& [name, size] : after) {
    const auto it = before.find(name);
    if (it == before.end() || it->second != size) total += size;
  }
  return total;
}

// mkdir -p, the last level with `mode`.
absl::Status MakeDir(const std::string& dir, mode_t mode) {
  std::error_code ec;
  const fs::path parent = fs::path(dir).parent_path();
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (mkdir(dir.c_str(), mode) == 0) return absl::OkStatus();
  const int err = errno;
  struct stat st;
  if (err == EEXIST && stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::OkStatus();
  }
  return absl::ErrnoToStatus(err, absl::StrCat("cannot create directory ", dir));
}

// Where `criu` is, or "" when it is not on PATH.
std::string FindCriu() {
  const char* path = getenv("PATH");
  const std::string dirs = path != nullptr ? path : "/usr/local/sbin:/usr/sbin:/sbin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string d = dirs.substr(start, end - start);
    const std::string candidate = (d.empty() ? "." : d) + "/criu";
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

constexpr unsigned kGhostLimit = 1u << 30;

// Options every call shares; what each one adds is in the call. Why each:
//   shell_job=true        most processes do not lead their session or
//                         group (a shell's child, a supervisor's, an MPI
//                         rank): their session and group stay behind, and
//                         the restored root joins the restorer's (the shim
//                         then starts a session of its own, control.cc).
//   tcp_established=false a live TCP connection cannot follow the process to
//                         another host's address: refuse it rather than
//                         restore a connection nobody can reach (a dump or
//                         restore whose addresses move turns it on).
//   ext_unix_sk=false     same for a Unix socket connected outside the tree
//                         (the shim closes its migrator socket when released).
//   file_locks=true       applications hold flock/POSIX locks on their own
//                         files (pid files, databases); without it CRIU
//                         refuses any process holding one.
//   manage_cgroups=true   (soft mode) the restored tree goes back to the
//                         cgroup it was dumped from, created if missing,
//                         instead of joining the migrator's own cgroup.
//   ghost_limit=1 GiB     a file the tree holds open or mapped after it was
//                         deleted is carried in the images, up to this size
//                         (CRIU's default is 1 MiB): shared-memory segments
//                         are made so (UCX's posix transport between the
//                         ranks of one host: 4 MiB each).
//   log_level=4           the logs are the only way to debug a failed move.
absl::StatusOr<OptsPtr> NewOpts(const std::string& criu, int work_dir_fd,
                                const std::string& log_name) {
  criu_opts* raw = nullptr;
  if (criu_local_init_opts(&raw) != 0) return absl::ResourceExhaustedError("criu_local_init_opts");
  OptsPtr opts(raw);
  if (criu_local_set_service_binary(opts.get(), criu.c_str()) != 0 ||
      criu_local_set_log_file(opts.get(), log_name.c_str()) != 0) {
    return absl::ResourceExhaustedError("criu options");
  }
  criu_local_set_work_dir_fd(opts.get(), work_dir_fd);
  criu_local_set_log_level(opts.get(), CRIU_LOG_DEBUG);
  criu_local_set_shell_job(opts.get(), true);
  criu_local_set_tcp_established(opts.get(), false);
  criu_local_set_ext_unix_sk(opts.get(), false);
  criu_local_set_file_locks(opts.get(), true);
  criu_local_set_manage_cgroups(opts.get(), true);
  criu_local_set_ghost_limit(opts.get(), kGhostLimit);
  return opts;
}

// Established TCP connections are dumped and restored through repair mode.
// While CRIU works on them the network is locked, through nftables: the
// lab's kernels and Debian's CRIU have it, and it leaves no rule behind
// (its table goes with the unlock) where iptables' would need a cleanup.
absl::Status AllowTcp(criu_opts* o) {
  criu_local_set_tcp_established(o, true);
  if (criu_local_set_network_lock(o, CRIU_NETWORK_LOCK_NFTABLES) != 0)
    return absl::ResourceExhaustedError("criu options");
  return absl::OkStatus();
}

// Relative path from dir to parent, as CRIU wants it (it resolves the
// parent against the images directory).
absl::StatusOr<std::string> ParentRelativeTo(const std::string& dir, const std::string& parent) {
  if (parent.empty() || parent[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("parent images dir must be an absolute path: \"", parent, "\""));
  }
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parent images dir ", parent, " is not a directory"));
  }
  const fs::path p = fs::canonical(parent, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("cannot resolve ", parent));
  const fs::path d = fs::canonical(dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("cannot resolve ", dir));
  if (p == d) return absl::InvalidArgumentError(absl::StrCat(dir, " cannot be its own parent"));
  const fs::path rel = p.lexically_relative(d);
  if (rel.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no relative path from ", dir, " to ", parent));
  }
  return rel.string();
}

absl::Status WriteSmallFile(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp));
  ScopedFd closer(fd);
  if (write(fd, content.data(), content.size()) != static_cast<ssize_t>(content.size()) ||
      fsync(fd) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot write ", tmp));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot rename ", tmp));
  }
  return absl::OkStatus();
}

// Re-creates CRIU's `parent` links along the chain from parent.path files
// (images that travelled as regular files have no symlinks).
absl::Status RestoreParentLinks(const std::string& dir) {
  fs::path cur = dir;
  for (int depth = 0; depth < 64; ++depth) {
    const fs::path record = cur / kParentPathFile;
    std::ifstream in(record);
    if (!in) return absl::OkStatus();  // the first iteration: no parent
    std::string rel;
    std::getline(in, rel);
    if (rel.empty() || rel[0] == '/' || rel.find('\0') != std::string::npos) {
      return absl::DataLossError(
          absl::StrCat(record.string(), " does not hold a relative path: \"", rel, "\""));
    }
    const fs::path target = cur / rel;
    std::error_code ec;
    if (!fs::is_directory(target, ec)) {
      return absl::NotFoundError(absl::StrCat("parent images of ", cur.string(), " missing: ",
                                              target.string(), " (from ", record.string(), ")"));
    }
    const fs::path link = cur / "parent";
    if (!fs::is_symlink(link, ec)) {
      if (fs::exists(link, ec)) {
        return absl::FailedPreconditionError(
            absl::StrCat(link.string(), " exists and is not CRIU's parent link"));
      }
      if (symlink(rel.c_str(), link.c_str()) != 0) {
        return absl::ErrnoToStatus(errno, absl::StrCat("cannot link ", link.string()));
      }
    }
    cur = target;
  }
  return absl::FailedPreconditionError(absl::StrCat("parent chain of ", dir, " too deep"));
}

struct DumpArgs {
  bool pre_dump;
  pid_t pid;
  const std::string& dir;
  const std::string& parent;
  bool leave_running;
  bool tcp_established;
};

// Runs `args` (args[0] is the program's path) with /dev/null as its
// standard files and `fd_as_3` (if not -1) as its fd 3 (SpawnProgram).
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& args, int fd_as_3 = -1) {
  return SpawnProgram(args, SpawnFds{.as_fd3 = fd_as_3});
}

// The exit status of the child `pid`, -1 if a signal ended it.
int WaitExit(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// rdmavirt-terminal: beside this program (a build tree, or an installed
// migrator), else the installed one; "" if neither.
std::string TerminalKeeperPath() {
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<size_t>(n));
    const std::string beside = dir.substr(0, dir.rfind('/')) + "/rdmavirt-terminal";
    if (access(beside.c_str(), X_OK) == 0) return beside;
  }
  const std::string installed = "/usr/local/lib/rdmavirt/rdmavirt-terminal";
  return access(installed.c_str(), X_OK) == 0 ? installed : std::string();
}

// Starts rdmavirt-terminal, which runs `criu swrk` in a session of its own
// whose controlling terminal is a new pseudo-terminal (terminal_keeper.cc);
// returns this side of the socket CRIU serves requests on. The keeper's
// first process exits once its session's process is detached: waited for
// here, so that no zombie stays.
absl::StatusOr<ScopedFd> StartTerminalKeeper(const std::string& criu, const std::string& log) {
  const std::string keeper = TerminalKeeperPath();
  if (keeper.empty())
    return absl::FailedPreconditionError(
        "rdmavirt-terminal is neither beside this program nor in /usr/local/lib/rdmavirt: "
        "a process that held a terminal cannot be restored without it");
  int sv[2];
  if (socketpair(AF_LOCAL, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    return absl::ErrnoToStatus(errno, "socketpair for criu swrk");
  ScopedFd ours(sv[0]);
  ScopedFd theirs(sv[1]);
  // Its end becomes fd 3 in the keeper.
  absl::StatusOr<pid_t> pid =
      Spawn({keeper, "--swrk-fd", "3", "--criu", criu, "--log", log}, theirs.get());
  if (!pid.ok()) return pid.status();
  theirs = ScopedFd();
  if (WaitExit(*pid) != 0)
    return absl::InternalError(absl::StrCat(keeper, " failed to start (see ", log, ")"));
  return ours;
}

// The tree's pseudo-terminals given indexes this host does not hold
// (pty_images.h) for as long as this lives: the restore's.
class RenumberedPtys {
 public:
  explicit RenumberedPtys(std::string dir) : dir_(std::move(dir)) {}
  RenumberedPtys(const RenumberedPtys&) = delete;
  RenumberedPtys& operator=(const RenumberedPtys&) = delete;
  ~RenumberedPtys() { (void)PutBackPtyImages(dir_); }

  absl::Status Renumber() {
    absl::StatusOr<std::map<uint32_t, uint32_t>> moved = RenumberPtys(dir_, PtysInUse());
    if (moved.ok()) return absl::OkStatus();
    return absl::Status(
        moved.status().code(),
        absl::StrCat("restore: the tree's pseudo-terminals: ", moved.status().message()));
  }

 private:
  const std::string dir_;
};

absl::StatusOr<CriuResult> RunDump(const std::string& log_dir, const DumpArgs& a);

// What every libcriu call starts from: the criu binary (FAILED_PRECONDITION
// when PATH has none) and the log directory, made and opened (its fd is
// what libcriu writes the call's log under).
struct CriuSetup {
  std::string criu;
  ScopedFd log_fd;
};

absl::StatusOr<CriuSetup> SetUpCriu(const std::string& log_dir) {
  CriuSetup setup;
  setup.criu = FindCriu();
  if (setup.criu.empty()) return absl::FailedPreconditionError("criu not found on PATH");
  if (absl::Status s = MakeDir(log_dir, 0700); !s.ok()) return s;
  setup.log_fd = ScopedFd(open(log_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (setup.log_fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open log dir ", log_dir));
  }
  return setup;
}

}  // namespace

CriuDriver::CriuDriver(std::string log_dir) : log_dir_(std::move(log_dir)) {}

absl::Status CriuDriver::Check() {
  absl::StatusOr<CriuSetup> setup = SetUpCriu(log_dir_);
  if (!setup.ok()) return setup.status();
  const std::string& criu = setup->criu;
  const ScopedFd& log_fd = setup->log_fd;

  // libcriu 3.17's criu_local_check() sends no options, and criu's check
  // needs them (its images and log dirs): run `criu check` itself.
  const std::string log_name = LogName("check", 0);
  const std::string log_path = absl::StrCat(log_dir_, "/", log_name);
  const pid_t child = fork();
  if (child < 0) return absl::ErrnoToStatus(errno, "fork for criu check");
  if (child == 0) {
    const int out = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (out >= 0) {
      dup2(out, STDOUT_FILENO);
      dup2(out, STDERR_FILENO);
    }
    execl(criu.c_str(), "criu", "check", "-v4", "--log-file", log_path.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  while (waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) return absl::ErrnoToStatus(errno, "waiting for criu check");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::FailedPreconditionError(Describe(
        absl::StrCat("criu check failed (status ", status, ")"), log_path, ReadLog(log_path)));
  }

  // Pre-copy needs the soft-dirty bit.
  const std::string ft_log = LogName("feature-check", 0);
  absl::StatusOr<OptsPtr> opts = NewOpts(criu, log_fd.get(), ft_log);
  if (!opts.ok()) return opts.status();
  struct criu_feature_check features {};
  features.mem_track = true;
  const int ret = criu_local_feature_check(opts->get(), &features, sizeof(features));
  if (ret != 0) {
    return CriuFailure(Call::kCheck, ret, errno, "criu feature check failed",
                       absl::StrCat(log_dir_, "/", ft_log));
  }
  if (!features.mem_track) {
    return absl::FailedPreconditionError(
        "the kernel cannot track dirty memory (soft-dirty bit): pre-copy is not possible");
  }
  return absl::OkStatus();
}

namespace {

// What every dump checks and makes before CRIU runs: the pid, criu and the
// log dir (SetUpCriu), an absolute dir (created) without a dump in it, the
// parent's path relative to it ("" for none).
struct DumpPlan {
  CriuSetup setup;
  std::string parent_rel;
  std::map<std::string, uint64_t> before;  // the files dir held
};

absl::StatusOr<DumpPlan> PlanDump(const char* call_name, const std::string& log_dir, pid_t pid,
                                  const std::string& dir, const std::string& parent) {
  if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat(call_name, ": bad pid ", pid));
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(call_name, ": images dir must be an absolute path: \"", dir, "\""));
  }
  if (kill(pid, 0) != 0 && errno == ESRCH) {
    return absl::NotFoundError(absl::StrCat(call_name, ": no process ", pid));
  }
  DumpPlan plan;
  absl::StatusOr<CriuSetup> setup = SetUpCriu(log_dir);
  if (!setup.ok()) return setup.status();
  plan.setup = *std::move(setup);
  if (absl::Status s = MakeDir(dir, 0700); !s.ok()) return s;
  plan.before = RegularFiles(dir);
  for (const auto& [name, size] : plan.before) {
    if (absl::EndsWith(name, ".img")) {
      return absl::AlreadyExistsError(
          absl::StrCat(call_name, ": ", dir, " already holds a dump (", name, ")"));
    }
  }
  if (!parent.empty()) {
    absl::StatusOr<std::string> rel = ParentRelativeTo(dir, parent);
    if (!rel.ok()) return rel.status();
    plan.parent_rel = *std::move(rel);
  }
  return plan;
}

absl::StatusOr<CriuResult> RunDump(const std::string& log_dir, const DumpArgs& a) {
  const char* call_name = a.pre_dump ? "pre-dump" : "dump";
  absl::StatusOr<DumpPlan> plan = PlanDump(call_name, log_dir, a.pid, a.dir, a.parent);
  if (!plan.ok()) return plan.status();
  const std::string& criu = plan->setup.criu;
  const ScopedFd& log_fd = plan->setup.log_fd;
  const std::string& parent_rel = plan->parent_rel;
  const std::map<std::string, uint64_t>& before = plan->before;
  ScopedFd dir_fd(open(a.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", a.dir));

  const std::string log_name = LogName(call_name, a.pid);
  absl::StatusOr<OptsPtr> opts = NewOpts(criu, log_fd.get(), log_name);
  if (!opts.ok()) return opts.status();
  criu_opts* o = opts->get();
  criu_local_set_pid(o, a.pid);
  criu_local_set_images_dir_fd(o, dir_fd.get());
  // Tracking: a pre-dump resets the soft-dirty bits so the next iteration
  // (or the final dump) writes only what changed since.
  const bool track = a.pre_dump || !parent_rel.empty();
  criu_local_set_track_mem(o, track);
  if (!parent_rel.empty() && criu_local_set_parent_images(o, parent_rel.c_str()) != 0) {
    return absl::ResourceExhaustedError("criu options");
  }
  if (a.pre_dump) {
    // splice: pages go through pipes while the tree is frozen, then to the
    // images; CRIU's default, and the faster of the two in the lab.
    if (criu_local_set_pre_dump_mode(o, CRIU_PRE_DUMP_SPLICE) != 0) {
      return absl::ResourceExhaustedError("criu options");
    }
  } else {
    criu_local_set_leave_running(o, a.leave_running);
    if (a.tcp_established) {
      if (absl::Status s = AllowTcp(o); !s.ok()) return s;
    }
  }

  const auto start = std::chrono::steady_clock::now();
  errno = 0;
  const int ret = a.pre_dump ? criu_local_pre_dump(o) : criu_local_dump(o);
  const int cr_errno = errno;
  CriuResult result;
  result.elapsed_us = ElapsedUs(start);
  if (ret < 0) {
    return CriuFailure(a.pre_dump ? Call::kPreDump : Call::kDump, ret, cr_errno,
                       absl::StrCat(call_name, " of pid ", a.pid, " into ", a.dir, " failed"),
                       absl::StrCat(log_dir, "/", log_name));
  }
  result.image_bytes = BytesWritten(before, RegularFiles(a.dir));
  if (!parent_rel.empty()) {
    absl::Status s = WriteSmallFile(absl::StrCat(a.dir, "/", kParentPathFile), parent_rel + "\n");
    if (!s.ok()) return s;
  }
  return result;
}

}  // namespace

absl::StatusOr<CriuResult> CriuDriver::PreDump(pid_t pid, const std::string& dir,
                                               const std::string& parent) {
  return RunDump(log_dir_, {true, pid, dir, parent, true, false});
}

absl::StatusOr<CriuResult> CriuDriver::Dump(pid_t pid, const std::string& dir,
                                            const std::string& parent, bool leave_running,
                                            bool tcp_established) {
  return RunDump(log_dir_, {false, pid, dir, parent, leave_running, tcp_established});
}

absl::StatusOr<pid_t> CriuDriver::Restore(const std::string& dir, bool tcp_established,
                                          bool new_terminal, std::string* restored_terminal_log) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("restore: images dir must be an absolute path: \"", dir, "\""));
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("restore: no images dir ", dir));
  }
  if (!fs::exists(fs::path(dir) / "inventory.img", ec)) {
    return absl::NotFoundError(absl::StrCat("restore: ", dir, " holds no dump (no inventory.img)"));
  }
  if (absl::Status s = RestoreParentLinks(dir); !s.ok()) return s;
  RenumberedPtys ptys(dir);
  if (absl::Status s = ptys.Renumber(); !s.ok()) return s;
  absl::StatusOr<CriuSetup> setup = SetUpCriu(log_dir_);
  if (!setup.ok()) return setup.status();
  const std::string& criu = setup->criu;
  const ScopedFd& log_fd = setup->log_fd;
  ScopedFd dir_fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", dir));

  const std::string log_name = LogName("restore", 0);
  absl::StatusOr<OptsPtr> opts = NewOpts(criu, log_fd.get(), log_name);
  if (!opts.ok()) return opts.status();
  criu_local_set_images_dir_fd(opts->get(), dir_fd.get());
  if (tcp_established) {
    if (absl::Status s = AllowTcp(opts->get()); !s.ok()) return s;
  }
  // criu_local_restore (not _restore_child): CRIU's service always restores
  // detached, under its swrk process, which then exits.
  ScopedFd swrk;
  std::string terminal_log;
  if (new_terminal) {
    terminal_log = absl::StrCat(log_dir_, "/terminal-", log_name);
    absl::StatusOr<ScopedFd> sk = StartTerminalKeeper(criu, terminal_log);
    if (!sk.ok()) return sk.status();
    swrk = std::move(*sk);
    criu_local_set_service_fd(opts->get(), swrk.get());
  }
  errno = 0;
  const int ret = criu_local_restore(opts->get());
  const int cr_errno = errno;
  swrk = ScopedFd();  // its `criu swrk` exits once this end is closed
  if (ret <= 0) {
    absl::Status st = CriuFailure(Call::kRestore, ret < 0 ? ret : -EBADE, cr_errno,
                                  absl::StrCat("restore from ", dir, " failed"),
                                  absl::StrCat(log_dir_, "/", log_name));
    if (!terminal_log.empty())
      st = absl::Status(st.code(),
                        absl::StrCat(st.message(), "; the terminal keeper's log (", terminal_log,
                                     "): ", absl::StrJoin(ReadLog(terminal_log).tail, "\n")));
    return st;
  }
  if (!terminal_log.empty()) {
    // Named after the process from here on: its terminal's output.
    const std::string named = absl::StrCat(log_dir_, "/terminal-", ret, ".log");
    if (rename(terminal_log.c_str(), named.c_str()) == 0) terminal_log = named;
    if (restored_terminal_log != nullptr) *restored_terminal_log = terminal_log;
  }
  return static_cast<pid_t>(ret);
}

}  // namespace rdmavirt::migrator

// ---- post-copy: CRIU's lazy pages, through its command line (libcriu
// 3.17 has no setter for lazy pages nor for CRIU's TLS).
namespace rdmavirt::migrator {
namespace {

// Whether a TCP socket of this host listens on `port`.
bool ListeningOn(int port) {
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (strtol(local.c_str() + colon + 1, nullptr, 16) == port) return true;
    }
  }
  return false;
}

// CRIU's own TLS, mutual, with this host's certificate. The common name is
// not checked: the source listens on one of its addresses and the
// destination's certificate names another host; the chain is (ca.pem).
std::vector<std::string> TlsArgs(const std::string& tls_dir) {
  return {
      "--tls",     "--tls-cacert",        tls_dir + "/ca.pem", "--tls-cert", tls_dir + "/host.pem",
      "--tls-key", tls_dir + "/host.key", "--tls-no-cn-verify"};
}

// What NewOpts gives libcriu's calls, on CRIU's command line.
std::vector<std::string> CommonArgs(const std::string& work_dir, const std::string& log_name) {
  return {"-W",
          work_dir,
          "-o",
          log_name,
          "-v4",
          "--shell-job",
          "--file-locks",
          "--manage-cgroups=soft",
          "--ghost-limit",
          "1G"};
}

void Append(std::vector<std::string>* to, const std::vector<std::string>& more) {
  to->insert(to->end(), more.begin(), more.end());
}

}  // namespace

absl::StatusOr<CriuResult> CriuDriver::LazyDump(
    pid_t pid, const std::string& dir, const std::string& parent, bool tcp_established,
    const LazyPages& serve, const std::string& tls_dir,
    const std::function<void(const PostCopyHelper&)>& written) {
  absl::StatusOr<DumpPlan> plan = PlanDump("lazy dump", log_dir_, pid, dir, parent);
  if (!plan.ok()) return plan.status();
  const std::string log_name = LogName("lazy-dump", pid);
  const std::string log_path = absl::StrCat(log_dir_, "/", log_name);
  std::vector<std::string> args = {plan->setup.criu, "dump", "-t", std::to_string(pid), "-D", dir};
  Append(&args, CommonArgs(log_dir_, log_name));
  Append(&args, {"--leave-running", "--lazy-pages", "--address", serve.address, "--port",
                 std::to_string(serve.port)});
  if (!plan->parent_rel.empty())
    Append(&args, {"--track-mem", "--prev-images-dir", plan->parent_rel});
  if (tcp_established) Append(&args, {"--tcp-established", "--network-lock", "nftables"});
  Append(&args, TlsArgs(tls_dir));
  const auto start = std::chrono::steady_clock::now();
  const PostCopyHelper helper_status{0, log_path + ".status"};
  unlink(helper_status.status_file.c_str());
  absl::StatusOr<pid_t> criu =
      SpawnProgram(args, SpawnFds{.exit_status_file = helper_status.status_file});
  if (!criu.ok()) return criu.status();
  // CRIU listens for the destination once every other image is written.
  for (;;) {
    if (ListeningOn(serve.port)) break;
    int status = 0;
    if (waitpid(*criu, &status, WNOHANG) == *criu)
      return CriuFailure(Call::kDump, -EBADE, 0,
                         absl::StrCat("lazy dump of pid ", pid, " into ", dir, " failed"),
                         log_path);
    usleep(20 * 1000);
  }
  CriuResult result;
  result.image_bytes = BytesWritten(plan->before, RegularFiles(dir));
  if (!plan->parent_rel.empty()) {
    absl::Status s =
        WriteSmallFile(absl::StrCat(dir, "/", kParentPathFile), plan->parent_rel + "\n");
    if (!s.ok()) {
      CancelLazyDump(serve);
      WaitExit(*criu);
      return s;
    }
  }
  written(PostCopyHelper{*criu, helper_status.status_file});
  const int status = WaitExit(*criu);
  result.elapsed_us = ElapsedUs(start);
  if (status != 0)
    return CriuFailure(Call::kDump, -EBADE, 0,
                       absl::StrCat("lazy dump of pid ", pid,
                                    ": its pages did not all reach "
                                    "the destination's lazy-pages daemon"),
                       log_path);
  return result;
}

void CriuDriver::CancelLazyDump(const LazyPages& serve) {
  // A connection that closes before TLS ends CRIU's page server in error.
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(serve.address.c_str(), std::to_string(serve.port).c_str(), &hints, &res) != 0)
    return;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    ScopedFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (fd.get() >= 0 && connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) break;
  }
  freeaddrinfo(res);
}

namespace {

// CRIU's lazy-pages daemon for a restore of `dir` (work dir `work`),
// fetching from the source's page server at `from`.
std::vector<std::string> LazyPagesArgs(const std::string& criu, const std::string& dir,
                                       const std::string& work, const LazyPages& from,
                                       const std::string& tls_dir) {
  std::vector<std::string> daemon = {criu,
                                     "lazy-pages",
                                     "--page-server",
                                     "--address",
                                     from.address,
                                     "--port",
                                     std::to_string(from.port),
                                     "-D",
                                     dir,
                                     "-W",
                                     work,
                                     "-o",
                                     "lazy-pages.log",
                                     "-v4"};
  Append(&daemon, TlsArgs(tls_dir));
  return daemon;
}

// Waits (30 s at most) for the daemon's socket in `work`; a daemon that
// exits first, or never makes it, is a failure with its log.
absl::Status AwaitPagesSocket(const LazyRestored& out, const std::string& work,
                              const std::string& dir, const LazyPages& from) {
  const std::string socket_path = work + "/lazy-pages.socket";
  for (int i = 0;; ++i) {
    struct stat st;
    if (stat(socket_path.c_str(), &st) == 0) return absl::OkStatus();
    int status = 0;
    if (i > 1500 || waitpid(out.pages_daemon, &status, WNOHANG) == out.pages_daemon)
      return CriuFailure(Call::kRestore, -EBADE, 0,
                         absl::StrCat("CRIU's lazy-pages daemon for ", dir,
                                      " did not start (the source's page server at ", from.address,
                                      ":", from.port, ")"),
                         out.daemon_log);
    usleep(20 * 1000);
  }
}

}  // namespace

absl::StatusOr<LazyRestored> CriuDriver::LazyRestore(const std::string& dir, bool tcp_established,
                                                     const LazyPages& from,
                                                     const std::string& tls_dir) {
  if (dir.empty() || dir[0] != '/')
    return absl::InvalidArgumentError(
        absl::StrCat("restore: images dir must be an absolute path: \"", dir, "\""));
  std::error_code ec;
  if (!fs::exists(fs::path(dir) / "inventory.img", ec))
    return absl::NotFoundError(absl::StrCat("restore: ", dir, " holds no dump (no inventory.img)"));
  if (absl::Status s = RestoreParentLinks(dir); !s.ok()) return s;
  RenumberedPtys ptys(dir);
  if (absl::Status s = ptys.Renumber(); !s.ok()) return s;
  const std::string criu = FindCriu();
  if (criu.empty()) return absl::FailedPreconditionError("criu not found on PATH");
  // The daemon and the restore meet at lazy-pages.socket in their work dir:
  // one of its own for each restore.
  const std::string work =
      absl::StrCat(log_dir_, "/", absl::StripSuffix(LogName("postcopy", 0), ".log"));
  if (absl::Status s = MakeDir(log_dir_, 0700); !s.ok()) return s;
  if (absl::Status s = MakeDir(work, 0700); !s.ok()) return s;
  LazyRestored out;
  out.daemon_log = work + "/lazy-pages.log";
  out.daemon_status = work + "/lazy-pages.status";
  absl::StatusOr<pid_t> d = SpawnProgram(LazyPagesArgs(criu, dir, work, from, tls_dir),
                                         SpawnFds{.exit_status_file = out.daemon_status});
  if (!d.ok()) return d.status();
  out.pages_daemon = *d;
  absl::Cleanup stop_daemon = [&] {
    kill(-out.pages_daemon, SIGKILL);  // its shell's group: the shell and CRIU
    WaitExit(out.pages_daemon);
  };
  if (absl::Status st = AwaitPagesSocket(out, work, dir, from); !st.ok()) return st;
  const std::string pidfile = work + "/root.pid";
  std::vector<std::string> restore = {criu, "restore", "-D", dir};
  Append(&restore, CommonArgs(work, "restore.log"));
  Append(&restore, {"--restore-detached", "--lazy-pages", "--pidfile", pidfile});
  if (tcp_established) Append(&restore, {"--tcp-established", "--network-lock", "nftables"});
  absl::StatusOr<pid_t> r = Spawn(restore);
  if (!r.ok()) return r.status();
  if (WaitExit(*r) != 0)
    return CriuFailure(Call::kRestore, -EBADE, 0,
                       absl::StrCat("restore from ", dir, " with lazy pages failed"),
                       work + "/restore.log");
  std::ifstream in(pidfile);
  if (!(in >> out.pid) || out.pid <= 0)
    return absl::InternalError(
        absl::StrCat("CRIU restored ", dir, " but wrote no pid to ", pidfile));
  std::move(stop_daemon).Cancel();
  return out;
}

}  // namespace rdmavirt::migrator
