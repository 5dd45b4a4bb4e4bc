// Completion events and extended CQs across a move, over FakeBackend: an
// event the application has not acknowledged does not hold up a release
// (libibverbs' destroy of a CQ waits for it), a thread blocked in
// ibv_get_cq_event through the whole move gets the event for what the
// pause held, and completions held for a CQ made with ibv_create_cq_ex
// are handed out exactly once, through ibv_start_poll or ibv_poll_cq.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shim/migration/epoll_regs.h"
#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

using std::chrono::steady_clock;

// P, whose QP completes on a CQ of the test's, and Q, connected; P moves.
class EventsTest : public TwoEndpointsTest {
 protected:
  explicit EventsTest(bool blocking = false) { fake_.set_blocking_channels(blocking); }

  void Connect(ibv_cq* pcq) {
    pqp_ = pdev_->Qp(IBV_QPT_RC, 1, nullptr, pcq, pcq);
    qqp_ = qdev_->Qp(IBV_QPT_RC);
    ASSERT_EQ(ToRts(p_, pqp_, qqp_->qp_num, qdev_->gid), 0);
    ASSERT_EQ(ToRts(q_, qqp_, pqp_->qp_num, pdev_->gid), 0);
  }
  void PostRecvP(uint64_t wr_id) {
    ASSERT_EQ(PostRecvOf(pqp_, wr_id, pbuf_ + 64 * (wr_id % 16), 64, pmr_), 0);
  }
  void SendToP(uint64_t wr_id) { ASSERT_EQ(Send(qqp_, wr_id, qbuf_, qmr_, "hello"), 0); }
  // Acknowledgements the fake received for `real`, summed.
  unsigned AckedToFake(const ibv_cq* real) {
    unsigned n = 0;
    for (const auto& [cq, count] : fake_.acked_cq_events())
      if (cq == real) n += count;
    return n;
  }
};

TEST_F(EventsTest, AnEventNotYetAcknowledgedDoesNotHoldUpAReleaseAndItsAckIsAbsorbed) {
  // ibv_rc_pingpong --events acknowledges all its events only at the end.
  ibv_comp_channel* ch = pdev_->Channel();
  ibv_cq* cq = pdev_->Cq(ch);
  Connect(cq);
  PostRecvP(1);
  PostRecvP(2);
  ASSERT_EQ(ibv_req_notify_cq(cq, 0), 0);
  SendToP(10);
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  ASSERT_EQ(p_.GetCqEvent(ch, &ev_cq, &ev_ctx), 0);
  EXPECT_EQ(ev_cq, cq);
  EXPECT_EQ(Drain(cq).size(), 1u);
  const ibv_cq* old_real = ShimCq(cq)->real;

  Quiesce();
  ReleaseRestoreResume();  // destroys the real CQ: blocked_destroys() stays 0
  EXPECT_EQ(AckedToFake(old_real), 1u) << "the release acknowledged it for the application";

  // After the move: a new event, and the application acknowledges both.
  ASSERT_EQ(ibv_req_notify_cq(cq, 0), 0);
  SendToP(11);
  ASSERT_EQ(p_.GetCqEvent(ch, &ev_cq, &ev_ctx), 0);
  EXPECT_EQ(ev_cq, cq);
  ASSERT_EQ(Drain(cq).size(), 1u);
  const ibv_cq* new_real = ShimCq(cq)->real;
  p_.AckCqEvents(cq, 2);
  EXPECT_EQ(AckedToFake(new_real), 1u) << "only the event the new CQ delivered reaches it";
}

