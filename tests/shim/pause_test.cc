// The data path's pause (shim/datapath/pause.h): a set flag keeps every thread out
// of gated calls once Close returns, Close waits for the calls in flight
// and gives up on one that never ends, and exited threads' marks leave
// the registry.
#include "shim/datapath/pause.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace rdmavirt::shim {
namespace {

class PauseTest : public ::testing::Test {
 public:
  void SetUp() override {
    ASSERT_TRUE(AsymmetricFenceAvailable());
    paused_.Set(Path::kMarked);
  }
  // What the shim does to pause: the objects' flags, then Close.
  bool Pause(uint32_t timeout_ms, std::string* why) {
    paused_.SetPaused(true);
    if (gate_.Close(timeout_ms, why)) return true;
    paused_.SetPaused(false);
    return false;
  }
  void Resume() {
    paused_.SetPaused(false);
    gate_.Open();
  }
  PauseGate gate_;
  PathState paused_;  // an object on the marked path
};

TEST_F(PauseTest, AnUnregisteredThreadTakesTheSlowPathWhichRegistersIt) {
  std::thread([&] {
    EXPECT_FALSE(tls_thread_mark.registered);
    EXPECT_FALSE(EnterMarked(paused_)) << "the fast entry needs a registered mark";
    EXPECT_EQ(tls_thread_mark.depth.load(), 0u) << "a refused entry lowers its mark";
    ASSERT_TRUE(Enter(paused_));
    EXPECT_TRUE(tls_thread_mark.registered);
    EXPECT_EQ(tls_thread_mark.depth.load(), 1u);
    LeaveFast();
    EXPECT_TRUE(EnterMarked(paused_));
    LeaveFast();
    EXPECT_EQ(tls_thread_mark.depth.load(), 0u);
  }).join();
}

// EnterGate: the marked path and the translating one inside the raised
// mark; anything else (an unregistered thread, a paused object) with the
// mark lowered.
TEST_F(PauseTest, TheGateTakesBothPathsInsideTheMarkAndNothingElse) {
  std::thread([&] {
    PathState translated;
    translated.Set(Path::kTranslated);
    EXPECT_EQ(EnterGate(translated), Gate::kSlow) << "an unregistered thread";
    EXPECT_EQ(tls_thread_mark.depth.load(), 0u);
    ASSERT_TRUE(Enter(paused_));  // registers
    LeaveFast();
    EXPECT_EQ(EnterGate(paused_), Gate::kMarked);
    EXPECT_EQ(tls_thread_mark.depth.load(), 1u);
    LeaveFast();
    EXPECT_EQ(EnterGate(translated), Gate::kTranslated);
    EXPECT_EQ(tls_thread_mark.depth.load(), 1u);
    LeaveFast();
    PathState direct;
    direct.Set(Path::kDirect);
    EXPECT_EQ(EnterGate(direct), Gate::kSlow);
    translated.SetPaused(true);
    EXPECT_EQ(EnterGate(translated), Gate::kSlow) << "a paused object";
    EXPECT_EQ(tls_thread_mark.depth.load(), 0u);
  }).join();
}

TEST_F(PauseTest, EntriesFailWhilePausedAndWorkAgainAfter) {
  std::string why;
  ASSERT_TRUE(Enter(paused_));
  LeaveFast();
  ASSERT_TRUE(Pause(100, &why)) << why;
  EXPECT_TRUE(gate_.closed());
  EXPECT_FALSE(EnterMarked(paused_));
  EXPECT_FALSE(Enter(paused_));
  EXPECT_FALSE(EnterBatch(paused_));
  EXPECT_EQ(tls_thread_mark.depth.load(), 0u) << "a refused entry lowers its mark";
  EXPECT_EQ(tls_thread_mark.batches.load(), 0u);
  Resume();
  paused_.Set(Path::kTranslated);
  EXPECT_FALSE(EnterMarked(paused_)) << "the fast entry is for the marked path only";
  EXPECT_TRUE(Enter(paused_)) << "the slow one for any";
  LeaveFast();
  paused_.Set(Path::kMarked);
  ASSERT_TRUE(EnterBatch(paused_));
  ASSERT_TRUE(EnterMarked(paused_));  // a post inside a polling batch
  LeaveFast();
  EXPECT_EQ(tls_thread_mark.batches.load(), 1u) << "the batch still holds the mark";
  LeaveBatch();
  EXPECT_EQ(tls_thread_mark.batches.load(), 0u);
}

// A thread stays inside (entered with `enter`, left with `leave`) until 50
// ms after the pause began: the pause must not return before it has left.
template <typename Enter, typename Leave>
void ExpectPauseWaitsFor(PauseTest* test, Enter enter, Leave leave, const char* what) {
  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};
  std::atomic<bool> left{false};
  std::thread t([&] {
    ASSERT_TRUE(enter());
    inside.store(true);
    while (!release.load()) std::this_thread::yield();
    left.store(true);
    leave();
  });
  while (!inside.load()) std::this_thread::yield();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release.store(true);
  });
  std::string why;
  EXPECT_TRUE(test->Pause(10000, &why)) << why;
  EXPECT_TRUE(left.load()) << "Close returned while " << what;
  releaser.join();
  t.join();
  test->Resume();
}

