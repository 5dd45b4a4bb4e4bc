// RecvLog: the journal of receives posted to a queue, as the application
// posted them, from which release re-posts the outstanding ones.
#include "shim/datapath/recv_log.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace rdmavirt::shim {
namespace {

ibv_recv_wr Wr(uint64_t id, ibv_sge* sges, int n) {
  ibv_recv_wr wr{};
  wr.wr_id = id;
  wr.sg_list = sges;
  wr.num_sge = n;
  return wr;
}

TEST(RecvLogTest, RecentReturnsTheLastPostsOldestFirstWithTheirSges) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 2, false));
  ibv_sge sges[2] = {{0x1000, 64, 0x501}, {0x2000, 32, 0x502}};
  for (uint64_t id = 1; id <= 3; ++id) {
    ibv_recv_wr wr = Wr(id, sges, id == 3 ? 2 : 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  const auto recent = log.Recent(2);
  ASSERT_EQ(recent.size(), 2u);
  EXPECT_EQ(recent[0]->wr_id, 2u);
  EXPECT_EQ(recent[1]->wr_id, 3u);
  ASSERT_EQ(recent[1]->num_sge, 2u);
  EXPECT_EQ(recent[1]->sge[1].addr, 0x2000u);
  EXPECT_EQ(recent[1]->sge[1].lkey, 0x502u);
}

TEST(RecvLogTest, HoldsAtLeastTheQueueDepthAfterWrapping) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, false));
  ibv_sge sge{0x1000, 8, 1};
  for (uint64_t id = 1; id <= 100; ++id) {
    ibv_recv_wr wr = Wr(id, &sge, 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  const auto recent = log.Recent(4);
  ASSERT_EQ(recent.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(recent[i]->wr_id, 97u + i);
}

TEST(RecvLogTest, RefusesMoreSgesThanTheQueueTakesAndUnpushForgets) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, false));
  ibv_sge sges[2] = {};
  ibv_recv_wr two = Wr(9, sges, 2);
  EXPECT_FALSE(log.Push(&two));
  ibv_recv_wr one = Wr(1, sges, 1);
  ibv_recv_wr other = Wr(2, sges, 1);
  ASSERT_TRUE(log.Push(&one));
  ASSERT_TRUE(log.Push(&other));
  log.Unpush(1);
  const auto recent = log.Recent(4);
  ASSERT_EQ(recent.size(), 1u);
  EXPECT_EQ(recent[0]->wr_id, 1u);
}

