// The data path's pause (shim/pause.h): a closed gate keeps every thread
// out of gated calls, Close waits for the calls in flight and gives up
// on one that never ends, and exited threads' marks are reused.
#include "shim/pause.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace rdmavirt::shim {
namespace {

class PauseTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(AsymmetricFenceAvailable()); }
  PauseGate gate_;
};

TEST_F(PauseTest, EnterFailsWhileClosedAndWorksAgainAfterOpen) {
  std::string why;
  ASSERT_TRUE(gate_.Close(100, &why)) << why;
  EXPECT_EQ(gate_.Enter(), nullptr);
  EXPECT_EQ(tls_thread_mark->depth.load(), 0u) << "a refused Enter lowers its mark";
  gate_.Open();
  ThreadMark* m = gate_.Enter();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->depth.load(), 1u);
  PauseGate::Leave(m);
  EXPECT_EQ(m->depth.load(), 0u);
}

TEST_F(PauseTest, CloseWaitsForACallInFlight) {
  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};
  std::atomic<bool> left{false};
  std::thread t([&] {
    ThreadMark* m = gate_.Enter();
    ASSERT_NE(m, nullptr);
    inside.store(true);
    while (!release.load()) std::this_thread::yield();
    left.store(true);
    PauseGate::Leave(m);
  });
  while (!inside.load()) std::this_thread::yield();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release.store(true);
  });
  std::string why;
  EXPECT_TRUE(gate_.Close(10000, &why)) << why;
  EXPECT_TRUE(left.load()) << "Close returned while a thread was inside a call";
  releaser.join();
  t.join();
  gate_.Open();
}

TEST_F(PauseTest, CloseGivesUpOnACallThatNeverEndsAndOpensAgain) {
  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};
  std::thread t([&] {
    ThreadMark* m = gate_.Enter();
    ASSERT_NE(m, nullptr);
    inside.store(true);
    while (!release.load()) std::this_thread::yield();
    PauseGate::Leave(m);
  });
  while (!inside.load()) std::this_thread::yield();
  std::string why;
  EXPECT_FALSE(gate_.Close(50, &why));
  EXPECT_NE(why.find("stayed inside"), std::string::npos) << why;
  EXPECT_FALSE(gate_.closed());
  release.store(true);
  t.join();
}

TEST_F(PauseTest, NoThreadIsInsideWhileClosed) {
  // Each worker bumps a plain counter inside gated calls; while the gate
  // is closed the counter must not move.
  constexpr int kWorkers = 3;
  std::atomic<bool> stop{false};
  std::vector<std::atomic<uint64_t>> counters(kWorkers);
  std::vector<std::thread> workers;
  for (int i = 0; i < kWorkers; ++i) {
    workers.emplace_back([&, i] {
      while (!stop.load(std::memory_order_relaxed)) {
        ThreadMark* m = gate_.Enter();
        if (m == nullptr) continue;
        counters[i].store(counters[i].load(std::memory_order_relaxed) + 1,
                          std::memory_order_relaxed);
        PauseGate::Leave(m);
      }
    });
  }
  int violations = 0;
  for (int round = 0; round < 200; ++round) {
    std::string why;
    ASSERT_TRUE(gate_.Close(10000, &why)) << why;
    std::vector<uint64_t> before;
    for (auto& c : counters) before.push_back(c.load());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    for (int i = 0; i < kWorkers; ++i) violations += counters[i].load() != before[i];
    gate_.Open();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  stop.store(true);
  for (std::thread& t : workers) t.join();
  EXPECT_EQ(violations, 0);
  for (auto& c : counters) EXPECT_GT(c.load(), 0u) << "a worker never got in";
}

TEST_F(PauseTest, AnExitedThreadsMarkIsReused) {
  ThreadMark* first = nullptr;
  std::thread([&] {
    PauseGate::Leave(gate_.Enter());
    first = tls_thread_mark;
  }).join();
  ThreadMark* second = nullptr;
  std::thread([&] {
    PauseGate::Leave(gate_.Enter());
    second = tls_thread_mark;
  }).join();
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first, second);
}

}  // namespace
}  // namespace rdmavirt::shim
