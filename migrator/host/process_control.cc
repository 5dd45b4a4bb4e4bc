#include "migrator/host/process_control.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rdmavirt::migrator {
namespace {

// The fields of /proc/PID/stat after the command name ("S 1 42 42 34816
// ..."): the state letter first; "" if the process is gone.
std::string StatFields(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return "";
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return "";
  return line.substr(paren + 2);
}

// The state letter ('T' stopped, 'Z' zombie); 0 if gone.
char State(pid_t pid) {
  const std::string f = StatFields(pid);
  return f.empty() ? 0 : f[0];
}

// Terminals by device major: the console and /dev/tty (5), virtual
// consoles and serial lines (4), Unix98 pseudo-terminals (136-143).
bool IsTerminal(dev_t rdev) {
  const unsigned m = major(rdev);
  return m == 4 || m == 5 || (m >= 136 && m <= 143);
}

// /dev/ptmx: opening it makes a pseudo-terminal pair, whose master side the
// open file is.
const dev_t kPtmx = makedev(5, 2);

// N for the slave side /dev/pts/N (majors 136-143), -1 for another device.
int PtsIndex(dev_t rdev) {
  const unsigned m = major(rdev);
  if (m < 136 || m > 143) return -1;
  return static_cast<int>((m - 136) * 256 + minor(rdev));
}

// The controlling terminal's device number (/proc/PID/stat's tty_nr), 0
// for none.
dev_t ControllingTerminal(pid_t pid) {
  std::istringstream rest(StatFields(pid));
  std::string state, ppid, pgrp, session;
  long long tty_nr = 0;
  rest >> state >> ppid >> pgrp >> session >> tty_nr;
  // The kernel's encoding (new_encode_dev).
  const unsigned long long v = static_cast<unsigned long long>(tty_nr);
  return makedev((v >> 8) & 0xfff, (v & 0xff) | ((v >> 12) & 0xfff00));
}

// The kernel's boot id, read once: a start time means something only
// within one boot.
const std::string& BootId() {
  static const std::string* id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    auto* s = new std::string;
    std::getline(in, *s);
    return s;
  }();
  return *id;
}

// The children of every thread of `pid` (/proc/PID/task/TID/children).
std::vector<pid_t> Children(pid_t pid) {
  std::vector<pid_t> out;
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  DIR* d = opendir(tasks.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(absl::StrCat(tasks, "/", e->d_name, "/children"));
    for (pid_t c; in >> c;) out.push_back(c);
  }
  closedir(d);
  return out;
}

// The character devices the process holds open: fd number and device.
std::vector<std::pair<std::string, dev_t>> CharDeviceFds(pid_t pid) {
  std::vector<std::pair<std::string, dev_t>> out;
  const std::string fds = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = opendir(fds.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    struct stat st;
    if (stat((fds + "/" + e->d_name).c_str(), &st) == 0 && S_ISCHR(st.st_mode))
      out.emplace_back(e->d_name, st.st_rdev);
  }
  closedir(d);
  return out;
}

// Whether CRIU dumps an open character device of that number as it is
// (criu/files.c, dump_chrdev): memory devices, tun and autofs, terminals
// (tty, tty aux, pseudo-terminals' both sides). Any other it refuses.
bool CriuDumps(dev_t rdev) {
  const unsigned maj = major(rdev);
  const unsigned min = minor(rdev);
  if (maj == 1) return true;                                  // /dev/null, zero, full, random...
  if (maj == 10) return min == 200 || min == 235;             // /dev/net/tun, autofs
  return maj == 4 || maj == 5 || (maj >= 128 && maj <= 143);  // terminals
}

bool Stopped(pid_t pid) {
  const char s = State(pid);
  return s == 'T' || s == 't' || s == 0 || s == 'Z' || s == 'X';
}

class RealProcessControl final : public ProcessControl {
 public:
  std::vector<pid_t> Descendants(pid_t pid) override {
    std::vector<pid_t> out;
    if (pid <= 0) return out;
    out = Children(pid);
    for (size_t i = 0; i < out.size(); ++i)
      for (pid_t c : Children(out[i])) out.push_back(c);
    return out;
  }

  bool Exists(pid_t pid) override {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    const char s = State(pid);
    return s != 0 && s != 'Z' && s != 'X';
  }

  std::string Identity(pid_t pid) override {
    if (!Exists(pid)) return "";
    // starttime is /proc/PID/stat's field 22; StatFields starts at field 3.
    std::istringstream rest(StatFields(pid));
    std::string field;
    for (int i = 3; i <= 22 && rest >> field; ++i) {
      if (i == 22) return absl::StrCat(BootId(), ":", field);
    }
    return "";
  }

  std::set<int> PtyMasters(pid_t pid) override {
    std::set<int> out;
    for (const auto& [fd, rdev] : CharDeviceFds(pid)) {
      if (rdev != kPtmx) continue;
      // The kernel names the pair in the master's fdinfo ("tty-index:\t3").
      std::ifstream info(absl::StrCat("/proc/", pid, "/fdinfo/", fd));
      for (std::string key; info >> key;) {
        if (key != "tty-index:") continue;
        if (int index; info >> index) out.insert(index);
        break;
      }
    }
    return out;
  }

