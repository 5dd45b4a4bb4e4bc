// The thread probe (shim/datapath/thread_probe.h) against real threads and a real
// signal: a thread inside a provider's code (a separate shared library
// here, as a provider is) keeps the pause waiting, whether it spins or is
// blocked in a write(2) that the signal must not break; threads in the
// application's own code, running or blocked, do not, and a thread
// blocked in poll(2) is not even signalled (no EINTR). A thread that
// blocks the signal behind the shim's back, or stays inside, is reported.
#include "shim/datapath/thread_probe.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "shim/datapath/probe_answer.h"

extern "C" int ProbeProviderSpin(std::atomic<int>* state);
extern "C" long ProbeProviderWrite(int fd, const void* buf, unsigned long n);

namespace rdmavirt::shim {
namespace {

std::vector<const void*> Provider() {
  return {reinterpret_cast<const void*>(&ProbeProviderSpin),
          reinterpret_cast<const void*>(&ProbeProviderWrite)};
}

class ThreadProbeTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    std::string why;
    ASSERT_TRUE(InstallThreadProbe(&why)) << why;
  }
};

TEST_F(ThreadProbeTest, InstallsOnceAndKeepsItsSignal) {
  std::string why;
  const int sig = ThreadProbeSignal();
  EXPECT_EQ(sig, SIGRTMAX - 2);
  EXPECT_TRUE(InstallThreadProbe(&why)) << "installing again over its own handler: " << why;
  EXPECT_EQ(ThreadProbeSignal(), sig);
}

// Until thread `tid` is blocked in system call `nr` (its syscall file).
void WaitBlockedIn(pid_t tid, long nr) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", tid);
  for (;;) {
    char buf[64] = {};
    const int fd = open(path, O_RDONLY);
    const ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
    if (fd >= 0) close(fd);
    if (n > 0 && atol(buf) == nr) return;
    std::this_thread::yield();
  }
}

TEST_F(ThreadProbeTest, ThreadsInTheApplicationsOwnCodeAreOutside) {
  std::atomic<bool> stop{false};
  std::thread spinner([&] {
    while (!stop.load()) {
    }
  });
  int pfd[2];
  ASSERT_EQ(pipe(pfd), 0);
  // Blocked in poll(2): left alone, so its poll ends with the data, never
  // with EINTR.
  std::atomic<pid_t> poller_tid{0};
  std::atomic<int> poll_rc{-2};
  std::atomic<int> poll_errno{0};
  std::thread poller([&] {
    poller_tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
    pollfd p{pfd[0], POLLIN, 0};
    const int rc = poll(&p, 1, 20000);
    poll_errno.store(errno);
    poll_rc.store(rc);
  });
  while (poller_tid.load() == 0) std::this_thread::yield();
  WaitBlockedIn(poller_tid.load(), SYS_poll);
  const uint64_t inside_before = ThreadProbeInsideAnswers();
  std::string why;
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(WaitOutsideProviders(Provider(), 2000, &why)) << why;
  EXPECT_EQ(ThreadProbeInsideAnswers(), inside_before) << "a thread answered inside";
  ASSERT_EQ(write(pfd[1], "x", 1), 1);
  poller.join();
  EXPECT_EQ(poll_rc.load(), 1) << "errno " << poll_errno.load();
  stop.store(true);
  spinner.join();
  close(pfd[0]);
  close(pfd[1]);
}

// `enter` runs on a thread of its own and is inside the provider once
// `inside` is true; `release` lets it out, once the probe has found a
// thread inside. The wait must not return before the release.
template <typename Enter, typename Release>
void ExpectWaitFor(Enter enter, Release release, std::atomic<bool>& inside, const char* what) {
  std::thread t(enter);
  while (!inside.load()) std::this_thread::yield();
  const uint64_t inside_before = ThreadProbeInsideAnswers();
  std::atomic<bool> released{false};
  std::atomic<bool> returned{false};
  std::thread releaser([&] {
    while (ThreadProbeInsideAnswers() == inside_before && !returned.load())
      std::this_thread::yield();
    released.store(true);
    release();
  });
  std::string why;
  EXPECT_TRUE(WaitOutsideProviders(Provider(), 20000, &why)) << why;
  EXPECT_TRUE(released.load()) << "the wait returned while " << what;
  returned.store(true);
  releaser.join();
  t.join();
}

TEST_F(ThreadProbeTest, AThreadSpinningInsideAProviderIsWaitedFor) {
  std::atomic<int> state{0};
  std::atomic<bool> inside{false};
  std::thread watcher([&] {
    while (state.load() != 1) std::this_thread::yield();
    inside.store(true);
  });
  ExpectWaitFor([&] { EXPECT_EQ(ProbeProviderSpin(&state), 7); }, [&] { state.store(2); }, inside,
                "a thread spun inside the provider");
  watcher.join();
}

