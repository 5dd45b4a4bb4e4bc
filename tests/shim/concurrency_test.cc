// The data path reads the shim's tables without locks while the control
// path changes them: posts on several threads (each on its own QP, as
// verbs programs do) run while another thread registers and deregisters
// memory regions and creates and destroys QPs. Run under ThreadSanitizer
// (RDMAVIRT_TSAN) this proves the lock-free reads are race-free; in every
// build it proves translations stay right under churn.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

using ConcurrencyTest = ShimTest;

TEST_F(ConcurrencyTest, PostsTranslateWhileTheControlPathChurns) {
  constexpr int kPosters = 3;
  constexpr int kPostsEach = 2000;
  struct Poster {
    ibv_qp* a;
    ibv_qp* b;
    ibv_mr* mr;
    char buf[64];
  };
  std::vector<Poster> posters(kPosters);
  for (Poster& p : posters) {
    std::tie(p.a, p.b) = dev().Pair(IBV_QPT_RC);
    p.mr = dev().Reg(p.buf, sizeof(p.buf));
    ASSERT_NE(p.mr, nullptr);
  }

  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread churn([&] {
    char scratch[32];
    while (!stop.load()) {
      ibv_mr* m = shim_.RegMr(dev().pd, scratch, sizeof(scratch),
                              reinterpret_cast<uintptr_t>(scratch), IBV_ACCESS_LOCAL_WRITE);
      ibv_qp_init_attr attr{};
      attr.send_cq = dev().cq;
      attr.recv_cq = dev().cq;
      attr.qp_type = IBV_QPT_RC;
      attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
      attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
      ibv_qp* q = shim_.CreateQp(dev().pd, &attr);
      if (m == nullptr || q == nullptr || shim_.DestroyQp(q) != 0 || shim_.DeregMr(m) != 0)
        failures.fetch_add(1);
    }
  });

  std::vector<std::thread> threads;
  for (Poster& p : posters) {
    threads.emplace_back([&p, &failures] {
      ibv_sge sge = Sge(p.buf, 8, p.mr);
      ibv_send_wr wr{};
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(p.buf + 32);
      wr.wr.rdma.rkey = p.mr->rkey;
      for (int i = 0; i < kPostsEach; ++i) {
        ibv_send_wr* bad = nullptr;
        if (ibv_post_send(p.a, &wr, &bad) != 0) failures.fetch_add(1);
        if (sge.lkey != p.mr->lkey || wr.wr.rdma.rkey != p.mr->rkey) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  stop.store(true);
  churn.join();
  EXPECT_EQ(failures.load(), 0);

  // Every post reached the device with the physical keys of its own MR.
  std::vector<uint32_t> lkeys, rkeys;
  for (const Poster& p : posters) {
    lkeys.push_back(ShimMr(p.mr)->real->lkey);
    rkeys.push_back(ShimMr(p.mr)->real->rkey);
  }
  int seen = 0;
  for (const auto& s : fake_.sends()) {
    if (s.opcode != IBV_WR_RDMA_WRITE) continue;
    ++seen;
    ASSERT_EQ(s.lkeys.size(), 1u);
    bool own = false;
    for (int i = 0; i < kPosters; ++i) {
      if (s.qp_num == ShimQp(posters[i].a)->real->qp_num) {
        own = s.lkeys[0] == lkeys[i] && s.rkey == rkeys[i];
      }
    }
    EXPECT_TRUE(own) << "a post reached the device with another MR's keys";
  }
  EXPECT_EQ(seen, kPosters * kPostsEach);
  Drain(dev().cq);
}

// Receives posted to one queue by several threads at once (an SRQ that
// worker threads replenish, say). The journal must hold every WR, whole,
// in the provider's own order: that order is how a release names the
// receives still posted. Before the journal had a writer's protocol, two
// posters' entries overwrote each other and came in another order.
// The shim's stacks: offset mode (every post translates), opted out (the
// fast path), migratable with the pause's marks, and migratable with the
// probe (the probed entries, a process's default), in default and in
// offset mode (as after a move).
struct Stack {
  const char* name;
  bool offset;
  bool migratable;
  bool probed;
};
constexpr Stack kStacks[] = {
    {"Offset", true, false, false},          {"OptedOut", false, false, false},
    {"Marks", false, true, false},           {"Probed", false, true, true},
    {"ProbedTranslating", true, true, true},
};

class SharedRecvQueueTest : public ::testing::TestWithParam<int> {
 protected:
  SharedRecvQueueTest()
      : shim_(&fake_, IdentityMode{.offset = kStacks[GetParam()].offset},
              kStacks[GetParam()].migratable, kStacks[GetParam()].probed) {}

  // A fake queue holds 1024 receives: rounds of a fresh queue each.
  static constexpr int kThreads = 3;
  static constexpr int kPostsEach = 340;
  static constexpr uint32_t kDepth = kThreads * kPostsEach;
  static constexpr int kRounds = 20;

  // Every thread posts its receives through `post` (one WR, one SGE, its
  // address derived from its wr_id), then the journal is compared with
  // what the provider got.
  template <typename Post, typename Mine>
  void PostFromThreads(Post post, const RecvLog& log, Mine mine) {
    std::vector<char> buf(kDepth);
    ibv_mr* mr = dev().Reg(buf.data(), buf.size());
    ASSERT_NE(mr, nullptr);
    const size_t before = fake_.recvs().size();  // a queue's pointer may be an old one's
    std::atomic<int> failures{0};
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < kThreads) {
        }
        for (int i = 0; i < kPostsEach; ++i) {
          const uint64_t id = static_cast<uint64_t>(t) * kPostsEach + i;
          ibv_sge sge = Sge(buf.data() + id, 1, mr);
          ibv_recv_wr wr{};
          wr.wr_id = id;
          wr.sg_list = &sge;
          wr.num_sge = 1;
          ibv_recv_wr* bad = nullptr;
          if (post(&wr, &bad) != 0) failures.fetch_add(1);
        }
      });
    }
    for (std::thread& th : threads) th.join();
    ASSERT_EQ(failures.load(), 0);

    std::vector<uint64_t> provider;
    const std::vector<FakeBackend::RecvRecord> records = fake_.recvs();
    for (size_t i = before; i < records.size(); ++i)
      if (mine(records[i])) provider.push_back(records[i].wr_id);
    ASSERT_EQ(provider.size(), kDepth);
    EXPECT_EQ(log.posted(), kDepth);
    const std::vector<const RecvLog::Entry*> journal = log.Recent(kDepth);
    ASSERT_EQ(journal.size(), kDepth);
    int out_of_order = 0;
    int torn = 0;
    for (uint32_t i = 0; i < kDepth; ++i) {
      out_of_order += journal[i]->wr_id != provider[i];
      torn +=
          journal[i]->num_sge != 1 ||
          journal[i]->sge[0].addr != reinterpret_cast<uintptr_t>(buf.data() + journal[i]->wr_id);
    }
    EXPECT_EQ(out_of_order, 0) << "journal entries not in the provider's order";
    EXPECT_EQ(torn, 0) << "journal entries not as posted";
    EXPECT_TRUE(log.shared());
  }

  Device<Shim>& dev() { return *dev_; }
  void SetUp() override { dev_ = std::make_unique<Device<Shim>>(shim_); }
  void TearDown() override {
    dev_.reset();
    EXPECT_EQ(fake_.live_objects(), 0);
  }

  FakeBackend fake_;
  Shim shim_;
  std::unique_ptr<Device<Shim>> dev_;
};

