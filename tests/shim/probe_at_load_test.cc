// The thread probe's install when librdmavirt.so is loaded
// (shim/abi/signal_interpose.cc), seen from a program started under it the
// way a user starts one: exec'd with LD_PRELOAD, its signal mask
// inherited from its parent. A pause asks every thread with the probe's
// signal, so no thread may have it blocked, however the program or its
// launcher set masks before the first verbs call; and the environment
// chooses the signal or turns the probe off.
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

struct Seen {
  bool handled = false;
  bool main_blocked = false;
  bool thread_blocked = false;
};

struct Outcome {
  int status = -1;
  std::string out;
  std::map<int, Seen> signals;
};

// Runs the helper under the shim with `env` added, the signals in
// `blocked` blocked across its exec, and `args`.
Outcome RunHelper(const std::vector<std::string>& env, const std::vector<int>& blocked,
                  const std::vector<std::string>& args) {
  Outcome r;
  int out[2];
  if (pipe(out) != 0) return r;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    close(out[1]);
    sigset_t set;
    sigemptyset(&set);
    for (int s : blocked) sigaddset(&set, s);
    syscall(SYS_rt_sigprocmask, SIG_BLOCK, &set, nullptr, _NSIG / 8);
    std::vector<std::string> e = env;
    e.push_back(std::string("LD_PRELOAD=") + RDMAVIRT_SHIM_PATH);
    std::vector<char*> envp;
    for (std::string& s : e) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> a = args;
    a.insert(a.begin(), RDMAVIRT_HELPER_PATH);
    std::vector<char*> argv;
    for (std::string& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    execve(RDMAVIRT_HELPER_PATH, argv.data(), envp.data());
    _exit(127);
  }
  close(out[1]);
  char buf[512];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof buf)) > 0) r.out.append(buf, static_cast<size_t>(n));
  close(out[0]);
  waitpid(pid, &r.status, 0);
  int sig, handled, main_blocked, thread_blocked;
  const char* p = r.out.c_str();
  int used = 0;
  while (sscanf(p, "%d handled=%d main_blocked=%d thread_blocked=%d\n%n", &sig, &handled,
                &main_blocked, &thread_blocked, &used) == 4) {
    r.signals[sig] = {handled == 1, main_blocked == 1, thread_blocked == 1};
    p += used;
  }
  return r;
}

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define RDMAVIRT_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RDMAVIRT_SANITIZED 1
#endif

// A sanitized librdmavirt.so cannot be preloaded: the sanitizer's runtime
// looks its interceptors up with dlsym before it has initialized, and the
// shim's dlsym (dl_interpose.cc), instrumented, faults there.
class ProbeAtLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef RDMAVIRT_SANITIZED
    GTEST_SKIP() << "a sanitized librdmavirt.so cannot be preloaded (its dlsym runs before the "
                    "sanitizer's runtime is initialized); the release build runs these";
#endif
  }
};

// That the main thread and the thread it made after it both block `sig`,
// or both leave it open.
void ExpectBlockedInBoth(const Outcome& r, int sig, bool blocked, const std::string& why = "") {
  ASSERT_EQ(r.signals.count(sig), 1u) << why << r.out;
  EXPECT_EQ(r.signals.at(sig).main_blocked, blocked) << why << "signal " << sig << " in main";
  EXPECT_EQ(r.signals.at(sig).thread_blocked, blocked) << why << "signal " << sig << " in a thread";
}

const int kProbe = SIGRTMAX - 2;  // the default (thread_probe.h)
const int kOther = SIGRTMAX - 4;

TEST_F(ProbeAtLoadTest, AMaskInheritedAcrossExecDoesNotHoldTheSignalBack) {
  const Outcome r = RunHelper({}, {kProbe, SIGUSR1}, {std::to_string(kProbe), "10"});
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_EQ(r.signals.count(kProbe), 1u) << r.out;
  EXPECT_TRUE(r.signals.at(kProbe).handled);
  ExpectBlockedInBoth(r, kProbe, false);
  // The rest of the inherited mask is the program's, untouched.
  ExpectBlockedInBoth(r, SIGUSR1, true);
}

TEST_F(ProbeAtLoadTest, AProgramThatBlocksEverySignalLeavesTheProbesOpen) {
  const Outcome r = RunHelper({}, {}, {"--block-all", std::to_string(kProbe), "10"});
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_EQ(r.signals.size(), 2u) << r.out;
  ExpectBlockedInBoth(r, kProbe, false);
  ExpectBlockedInBoth(r, SIGUSR1, true);
}

TEST_F(ProbeAtLoadTest, TheEnvironmentChoosesTheSignal) {
  const Outcome r = RunHelper({"RDMAVIRT_PROBE_SIGNAL=" + std::to_string(kOther)}, {kProbe, kOther},
                              {std::to_string(kProbe), std::to_string(kOther)});
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_EQ(r.signals.size(), 2u) << r.out;
  EXPECT_TRUE(r.signals.at(kOther).handled);
  ExpectBlockedInBoth(r, kOther, false);
  EXPECT_FALSE(r.signals.at(kProbe).handled);
  ExpectBlockedInBoth(r, kProbe, true);
}

TEST_F(ProbeAtLoadTest, MarksOrNoMigrationInstallNothing) {
  for (const char* env : {"RDMAVIRT_PAUSE=marks", "RDMAVIRT_MIGRATE=0"}) {
    const Outcome r = RunHelper({env}, {kProbe}, {std::to_string(kProbe)});
    ASSERT_EQ(r.status, 0) << env << ": " << r.out;
    ASSERT_EQ(r.signals.count(kProbe), 1u) << env << ": " << r.out;
    EXPECT_FALSE(r.signals.at(kProbe).handled) << env;
    ExpectBlockedInBoth(r, kProbe, true, std::string(env) + ": ");
  }
}

TEST_F(ProbeAtLoadTest, ASignalNumberThatCannotBeCaughtInstallsNothing) {
  for (const char* bad :
       {"RDMAVIRT_PROBE_SIGNAL=9", "RDMAVIRT_PROBE_SIGNAL=sixty", "RDMAVIRT_PROBE_SIGNAL=999"}) {
    const Outcome r = RunHelper({bad}, {}, {std::to_string(kProbe), "9"});
    ASSERT_EQ(r.status, 0) << bad << ": " << r.out;
    ASSERT_EQ(r.signals.size(), 2u) << bad << ": " << r.out;
    EXPECT_FALSE(r.signals.at(kProbe).handled) << bad;
    EXPECT_FALSE(r.signals.at(9).handled) << bad;
  }
}

}  // namespace