TEST_F(ThreadProbeTest, AThreadBlockedInAProvidersWriteIsWaitedForAndItsWriteCompletes) {
  int pfd[2];
  ASSERT_EQ(pipe(pfd), 0);
  const int cap = fcntl(pfd[1], F_GETPIPE_SZ);
  ASSERT_GT(cap, 0);
  std::vector<char> fill(static_cast<size_t>(cap), 'a');
  ASSERT_EQ(write(pfd[1], fill.data(), fill.size()), cap);  // full: the next write blocks
  std::vector<char> more(4096, 'b');
  std::atomic<bool> inside{false};
  std::atomic<long> wrote{0};
  std::atomic<pid_t> tid{0};
  std::thread watcher([&] {
    // Inside once the writer is blocked in write(2) (its syscall file says so).
    while (tid.load() == 0) std::this_thread::yield();
    WaitBlockedIn(tid.load(), SYS_write);
    inside.store(true);
  });
  ExpectWaitFor(
      [&] {
        tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
        wrote.store(ProbeProviderWrite(pfd[1], more.data(), more.size()));
      },
      [&] {
        std::vector<char> sink(static_cast<size_t>(cap));
        ASSERT_EQ(read(pfd[0], sink.data(), sink.size()), cap);
      },
      inside, "a thread was blocked in the provider's write");
  watcher.join();
  EXPECT_EQ(wrote.load(), 4096) << "the signal broke the provider's write";
  close(pfd[0]);
  close(pfd[1]);
}

TEST_F(ThreadProbeTest, AThreadThatStaysInsideIsReportedAtTheDeadline) {
  std::atomic<int> state{0};
  std::thread t([&] { ProbeProviderSpin(&state); });
  while (state.load() != 1) std::this_thread::yield();
  std::string why;
  EXPECT_FALSE(WaitOutsideProviders(Provider(), 200, &why));
  EXPECT_NE(why.find("stayed inside a provider's code"), std::string::npos) << why;
  state.store(2);
  t.join();
  EXPECT_TRUE(WaitOutsideProviders(Provider(), 2000, &why)) << why;
}

TEST_F(ThreadProbeTest, AThreadThatBlocksTheSignalBehindTheShimsBackIsReported) {
  std::atomic<bool> blocked{false};
  std::atomic<bool> stop{false};
  std::thread t([&] {
    // The raw system call: no interposer sees it.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, ThreadProbeSignal());
    syscall(SYS_rt_sigprocmask, SIG_BLOCK, &set, nullptr, 8);
    blocked.store(true);
    while (!stop.load()) {
    }
  });
  while (!blocked.load()) std::this_thread::yield();
  std::string why;
  EXPECT_FALSE(WaitOutsideProviders(Provider(), 2000, &why));
  EXPECT_NE(why.find("blocks signal " + std::to_string(ThreadProbeSignal())), std::string::npos)
      << why;
  stop.store(true);
  t.join();
}

TEST_F(ThreadProbeTest, AReplacedHandlerIsReported) {
  const int sig = ThreadProbeSignal();
  struct sigaction mine, old;
  memset(&mine, 0, sizeof(mine));
  mine.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(sig, &mine, &old), 0);
  std::string why;
  EXPECT_FALSE(WaitOutsideProviders(Provider(), 2000, &why));
  EXPECT_NE(why.find("replaced the handler of signal"), std::string::npos) << why;
  ASSERT_EQ(sigaction(sig, &old, nullptr), 0);
  EXPECT_TRUE(WaitOutsideProviders(Provider(), 2000, &why)) << why;
}

// The order a move in the lab met: thread A showed the signal blocked
// because its handler had just begun, so the control thread went on to
// thread B; B answered, then A's handler finished. A's late answer must
// not take the place of B's, or the control thread waits for B until
// its deadline ("did not answer the pause's signal").
TEST(ProbeAnswerTest, ALateAnswerOfAnEarlierProbeLeavesTheAwaitedOnesAlone) {
  ProbeAnswer answer;
  answer.Open(1);  // to thread A
  ASSERT_TRUE(answer.Awaits(1));  // A's handler begins
  answer.Open(2);  // A passed over; to thread B
  EXPECT_FALSE(answer.Awaits(1));
  EXPECT_EQ(answer.Read(2), ProbeAnswer::kNone);
  EXPECT_TRUE(answer.Answer(2, 1));   // B: outside
  EXPECT_FALSE(answer.Answer(1, 2));  // A, late: inside
  EXPECT_EQ(answer.Read(2), 1);
  EXPECT_FALSE(answer.Answer(2, 2)) << "a probe answers once";
  EXPECT_EQ(answer.Read(2), 1);
}

TEST(ProbeAnswerTest, NothingIsAwaitedBeforeTheFirstProbe) {
  ProbeAnswer answer;
  EXPECT_FALSE(answer.Awaits(1));
  EXPECT_FALSE(answer.Answer(1, 1));
  EXPECT_EQ(answer.Read(1), ProbeAnswer::kNone);
}

}  // namespace
}  // namespace rdmavirt::shim