  std::vector<std::string> Terminals(pid_t pid, const std::set<int>& masters_in_tree) override {
    auto movable = [&](dev_t rdev) {
      const int index = PtsIndex(rdev);
      return rdev == kPtmx || (index >= 0 && masters_in_tree.contains(index));
    };
    std::vector<std::string> out;
    std::set<dev_t> seen;
    for (const auto& [fd, rdev] : CharDeviceFds(pid)) {
      if (!IsTerminal(rdev) || movable(rdev) || !seen.insert(rdev).second) continue;
      const std::string link = absl::StrCat("/proc/", pid, "/fd/", fd);
      char target[256];
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      out.push_back(n > 0 ? std::string(target, n) : link);
    }
    const dev_t ctty = ControllingTerminal(pid);
    if (ctty == 0 || movable(ctty) || seen.contains(ctty)) return out;
    out.push_back(PtsIndex(ctty) >= 0 ? absl::StrCat("/dev/pts/", PtsIndex(ctty))
                                      : absl::StrCat("a controlling terminal (device ", major(ctty),
                                                     ":", minor(ctty), ")"));
    return out;
  }

  std::vector<std::string> DeviceFiles(pid_t pid) override {
    std::set<std::string> out;
    for (const auto& [fd, rdev] : CharDeviceFds(pid)) {
      char target[256];
      const std::string link = absl::StrCat("/proc/", pid, "/fd/", fd);
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      std::string path(target, n);
      if (path.starts_with("/dev/infiniband/"))
        out.insert(std::move(path));
      else if (!CriuDumps(rdev))
        out.insert(absl::StrCat(path, " (", major(rdev), ":", minor(rdev), ")"));
    }
    return {out.begin(), out.end()};
  }

  pid_t Parent(pid_t pid) override {
    std::istringstream rest(StatFields(pid));
    std::string state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    return ppid;
  }

  std::string Program(pid_t pid) override {
    std::ifstream in(absl::StrCat("/proc/", pid, "/comm"));
    std::string comm;
    std::getline(in, comm);
    return comm;
  }

  std::set<uint32_t> TcpAddresses(pid_t pid) override {
    // Its sockets by inode ("socket:[123]"), then the lines of its network
    // namespace's TCP table that name them: "sl local rem st ... inode".
    std::set<std::string> inodes;
    const std::string fds = absl::StrCat("/proc/", pid, "/fd");
    if (DIR* d = opendir(fds.c_str())) {
      while (dirent* e = readdir(d)) {
        char target[64];
        const ssize_t n = readlink((fds + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
        const std::string link(target, n > 0 ? n : 0);
        if (link.starts_with("socket:[") && link.ends_with("]"))
          inodes.insert(link.substr(8, link.size() - 9));
      }
      closedir(d);
    }
    std::set<uint32_t> out;
    if (inodes.empty()) return out;
    std::ifstream table(absl::StrCat("/proc/", pid, "/net/tcp"));
    std::string line;
    std::getline(table, line);  // the header
    while (std::getline(table, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      if (!(f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >>
            inode) ||
          !inodes.contains(inode))
        continue;
      // "0100007F:1F90": the address as the kernel holds it (network
      // order), printed as a native integer.
      const uint32_t raw = static_cast<uint32_t>(strtoul(local.substr(0, 8).c_str(), nullptr, 16));
      if (raw != 0) out.insert(ntohl(raw));
    }
    return out;
  }

  absl::Status Stop(pid_t pid) override {
    if (kill(pid, SIGSTOP) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("SIGSTOP ", pid));
    if (absl::Status st = WaitStopped(pid); !st.ok()) return st;
    // A process stopped forks no more; its children may have, until they
    // stopped too: again until a pass finds none running.
    for (int pass = 0; pass < 100; ++pass) {
      bool all = true;
      for (pid_t c : Descendants(pid)) {
        if (Stopped(c)) continue;
        all = false;
        if (kill(c, SIGSTOP) != 0 && errno != ESRCH)
          return absl::ErrnoToStatus(errno,
                                     absl::StrCat("SIGSTOP ", c, " (a descendant of ", pid, ")"));
        if (absl::Status st = WaitStopped(c); !st.ok()) return st;
      }
      if (all) return absl::OkStatus();
    }
    return absl::DeadlineExceededError(
        absl::StrCat("the descendants of process ", pid, " did not all stop"));
  }

  absl::Status Continue(pid_t pid) override {
    // The descendants first: the root, once running, may wait for them.
    const std::vector<pid_t> tree = Descendants(pid);
    for (auto it = tree.rbegin(); it != tree.rend(); ++it) (void)kill(*it, SIGCONT);
    if (kill(pid, SIGCONT) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("SIGCONT ", pid));
    return absl::OkStatus();
  }

  absl::Status Kill(pid_t pid) override {
    if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("no pid ", pid));
    if (!Exists(pid)) {
      waitpid(pid, nullptr, WNOHANG);
      return absl::OkStatus();
    }
    // Stopped first, so that none of the tree forks a process this kill
    // would not see; then all of it at once.
    (void)Stop(pid);
    std::vector<pid_t> tree = Descendants(pid);
    tree.insert(tree.begin(), pid);
    for (pid_t p : tree) {
      if (kill(p, SIGKILL) != 0 && errno != ESRCH)
        return absl::ErrnoToStatus(errno, absl::StrCat("SIGKILL ", p));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    for (pid_t p : tree) {
      while (Exists(p)) {
        // Our own child (a test's, or a restore that stayed attached).
        waitpid(p, nullptr, WNOHANG);
        if (absl::Now() > deadline)
          return absl::DeadlineExceededError(absl::StrCat("process ", p, " did not die"));
        absl::SleepFor(absl::Milliseconds(2));
      }
      waitpid(p, nullptr, WNOHANG);
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status WaitStopped(pid_t pid) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (!Stopped(pid)) {
      if (absl::Now() > deadline)
        return absl::DeadlineExceededError(absl::StrCat("process ", pid, " did not stop"));
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<ProcessControl> NewProcessControl() {
  return std::make_unique<RealProcessControl>();
}

}  // namespace rdmavirt::migrator
