// rdmavirt-terminal: the session and the new pseudo-terminal of a process
// restored here that held a terminal where it was dumped.
//
// A terminal cannot follow a process to another host. CRIU (shell_job)
// gives the restored process its own standard input in place of the
// pseudo-terminal it held, and makes its group the foreground group of it;
// that only works if CRIU's standard input is a terminal and the
// controlling terminal of CRIU's session. This program makes that session:
//
//   rdmavirt-terminal --swrk-fd FD --criu CRIU --log FILE
//
// It detaches from its caller (the migrator waits only for the first
// process), starts a session of its own, opens a new pseudo-terminal pair,
// makes the slave side its controlling terminal and starts `CRIU swrk FD`
// with that slave as its standard input, output and error. The migrator
// sends the restore request over FD. CRIU restores detached, so when it
// exits the restored process is re-parented to this program, which is a
// child subreaper.
//
// It then stays, as the session's leader (its exit would hang up the
// terminal), holding the master side: everything the restored processes
// write to their terminal is appended to FILE, and when one of its
// children ends, a line says how ("rdmavirt-terminal: process N exited
// with status S"). It exits once it has no child left. Errors go to FILE
// too: the migrator quotes its last lines when the restore fails.
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace {

void Say(int log, const std::string& line) {
  const std::string text = "rdmavirt-terminal: " + line + "\n";
  if (log >= 0) (void)!write(log, text.data(), text.size());
}

void Fail(int log, const std::string& what) {
  Say(log, what + ": " + strerror(errno));
  _exit(1);
}

void Usage() {
  fprintf(stderr,
          "usage: rdmavirt-terminal --swrk-fd FD --criu CRIU --log FILE\n"
          "Started by rdmavirt-migratord to restore a process that held a terminal: runs\n"
          "`CRIU swrk FD` in a session of its own whose controlling terminal is a new\n"
          "pseudo-terminal, appends what the restored processes write to it to FILE, and\n"
          "exits when they have all ended.\n");
}

// Writes what is readable on `master` to `log`. False once the master has
// hung up (no slave side is open any more) and nothing is left to read.
bool Drain(int master, int log) {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(master, buf, sizeof(buf));
    if (n > 0) {
      (void)!write(log, buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // EAGAIN: nothing more now. EIO: every slave side is closed.
    return n < 0 && errno == EAGAIN;
  }
}

// Reaps the children that have ended and says how each did. False once
// there is no child left.
bool Reap(pid_t criu, int log, bool block) {
  for (;;) {
    int status = 0;
    const pid_t p = waitpid(-1, &status, block ? 0 : WNOHANG);
    if (p == 0) return true;
    if (p < 0) return errno == EINTR;
    const std::string who =
        p == criu ? "criu (" + std::to_string(p) + ")" : "process " + std::to_string(p);
    if (WIFEXITED(status))
      Say(log, who + " exited with status " + std::to_string(WEXITSTATUS(status)));
    else if (WIFSIGNALED(status))
      Say(log, who + " was killed by signal " + std::to_string(WTERMSIG(status)));
    if (block) return true;
  }
}

// The command line: --swrk-fd N --criu PATH --log PATH.
struct Args {
  std::string swrk_fd, criu, log_path;
  long sk = -1;
};

// -1 to go on, else the exit code (usage said).
int ParseArgs(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      Usage();
      return 0;
    }
    if (i + 1 >= argc) {
      Usage();
      return 2;
    }
    if (a == "--swrk-fd")
      args->swrk_fd = argv[++i];
    else if (a == "--criu")
      args->criu = argv[++i];
    else if (a == "--log")
      args->log_path = argv[++i];
    else {
      Usage();
      return 2;
    }
  }
  char* end = nullptr;
  args->sk = args->swrk_fd.empty() ? -1 : strtol(args->swrk_fd.c_str(), &end, 10);
  if (args->sk < 0 || *end != '\0' || args->criu.empty() || args->log_path.empty() ||
      fcntl(static_cast<int>(args->sk), F_GETFD) < 0) {
    Usage();
    return 2;
  }
  return -1;
}

// This process a session leader with a new pseudo-terminal as its
// controlling terminal: the master side in *master, the slave returned.
int NewSessionTerminal(int log, int* master) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  signal(SIGHUP, SIG_IGN);  // the session leader outlives its terminal's hangups
  if (setsid() < 0) Fail(log, "setsid");
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) Fail(log, "PR_SET_CHILD_SUBREAPER");
  *master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (*master < 0) Fail(log, "posix_openpt");
  if (grantpt(*master) != 0 || unlockpt(*master) != 0) Fail(log, "grantpt/unlockpt");
  char name[64];
  if (ptsname_r(*master, name, sizeof(name)) != 0) Fail(log, "ptsname");
  // A session leader without a terminal gets the first one it opens.
  const int slave = open(name, O_RDWR);
  if (slave < 0) Fail(log, std::string("open ") + name);
  if (ioctl(slave, TIOCSCTTY, 0) != 0) Fail(log, std::string("TIOCSCTTY ") + name);
  Say(log, std::string("session ") + std::to_string(getpid()) + ", terminal " + name);
  return slave;
}

// The terminal's output into the log until no process is left in the
// session (the restored tree, re-parented here, included).
void Relay(int master, pid_t c, int log) {
  fcntl(master, F_SETFL, fcntl(master, F_GETFL) | O_NONBLOCK);
  bool open_master = true;
  bool children = true;
  while (children) {
    if (open_master) {
      pollfd p = {master, POLLIN, 0};
      // A second at most between reaps; output is written as it comes.
      if (poll(&p, 1, 1000) > 0) open_master = Drain(master, log);
      children = Reap(c, log, false);
    } else {
      children = Reap(c, log, true);
    }
  }
  if (open_master) Drain(master, log);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (int rc = ParseArgs(argc, argv, &args); rc >= 0) return rc;
  const int log = open(args.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log < 0) {
    perror(args.log_path.c_str());
    return 1;
  }

  // The caller waits for this process only: the rest runs in a child,
  // re-parented to init (or the caller's subreaper) when this one exits.
  const pid_t detached = fork();
  if (detached < 0) Fail(log, "fork");
  if (detached > 0) return 0;

  int master = -1;
  const int slave = NewSessionTerminal(log, &master);
  const pid_t c = fork();
  if (c < 0) Fail(log, "fork");
  if (c == 0) {
    signal(SIGHUP, SIG_DFL);
    if (dup2(slave, 0) < 0 || dup2(slave, 1) < 0 || dup2(slave, 2) < 0) Fail(log, "dup2");
    if (slave > 2) close(slave);
    execl(args.criu.c_str(), args.criu.c_str(), "swrk", args.swrk_fd.c_str(),
          static_cast<char*>(nullptr));
    Fail(log, "exec " + args.criu);
  }
  close(slave);
  close(static_cast<int>(args.sk));
  Relay(master, c, log);
  Say(log, "no process left in session " + std::to_string(getpid()));
  return 0;
}