TEST_F(PauseTest, CloseWaitsForACallInFlight) {
  ExpectPauseWaitsFor(
      this, [this] { return Enter(paused_); }, [] { LeaveFast(); }, "a thread was inside a call");
}

TEST_F(PauseTest, CloseWaitsForAnOpenBatch) {
  ExpectPauseWaitsFor(
      this, [this] { return EnterBatch(paused_); }, [] { LeaveBatch(); }, "a batch was open");
}

TEST_F(PauseTest, CloseGivesUpOnACallThatNeverEndsAndOpensAgain) {
  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};
  std::thread t([&] {
    ASSERT_TRUE(Enter(paused_));
    inside.store(true);
    while (!release.load()) std::this_thread::yield();
    LeaveFast();
  });
  while (!inside.load()) std::this_thread::yield();
  std::string why;
  EXPECT_FALSE(Pause(50, &why));
  EXPECT_NE(why.find("stayed inside"), std::string::npos) << why;
  EXPECT_FALSE(gate_.closed());
  release.store(true);
  t.join();
}

TEST_F(PauseTest, NoThreadIsInsideWhilePaused) {
  // Each worker bumps its counter inside gated calls; while paused the
  // counters must not move.
  constexpr int kWorkers = 3;
  std::atomic<bool> stop{false};
  std::vector<std::atomic<uint64_t>> counters(kWorkers);
  std::vector<std::thread> workers;
  for (int i = 0; i < kWorkers; ++i) {
    workers.emplace_back([&, i] {
      while (!stop.load(std::memory_order_relaxed)) {
        if (!EnterMarked(paused_) && !Enter(paused_)) continue;
        counters[i].store(counters[i].load(std::memory_order_relaxed) + 1,
                          std::memory_order_relaxed);
        LeaveFast();
      }
    });
  }
  int violations = 0;
  for (int round = 0; round < 200; ++round) {
    std::string why;
    ASSERT_TRUE(Pause(10000, &why)) << why;
    std::vector<uint64_t> before;
    for (auto& c : counters) before.push_back(c.load());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    for (int i = 0; i < kWorkers; ++i) violations += counters[i].load() != before[i];
    Resume();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  stop.store(true);
  for (std::thread& t : workers) t.join();
  EXPECT_EQ(violations, 0);
  for (auto& c : counters) EXPECT_GT(c.load(), 0u) << "a worker never got in";
}

TEST_F(PauseTest, AThreadThatExitedIsNotWaitedFor) {
  // Its mark leaves the registry with it: a pause afterwards neither
  // reads its memory nor waits for it.
  for (int i = 0; i < 50; ++i) {
    std::thread([&] {
      ASSERT_TRUE(Enter(paused_));
      LeaveFast();
    }).join();
  }
  std::string why;
  EXPECT_TRUE(Pause(1000, &why)) << why;
  Resume();
}

}  // namespace
}  // namespace rdmavirt::shim
