// RecvLog: the journal of receives posted to a queue, as the application
// posted them, from which release re-posts the outstanding ones.
#include "shim/recv_log.h"

#include <gtest/gtest.h>

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
  ASSERT_TRUE(log.Init(4, 2));
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
  ASSERT_TRUE(log.Init(4, 1));
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
  ASSERT_TRUE(log.Init(4, 1));
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
  ASSERT_TRUE(log.Init(4, 1));
  ibv_sge sge{0x1000, 8, 1};
  for (uint64_t id : {7, 8, 7}) {
    ibv_recv_wr wr = Wr(id, &sge, 1);
    ASSERT_TRUE(log.Push(&wr));
  }
  const RecvLog::Entry* first = log.Consume(7);
  const RecvLog::Entry* second = log.Consume(8);
  const RecvLog::Entry* third = log.Consume(7);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(third, nullptr);
  EXPECT_NE(first, third);  // the repeated wr_id is the later post
  EXPECT_EQ(second->wr_id, 8u);
  EXPECT_EQ(log.Consume(7), nullptr);  // none left
}

}  // namespace
}  // namespace rdmavirt::shim