TEST_P(SharedRecvQueueTest, AnSrqsJournalHoldsEveryThreadsReceivesInTheProvidersOrder) {
  for (int round = 0; round < kRounds && !HasFailure(); ++round) {
    ibv_srq_init_attr attr{};
    attr.attr.max_wr = kDepth;
    attr.attr.max_sge = 1;
    ibv_srq* srq = shim_.CreateSrq(dev().pd, &attr);
    ASSERT_NE(srq, nullptr);
    const ibv_srq* real = ShimSrq(srq)->real;
    PostFromThreads(
        [srq](ibv_recv_wr* wr, ibv_recv_wr** bad) { return ibv_post_srq_recv(srq, wr, bad); },
        ShimSrq(srq)->recvs, [real](const FakeBackend::RecvRecord& r) { return r.srq == real; });
    EXPECT_EQ(shim_.DestroySrq(srq), 0);
  }
}

TEST_P(SharedRecvQueueTest, AQpsJournalHoldsEveryThreadsReceivesInTheProvidersOrder) {
  for (int round = 0; round < kRounds && !HasFailure(); ++round) {
    ibv_qp_init_attr attr{};
    attr.send_cq = attr.recv_cq = dev().cq;
    attr.qp_type = IBV_QPT_RC;
    attr.cap.max_send_wr = 4;
    attr.cap.max_recv_wr = kDepth;
    attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
    ibv_qp* qp = shim_.CreateQp(dev().pd, &attr);
    ASSERT_NE(qp, nullptr);
    ASSERT_EQ(ToRts(shim_, qp, qp->qp_num, dev().gid), 0);  // to itself
    const uint32_t qpn = ShimQp(qp)->real->qp_num;
    PostFromThreads(
        [qp](ibv_recv_wr* wr, ibv_recv_wr** bad) { return ibv_post_recv(qp, wr, bad); },
        *ShimQp(qp)->recvs,
        [qpn](const FakeBackend::RecvRecord& r) { return r.srq == nullptr && r.qp_num == qpn; });
    EXPECT_EQ(shim_.DestroyQp(qp), 0);
  }
}

std::string StackName(const ::testing::TestParamInfo<int>& info) {
  return kStacks[info.param].name;
}
INSTANTIATE_TEST_SUITE_P(Stacks, SharedRecvQueueTest, ::testing::Range(0, 5), StackName);

// One thread posting, the common case, owns its queue: no lock is taken.
TEST_F(ConcurrencyTest, AQueueOneThreadPostsToIsNotShared) {
  ibv_srq* srq = dev().Srq();
  char buf[8];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  for (int i = 0; i < 10; ++i) {
    ibv_sge sge = Sge(buf, sizeof(buf), mr);
    ibv_recv_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_srq_recv(srq, &wr, &bad), 0);
  }
  EXPECT_EQ(ShimSrq(srq)->recvs.posted(), 10u);
  EXPECT_FALSE(ShimSrq(srq)->recvs.shared());
}

}  // namespace
}  // namespace rdmavirt::shim::testing
