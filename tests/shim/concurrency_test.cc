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

}  // namespace
}  // namespace rdmavirt::shim::testing