TEST(RecvLogTest, ConsumeFindsCompletionsInPostingOrder) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, true));
  const uint64_t ids[] = {7, 8, 7};
  for (int i = 0; i < 3; ++i) {
    ibv_sge sge{0x1000u + 0x100u * i, 8, 1};
    ibv_recv_wr wr = Wr(ids[i], &sge, 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  RecvLog::Taken first, second, third, none;
  ASSERT_TRUE(log.Consume(7, &first));
  ASSERT_TRUE(log.Consume(8, &second));
  ASSERT_TRUE(log.Consume(7, &third));
  EXPECT_EQ(first.sge[0].addr, 0x1000u);
  EXPECT_EQ(second.sge[0].addr, 0x1100u);
  EXPECT_EQ(third.sge[0].addr, 0x1200u);  // the repeated wr_id is the later post
  EXPECT_FALSE(log.Consume(7, &none));    // none left
}

// An SRQ's receives complete on the CQs of the QPs they went to: a later
// post's completion may be polled first, and the earlier one is still
// found.
TEST(RecvLogTest, ConsumeFindsAnEarlierPostAfterALaterOneWasTaken) {
  RecvLog log;
  ASSERT_TRUE(log.Init(8, 1, true));
  for (uint64_t id = 1; id <= 3; ++id) {
    ibv_sge sge{0x1000u * id, 8, 1};
    ibv_recv_wr wr = Wr(id, &sge, 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  RecvLog::Taken t;
  ASSERT_TRUE(log.Consume(3, &t));
  ASSERT_TRUE(log.Consume(1, &t));
  EXPECT_EQ(t.sge[0].addr, 0x1000u);
  ASSERT_TRUE(log.Consume(2, &t));
  EXPECT_EQ(t.sge[0].addr, 0x2000u);
  EXPECT_FALSE(log.Consume(3, &t));  // taken once only
}

// Posts whose completions went by before any lookup (the CQ did not
// translate yet) stay untaken: once a lookup has found its post, the next
// one looks after it, in posting order, not at an older untaken post of
// the same WR.
TEST(RecvLogTest, ALookupGoesOnFromTheLastPostTaken) {
  RecvLog log;
  ASSERT_TRUE(log.Init(8, 1, true));
  const uint64_t ids[] = {1, 2, 1, 2, 1};  // one wr_id, several buffers
  for (int i = 0; i < 5; ++i) {
    ibv_sge sge{0x1000u * (i + 1), 8, 1};
    ibv_recv_wr wr = Wr(ids[i], &sge, 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  RecvLog::Taken t;
  ASSERT_TRUE(log.Consume(2, &t));  // the first lookup: post 2 (post 1 went by)
  EXPECT_EQ(t.sge[0].addr, 0x2000u);
  ASSERT_TRUE(log.Consume(1, &t));
  EXPECT_EQ(t.sge[0].addr, 0x3000u) << "post 3, after post 2; not post 1";
  ASSERT_TRUE(log.Consume(2, &t));
  EXPECT_EQ(t.sge[0].addr, 0x4000u);
  ASSERT_TRUE(log.Consume(1, &t));
  EXPECT_EQ(t.sge[0].addr, 0x5000u);
  ASSERT_TRUE(log.Consume(1, &t));  // nothing after: the nearest before
  EXPECT_EQ(t.sge[0].addr, 0x1000u);
}

// A post whose slot later posts wrote again is not handed out as if it
// were the newer one's, and ConsumeAll forgets every earlier post.
TEST(RecvLogTest, ConsumeRefusesPostsTheRingNoLongerHolds) {
  RecvLog log;
  ASSERT_TRUE(log.Init(2, 1, true));  // a looked-up queue of 2: a ring of 16
  for (uint64_t id = 1; id <= 18; ++id) {
    ibv_sge sge{0x1000u * id, 8, 1};
    ibv_recv_wr wr = Wr(id, &sge, 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  RecvLog::Taken t;
  EXPECT_FALSE(log.Consume(1, &t));
  EXPECT_FALSE(log.Consume(2, &t));
  EXPECT_FALSE(log.Consume(3, &t));  // its slot is the next post's
  ASSERT_TRUE(log.Consume(4, &t));
  EXPECT_EQ(t.sge[0].addr, 0x4000u);
  log.ConsumeAll();
  EXPECT_FALSE(log.Consume(18, &t));
  ibv_sge sge{0x9000, 8, 1};
  ibv_recv_wr wr = Wr(18, &sge, 1);
  ASSERT_TRUE(log.Push(&wr));
  ASSERT_TRUE(log.Consume(18, &t));
  EXPECT_EQ(t.sge[0].addr, 0x9000u);
}

// A queue whose posts no completion path looks up (an RC QP's own) keeps
// no marks for them, and finds nothing.
TEST(RecvLogTest, AQueueNotLookedUpFindsNothing) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, false));
  ibv_sge sge{0x1000, 8, 1};
  ibv_recv_wr wr = Wr(1, &sge, 1);
  ASSERT_TRUE(log.Push(&wr));
  RecvLog::Taken t;
  EXPECT_FALSE(log.Consume(1, &t));
  EXPECT_EQ(log.Recent(1).at(0)->sge[0].addr, 0x1000u);  // still journaled
}

// Several pollers take completions of one queue at once (two threads
// polling one CQ, or CQs whose QPs share an SRQ): each post is handed out
// once, to the completion that names it.
TEST(RecvLogTest, PollersTakingAtOnceEachGetTheirOwnPostsOnce) {
  constexpr int kPosts = 512;
  for (int round = 0; round < 50; ++round) {
    RecvLog log;
    ASSERT_TRUE(log.Init(kPosts, 1, true));
    for (uint64_t id = 0; id < kPosts; ++id) {
      ibv_sge sge{0x10000u + 16 * id, 8, 1};
      ibv_recv_wr wr = Wr(id, &sge, 1);
      ASSERT_TRUE(log.Push(&wr));
    }
    std::atomic<int> wrong{0};
    std::atomic<bool> go{false};
    auto poller = [&](uint64_t parity) {
      while (!go.load()) {
      }
      for (uint64_t id = parity; id < kPosts; id += 2) {
        RecvLog::Taken t;
        if (!log.Consume(id, &t) || t.num_sge != 1 || t.sge[0].addr != 0x10000u + 16 * id)
          wrong.fetch_add(1);
      }
    };
    std::thread a(poller, 0), b(poller, 1);
    go.store(true);
    a.join();
    b.join();
    ASSERT_EQ(wrong.load(), 0) << "round " << round;
    RecvLog::Taken t;
    for (uint64_t id = 0; id < kPosts; ++id) ASSERT_FALSE(log.Consume(id, &t)) << id;
  }
}

// Who may write the ring: its first poster without a lock, any other
// thread once the queue is shared.

// `cond` within 10 s.
template <typename Cond>
bool Eventually(Cond cond) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Whether the calling thread would post without the lock.
bool Owns(RecvLog* log) {
  if (!log->BeginOwned()) return false;
  log->EndOwned();
  return true;
}
bool OwnsOn(RecvLog* log) {
  bool owns = false;
  std::thread([&] { owns = Owns(log); }).join();
  return owns;
}

TEST(RecvLogTest, TheFirstPosterOwnsTheQueueAndNoOtherThreadDoes) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, false));
  EXPECT_TRUE(log.unowned());
  EXPECT_FALSE(Owns(&log));
  { RecvLog::Writer first(&log); }
  EXPECT_FALSE(log.unowned());
  EXPECT_TRUE(Owns(&log));
  EXPECT_FALSE(OwnsOn(&log));
  EXPECT_FALSE(log.shared());  // asking shares nothing
}

TEST(RecvLogTest, AnotherThreadsPostWaitsForTheOwnersPostAndSharesTheQueue) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, false));
  log.Claim();
  ASSERT_TRUE(log.BeginOwned());  // the owner's post in progress
  std::atomic<bool> in{false};
  std::atomic<bool> done{false};
  std::thread other([&] {
    RecvLog::Writer w(&log);
    in.store(true);
    while (!done.load()) std::this_thread::yield();
  });
  ASSERT_TRUE(Eventually([&] { return log.shared(); }));
  // Shared, but the owner's post is not over: the other thread waits.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(in.load()) << "a Writer went in while the owner was posting";
  log.EndOwned();
  EXPECT_TRUE(Eventually([&] { return in.load(); }));
  // From now on the owner posts under the lock too.
  EXPECT_FALSE(Owns(&log));
  done.store(true);
  other.join();
  EXPECT_FALSE(Owns(&log));
  EXPECT_FALSE(OwnsOn(&log));
}