// An event loop waits on the completion channel's fd and the device's
// async fd with epoll (UCX's async thread does). The release closes both,
// which takes them out of every epoll set; the restore must put them back
// with the events and data the application gave, or the loop is never
// woken again (and UCX's epoll_ctl(DEL) at teardown fails).
TEST_F(EventsTest, TheApplicationsEpollSetsHoldTheEventFdsAgainAfterAMove) {
  ibv_comp_channel* ch = pdev_->Channel();
  ibv_cq* cq = pdev_->Cq(ch);
  Connect(cq);
  const int async_fd = ch->context->async_fd;
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  ASSERT_GE(ep, 0);
  epoll_event on_channel{};
  on_channel.events = EPOLLIN | EPOLLET;
  on_channel.data.u64 = 0xc0ffee;
  ASSERT_EQ(epoll_ctl(ep, EPOLL_CTL_ADD, ch->fd, &on_channel), 0);
  epoll_event on_async{};
  on_async.events = EPOLLIN;
  on_async.data.u64 = 0xa5;
  ASSERT_EQ(epoll_ctl(ep, EPOLL_CTL_ADD, async_fd, &on_async), 0);
  Quiesce();
  ReleaseRestoreResume();
  const std::vector<EpollRegistration> regs = FindEpollRegistrations({ch->fd, async_fd});
  ASSERT_EQ(regs.size(), 2u);
  for (const EpollRegistration& r : regs) {
    EXPECT_EQ(r.epfd, ep);
    const epoll_event& given = r.fd == ch->fd ? on_channel : on_async;
    // The kernel adds EPOLLERR and EPOLLHUP to every registration.
    EXPECT_EQ(r.events, given.events | EPOLLERR | EPOLLHUP) << "fd " << r.fd;
    // A copy: epoll_event is packed, its u64 is not aligned for a reference.
    const uint64_t data = given.data.u64;
    EXPECT_EQ(r.data, data) << "fd " << r.fd;
  }
  // And the loop is woken by the next completion event.
  PostRecvP(1);
  ASSERT_EQ(ibv_req_notify_cq(cq, 0), 0);
  SendToP(10);
  epoll_event got{};
  ASSERT_EQ(epoll_wait(ep, &got, 1, 5000), 1);
  const uint64_t woken = got.data.u64;
  EXPECT_EQ(woken, 0xc0ffeeu);
  close(ep);
}

class BlockingEventsTest : public EventsTest {
 protected:
  BlockingEventsTest() : EventsTest(/*blocking=*/true) {}
};

TEST_F(BlockingEventsTest, AThreadBlockedInGetCqEventThroughAMoveGetsTheEventForWhatThePauseHeld) {
  ibv_comp_channel* ch = pdev_->Channel();
  ibv_cq* cq = pdev_->Cq(ch);
  Connect(cq);
  PostRecvP(1);
  // A completion that nobody has polled when the pause takes it in.
  SendToP(10);
  Quiesce();
  EXPECT_EQ(p_.Describe().pending_completions, 1u);

  // The application arms the CQ and waits, as an event-driven loop does.
  std::atomic<int> got{0};
  std::thread app([&] {
    if (ibv_req_notify_cq(cq, 0) != 0) return;
    ibv_cq* ev_cq = nullptr;
    void* ev_ctx = nullptr;
    if (p_.GetCqEvent(ch, &ev_cq, &ev_ctx) != 0 || ev_cq != cq) return;
    p_.AckCqEvents(cq, 1);
    ibv_wc wc[4];
    for (const auto end = steady_clock::now() + std::chrono::seconds(5);
         got.load() == 0 && steady_clock::now() < end;) {
      const int n = ibv_poll_cq(cq, 4, wc);
      if (n > 0 && wc[0].wr_id == 1 && wc[0].status == IBV_WC_SUCCESS) got.store(n);
    }
  });
  // Until it waits in the channel.
  const Channel* shadow_ch = reinterpret_cast<const Channel*>(ch);
  for (const auto end = steady_clock::now() + std::chrono::seconds(5); steady_clock::now() < end;) {
    {
      std::lock_guard<std::mutex> lock(const_cast<Channel*>(shadow_ch)->mu);
      if (shadow_ch->in_use == 1) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // The steps after the release wait for an application thread: the
  // waiter is one (a program whose only thread waits here must reopen the
  // device itself, with its own credentials).
  p_.set_app_thread_wait_ms(5000);
  ReleaseRestoreResume();
  app.join();
  EXPECT_EQ(got.load(), 1) << "the waiter did not get the held completion after the move";
  EXPECT_EQ(p_.steps_on_app_threads(), 2) << "the restore and the resume ran on the waiter";
}

// A thread's state letter in /proc (S: asleep in a system call).
char TaskState(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t end = line.rfind(')');
  return end == std::string::npos || end + 2 >= line.size() ? '?' : line[end + 2];
}

std::atomic<int> g_usr1_taken{0};
void OnUsr1(int) { g_usr1_taken.fetch_add(1); }

// SIGUSR1's handler, installed with `flags` for the test's life.
class Usr1Handler {
 public:
  explicit Usr1Handler(int flags) {
    struct sigaction sa {};
    sa.sa_handler = OnUsr1;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, &old_);
    g_usr1_taken.store(0);
  }
  ~Usr1Handler() { sigaction(SIGUSR1, &old_, nullptr); }

 private:
  struct sigaction old_ {};
};

// A thread waits in ibv_get_cq_event on an armed CQ with nothing to
// deliver, and takes SIGUSR1 there. libibverbs waits in read(2), which
// a handler installed without SA_RESTART ends with EINTR and one with
// SA_RESTART does not; the shim waits in poll(2), which every handler
// ends. What the waiter returned, or 0 with `event` true when only the
// completion sent after the signal ended its wait.
struct WaitOutcome {
  int rc = 1;
  int err = 0;
  bool event = false;
  int handled = 0;
};

class SignalledWaitTest : public EventsTest {
 protected:
  SignalledWaitTest() : EventsTest(/*blocking=*/true) {}

  WaitOutcome SignalTheWaiter() {
    ibv_comp_channel* ch = pdev_->Channel();
    ibv_cq* cq = pdev_->Cq(ch);
    Connect(cq);
    PostRecvP(1);
    WaitOutcome out;
    std::atomic<pid_t> tid{0};
    std::atomic<bool> returned{false};
    std::thread app([&] {
      tid.store(gettid());
      if (ibv_req_notify_cq(cq, 0) != 0) return;
      ibv_cq* ev_cq = nullptr;
      void* ev_ctx = nullptr;
      errno = 0;
      out.rc = p_.GetCqEvent(ch, &ev_cq, &ev_ctx);
      out.err = errno;
      out.event = out.rc == 0 && ev_cq == cq;
      if (out.event) p_.AckCqEvents(cq, 1);
      returned.store(true);
    });
    // Until it waits in the channel, asleep.
    const Channel* shadow_ch = reinterpret_cast<const Channel*>(ch);
    for (const auto end = steady_clock::now() + std::chrono::seconds(5);
         steady_clock::now() < end;) {
      bool in_use;
      {
        std::lock_guard<std::mutex> lock(const_cast<Channel*>(shadow_ch)->mu);
        in_use = shadow_ch->in_use == 1;
      }
      if (in_use && tid.load() != 0 && TaskState(tid.load()) == 'S') break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    pthread_kill(app.native_handle(), SIGUSR1);
    // Returned by the signal, or still waiting a while after it.
    for (const auto end = steady_clock::now() + std::chrono::seconds(2);
         !returned.load() && steady_clock::now() < end;)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    out.handled = g_usr1_taken.load();
    if (!returned.load()) SendToP(10);  // an event, so that the waiter returns
    app.join();
    return out;
  }
};

TEST_F(SignalledWaitTest, AHandlerWithoutSaRestartEndsTheWaitWithEintrAsItEndsLibibverbsRead) {
  Usr1Handler handler(/*flags=*/0);
  const WaitOutcome out = SignalTheWaiter();
  EXPECT_EQ(out.handled, 1);
  EXPECT_EQ(out.rc, -1) << "the wait went on after the signal (event: " << out.event << ")";
  EXPECT_EQ(out.err, EINTR);
}

TEST_F(SignalledWaitTest, AHandlerWithSaRestartLeavesTheWaitToTheEventAsLibibverbsRead) {
  Usr1Handler handler(SA_RESTART);
  const WaitOutcome out = SignalTheWaiter();
  EXPECT_EQ(out.handled, 1);
  EXPECT_EQ(out.rc, 0) << "errno " << out.err;
  EXPECT_TRUE(out.event);
}

// UCX makes its channel's fd (and the device's async fd) non-blocking and
// asks for an event whenever it has nothing else to do, expecting EAGAIN
// when none is there. The fds re-created by a restore must be non-blocking
// too: before, a restored UCX rank waited in ibv_get_cq_event forever.
TEST_F(BlockingEventsTest, FdsTheApplicationMadeNonBlockingStaySoAcrossAMove) {
  ibv_comp_channel* ch = pdev_->Channel();
  ibv_cq* cq = pdev_->Cq(ch);
  Connect(cq);
  ibv_context* ctx = ch->context;
  for (int fd : {ch->fd, ctx->async_fd})
    ASSERT_EQ(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK), 0);
  Quiesce();
  ReleaseRestoreResume();
  for (int fd : {ch->fd, ctx->async_fd})
    EXPECT_NE(fcntl(fd, F_GETFL) & O_NONBLOCK, 0) << "fd " << fd;
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  errno = 0;
  EXPECT_EQ(p_.GetCqEvent(ch, &ev_cq, &ev_ctx), -1) << "no event is there: it must not wait";
  EXPECT_EQ(errno, EAGAIN);
}

// ibv_rc_pingpong -e polls once per event and then waits for the next:
// the event owed for what a pause held must come when its poll can see
// it. (Woken while still paused, the poll found nothing, the re-arm was
// only noted, and the program waited forever.)
TEST_F(BlockingEventsTest, AWaiterWokenByTheResumeFindsTheHeldCompletionWhenItPolls) {
  ibv_comp_channel* ch = pdev_->Channel();
  ibv_cq* cq = pdev_->Cq(ch);
  Connect(cq);
  const Channel* shadow_ch = reinterpret_cast<const Channel*>(ch);
  for (int round = 0; round < 20; ++round) {
    PostRecvP(100 + round);
    SendToP(10);
    Drain(qdev_->cq);
    uint32_t drained = 0;
    ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
    ASSERT_EQ(p_.Describe().pending_completions, 1u);
    std::atomic<bool> got{false};
    std::atomic<bool> done{false};
    std::thread app([&] {
      // ibv_rc_pingpong's loop: arm once, then wait, acknowledge, arm, poll.
      if (ibv_req_notify_cq(cq, 0) != 0) return;
      while (!got.load()) {
        ibv_cq* ev_cq = nullptr;
        void* ev_ctx = nullptr;
        if (p_.GetCqEvent(ch, &ev_cq, &ev_ctx) != 0) break;
        p_.AckCqEvents(ev_cq, 1);
        if (done.load() || ibv_req_notify_cq(cq, 0) != 0) break;
        ibv_wc wc[4];
        const int n = ibv_poll_cq(cq, 4, wc);
        if (n > 0 && wc[0].wr_id == static_cast<uint64_t>(100 + round)) got.store(true);
      }
    });
    for (const auto end = steady_clock::now() + std::chrono::seconds(5);
         steady_clock::now() < end;) {
      {
        std::lock_guard<std::mutex> lock(const_cast<Channel*>(shadow_ch)->mu);
        if (shadow_ch->in_use == 1) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(p_.Resume().ok());
    for (const auto end = steady_clock::now() + std::chrono::seconds(2);
         !got.load() && steady_clock::now() < end;)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const bool in_time = got.load();
    done.store(true);
    if (!in_time) {  // an event, so that the waiter returns
      PostRecvP(999);
      SendToP(11);
    }
    app.join();
    ASSERT_TRUE(in_time) << "round " << round << ": the waiter never saw the held completion";
    Drain(cq);
  }
}

TEST_F(EventsTest, CompletionsHeldForAnExtendedCqAreHandedOutOnceThroughEitherPollingApi) {
  ibv_cq_ex* cqx = pdev_->CqEx();
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  Connect(cq);
  for (uint64_t i = 1; i <= 3; ++i) PostRecvP(i);
  for (uint64_t i = 10; i < 13; ++i) SendToP(i);
  Quiesce();  // three receive completions held in the shadow CQ
  EXPECT_EQ(p_.Describe().pending_completions, 3u);
  ibv_poll_cq_attr attr{};
  EXPECT_EQ(ibv_start_poll(cqx, &attr), ENOENT) << "paused: nothing to poll";
  ReleaseRestoreResume();

  // Two through one extended batch, with the readers of a held completion.
  ASSERT_EQ(ibv_start_poll(cqx, &attr), 0);
  EXPECT_EQ(cqx->wr_id, 1u);
  EXPECT_EQ(cqx->status, IBV_WC_SUCCESS);
  EXPECT_EQ(ibv_wc_read_opcode(cqx), IBV_WC_RECV);
  EXPECT_EQ(ibv_wc_read_byte_len(cqx), 6u);
  EXPECT_EQ(ibv_wc_read_qp_num(cqx), pqp_->qp_num);
  ASSERT_EQ(ibv_next_poll(cqx), 0);
  EXPECT_EQ(cqx->wr_id, 2u);
  ibv_end_poll(cqx);
  // The third through ibv_poll_cq; then nothing is left either way.
  std::vector<ibv_wc> rest = Drain(cq);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].wr_id, 3u);
  EXPECT_EQ(ibv_start_poll(cqx, &attr), ENOENT);

  // A new completion after the held ones: a batch that runs from held
  // completions into the real CQ's.
  PostRecvP(4);
  PostRecvP(5);
  SendToP(20);
  Quiesce();  // holds 4
  ReleaseRestoreResume();
  SendToP(21);  // 5, in the real CQ
  ASSERT_EQ(ibv_start_poll(cqx, &attr), 0);
  std::vector<uint64_t> ids{cqx->wr_id};
  while (ibv_next_poll(cqx) == 0) ids.push_back(cqx->wr_id);
  ibv_end_poll(cqx);
  EXPECT_EQ(ids, (std::vector<uint64_t>{4, 5}));
  EXPECT_TRUE(Drain(cq).empty());
}

}  // namespace
}  // namespace rdmavirt::shim::testing