TEST(RecvLogTest, QuiescedWritesAsTheOwnerAndPutsTheOwnerBack) {
  RecvLog log;
  ASSERT_TRUE(log.Init(4, 1, false));
  std::thread([&] { log.Claim(); }).join();  // owned by a thread that is gone
  EXPECT_FALSE(Owns(&log));
  {
    RecvLog::Quiesced q(&log);
    EXPECT_TRUE(Owns(&log));
  }
  EXPECT_FALSE(Owns(&log));
  EXPECT_FALSE(log.shared());
}

TEST(RecvLogTest, QuiescedLeavesAnUnownedQueueUnownedAndASharedOneShared) {
  RecvLog unowned;
  ASSERT_TRUE(unowned.Init(4, 1, false));
  {
    RecvLog::Quiesced q(&unowned);
    EXPECT_TRUE(Owns(&unowned));
  }
  EXPECT_TRUE(unowned.unowned());

  RecvLog shared;
  ASSERT_TRUE(shared.Init(4, 1, false));
  std::thread([&] { shared.Claim(); }).join();
  { RecvLog::Writer w(&shared); }  // another thread's post: shared for good
  ASSERT_TRUE(shared.shared());
  {
    RecvLog::Quiesced q(&shared);
    EXPECT_FALSE(Owns(&shared));  // its posts take the lock
    RecvLog::Writer w(&shared);
  }
  EXPECT_TRUE(shared.shared());
}

}  // namespace
}  // namespace rdmavirt::shim
