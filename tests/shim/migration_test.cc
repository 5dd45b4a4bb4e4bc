// The shim's migration steps over FakeBackend: two endpoints P and Q (two
// Shims on one fake device, connected to each other), P released and
// re-created with new physical identities, Q re-pointed at it; every
// receive, send and completion accounted for.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/time.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shim/datapath/data_path.h"
#include "shim/datapath/thread_probe.h"
#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

std::vector<uint64_t> WrIds(const std::vector<ibv_wc>& wcs) {
  std::vector<uint64_t> ids;
  for (const ibv_wc& wc : wcs) ids.push_back(wc.wr_id);
  return ids;
}

class MigrationTest : public TwoEndpointsTest {
 protected:
  explicit MigrationTest(bool probed = false) : TwoEndpointsTest(probed) {}

  // An RC QP on each side, connected to the other.
  void Connect(ibv_qp_type type = IBV_QPT_RC, int access = kAllRemoteAccess) {
    pqp_ = pdev_->Qp(type);
    qqp_ = qdev_->Qp(type);
    ASSERT_EQ(ToRts(p_, pqp_, qqp_->qp_num, qdev_->gid, kIpv4GidIndex, access), 0);
    ASSERT_EQ(ToRts(q_, qqp_, pqp_->qp_num, pdev_->gid, kIpv4GidIndex, access), 0);
  }

  void PostRecv(Shim& s, ibv_qp* qp, uint64_t wr_id, char* buf, ibv_mr* mr) {
    ASSERT_EQ(PostRecvOf(qp, wr_id, buf, 64, mr), 0);
    (void)s;
  }

  // A UD QP on each side, at RTS.
  void UdPair(ibv_qp** pud, ibv_qp** qud) {
    *pud = pdev_->Qp(IBV_QPT_UD);
    *qud = qdev_->Qp(IBV_QPT_UD);
    ASSERT_EQ(ToRts(p_, *pud, 0, {}), 0);
    ASSERT_EQ(ToRts(q_, *qud, 0, {}), 0);
  }

  // Both quiesced, and an application thread of P polling its CQ until
  // `stop` (steps after a restore run on such a thread).
  std::thread QuiesceWithAPollingThread(std::atomic<bool>* stop) {
    uint32_t drained = 0;
    EXPECT_TRUE(q_.Quiesce(1000, &drained).ok());
    EXPECT_TRUE(p_.Quiesce(1000, &drained).ok());
    return std::thread([this, stop] {
      ibv_wc wc;
      while (!stop->load()) ibv_poll_cq(pdev_->cq, 1, &wc);
    });
  }

  // P moves: both pause, P releases and is re-created, Q re-points, P resumes.
  // `q_paused` runs once Q has paused and P not yet.
  void Move(const std::function<void()>& q_paused = nullptr) {
    Release(q_paused);
    RestoreAndResume();
  }
  // Move's halves: both pause and P releases; P is re-created, Q
  // re-pointed, P resumed.
  void Release(const std::function<void()>& q_paused = nullptr) {
    uint32_t drained = 0;
    ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
    if (q_paused) q_paused();
    ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
    ASSERT_TRUE(p_.Release().ok());
    released_live_ = fake_.live_objects();
  }
  void RestoreAndResume() {
    const Status st = p_.Restore("", {});
    ASSERT_TRUE(st.ok()) << st.message;
    const Status rq = q_.PeerReconnect(ToMapping(p_.Describe()));
    ASSERT_TRUE(rq.ok()) << rq.message;
    ASSERT_TRUE(p_.Resume().ok());
  }

  int released_live_ = -1;
};

// CRIU before 4.1 arms an interval timer again at a restore only if it
// repeats: a one-shot alarm armed at the dump never fired on the
// destination (perftest's duration mode ran on for ever). The release
// stops the process's timers, keeping what was left of each, and the
// resume arms them again; one the application armed in between is its own.
class ItimerTest : public MigrationTest {
 protected:
  void SetUp() override {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;  // in case: neither should fire here
    ASSERT_EQ(sigaction(SIGALRM, &ignore, &alrm_), 0);
    ASSERT_EQ(sigaction(SIGPROF, &ignore, &prof_), 0);
  }
  void TearDown() override {
    const itimerval off{};
    setitimer(ITIMER_REAL, &off, nullptr);
    setitimer(ITIMER_PROF, &off, nullptr);
    sigaction(SIGALRM, &alrm_, nullptr);
    sigaction(SIGPROF, &prof_, nullptr);
    MigrationTest::TearDown();
  }
  static itimerval Timer(int which) {
    itimerval v{};
    EXPECT_EQ(getitimer(which, &v), 0);
    return v;
  }
  static double Seconds(const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; }
  struct sigaction alrm_ {};
  struct sigaction prof_ {};
};

TEST_F(ItimerTest, TimersStandStillWhileReleasedAndRunAgainAfterTheMove) {
  Connect();
  itimerval one_shot{};
  one_shot.it_value.tv_sec = 300;
  ASSERT_EQ(setitimer(ITIMER_REAL, &one_shot, nullptr), 0);
  itimerval periodic{};
  periodic.it_value.tv_sec = periodic.it_interval.tv_sec = 200;
  ASSERT_EQ(setitimer(ITIMER_PROF, &periodic, nullptr), 0);

  Release();
  EXPECT_EQ(Seconds(Timer(ITIMER_REAL).it_value), 0) << "stopped: nothing fires before the dump";
  EXPECT_EQ(Seconds(Timer(ITIMER_PROF).it_value), 0);
  RestoreAndResume();

  const itimerval real = Timer(ITIMER_REAL);
  EXPECT_GT(Seconds(real.it_value), 290) << "armed again with what was left";
  EXPECT_LE(Seconds(real.it_value), 300);
  EXPECT_EQ(Seconds(real.it_interval), 0) << "still a one-shot timer";
  const itimerval prof = Timer(ITIMER_PROF);
  EXPECT_GT(Seconds(prof.it_value), 190);
  EXPECT_EQ(Seconds(prof.it_interval), 200);
}

TEST_F(ItimerTest, ATimerTheApplicationArmsWhileReleasedIsLeftAsItSetIt) {
  Connect();
  itimerval before{};
  before.it_value.tv_sec = 300;
  ASSERT_EQ(setitimer(ITIMER_REAL, &before, nullptr), 0);
  Release();
  itimerval own{};
  own.it_value.tv_sec = 100;
  ASSERT_EQ(setitimer(ITIMER_REAL, &own, nullptr), 0);
  RestoreAndResume();
  EXPECT_LE(Seconds(Timer(ITIMER_REAL).it_value), 100) << "the application's, not the one stopped";
  EXPECT_GT(Seconds(Timer(ITIMER_REAL).it_value), 90);
}

TEST_F(MigrationTest, ReceivesAndSendsCarryOnAcrossAMoveInOrder) {
  Connect();
  for (int i = 0; i < 4; ++i) PostRecv(q_, qqp_, 100 + i, qbuf_ + 64 * i, qmr_);
  for (int i = 0; i < 2; ++i) PostRecv(p_, pqp_, 200 + i, pbuf_ + 1024 + 64 * i, pmr_);
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "one"), 0);
  ASSERT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100}));
  ASSERT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{1}));
  const uint32_t vqpn = pqp_->qp_num;
  const uint32_t old_physical = ShimQp(pqp_)->physical_qpn;
  const uint32_t vrkey = pmr_->rkey;

  Move();

  EXPECT_EQ(pqp_->qp_num, vqpn) << "the virtual QPN stays";
  EXPECT_NE(ShimQp(pqp_)->physical_qpn, old_physical) << "a new QP on the device";
  EXPECT_EQ(pmr_->rkey, vrkey);
  EXPECT_NE(ShimMr(pmr_)->real->rkey, vrkey) << "a new registration";
  // Q's receives 101..103 are still posted; P's 200, 201 too.
  ASSERT_EQ(Send(pqp_, 2, pbuf_ + 2048, pmr_, "two"), 0);
  ASSERT_EQ(Send(pqp_, 3, pbuf_ + 2048 + 64, pmr_, "three"), 0);
  const std::vector<ibv_wc> got = Drain(qdev_->cq);
  ASSERT_EQ(WrIds(got), (std::vector<uint64_t>{101, 102}));
  EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(got[0].qp_num, qqp_->qp_num);
  EXPECT_STREQ(qbuf_ + 64, "two");
  EXPECT_STREQ(qbuf_ + 128, "three");
  ASSERT_EQ(Send(qqp_, 9, qbuf_ + 2048, qmr_, "back"), 0);
  const std::vector<ibv_wc> back = Drain(pdev_->cq);
  ASSERT_EQ(WrIds(back), (std::vector<uint64_t>{2, 3, 200}));
  EXPECT_EQ(back[2].qp_num, vqpn) << "completions show the virtual QPN";
  EXPECT_STREQ(pbuf_ + 1024, "back");

  // Q writes into P's memory with the rkey P gave it before the move.
  strcpy(qbuf_ + 3000, "written");
  ibv_sge sge = Sge(qbuf_ + 3000, 8, qmr_);
  ibv_send_wr wr{};
  wr.wr_id = 10;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(pbuf_ + 3000);
  wr.wr.rdma.rkey = vrkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qqp_, &wr, &bad), 0);
  const std::vector<ibv_wc> w = Drain(qdev_->cq);
  ASSERT_EQ(w.size(), 2u);  // the send to P, then the write
  EXPECT_EQ(w[1].status, IBV_WC_SUCCESS);
  EXPECT_STREQ(pbuf_ + 3000, "written");
}

TEST_F(MigrationTest, AReceiveDoneButNotYetPolledAtAPeerReconnectIsNotPostedAgain) {
  Connect();
  PostRecv(q_, qqp_, 100, qbuf_, qmr_);
  PostRecv(q_, qqp_, 101, qbuf_ + 64, qmr_);
  uint32_t drained = 0;
  // Q pauses first; P's send lands in Q's receive 100 afterwards: done on
  // the device, not yet polled by anyone.
  Move([&] { EXPECT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "one"), 0); });
  ASSERT_EQ(Send(pqp_, 2, pbuf_ + 2048 + 64, pmr_, "two"), 0);
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100, 101}))
      << "only 101 was still posted";
  EXPECT_STREQ(qbuf_, "one");
  EXPECT_STREQ(qbuf_ + 64, "two");
  // And Q's counters agree with the device: a move of Q re-posts nothing
  // more, so a third send finds no receive.
  ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
  EXPECT_EQ(q_.Describe().qp_list[0].outstanding_recvs, 0u);
  ASSERT_TRUE(q_.Resume().ok());
}

// A UD endpoint that named no GID (no AH, no connected QP: a receiver that
// only answers) is described at the GID its pause takes, so that a move
// can pause its peers' hosts toward it before pausing it (before, the
// migrator got no GID and the hosts refused the request).
TEST_F(MigrationTest, AUdEndpointThatNamedNoGidIsDescribedAtTheOneItsPauseTakes) {
  ibv_qp *pud, *qud;
  UdPair(&pud, &qud);
  const EndpointView before = p_.Describe();
  ASSERT_TRUE(before.has_gid);
  EXPECT_EQ(memcmp(before.virtual_gid.raw, pdev_->gid.raw, 16), 0);
  uint32_t drained = 0;
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  const EndpointView paused = p_.Describe();
  EXPECT_EQ(memcmp(paused.virtual_gid.raw, before.virtual_gid.raw, 16), 0);
  EXPECT_EQ(memcmp(paused.physical_gid.raw, before.physical_gid.raw, 16), 0);
  ASSERT_TRUE(p_.Resume().ok());
}

// Describing it records nothing: an address handle made later names the
// endpoint's GID (here another index of the port's table).
TEST_F(MigrationTest, DescribingAUdEndpointLeavesItsGidToItsFirstAddressHandle) {
  ibv_qp *pud, *qud;
  UdPair(&pud, &qud);
  ASSERT_TRUE(p_.Describe().has_gid);
  pdev_->Ah(qdev_->gid, 0);
  ibv_gid index0;
  ASSERT_EQ(p_.QueryGid(pdev_->ctx, FakeBackend::kPort, 0, &index0), 0);
  const EndpointView v = p_.Describe();
  ASSERT_TRUE(v.has_gid);
  EXPECT_EQ(memcmp(v.virtual_gid.raw, index0.raw, 16), 0);
  EXPECT_NE(memcmp(v.virtual_gid.raw, pdev_->gid.raw, 16), 0);
}

TEST_F(MigrationTest, AUdQpIsAttachedToItsMulticastGroupsAgainAfterAMove) {
  // A multicast receiver (mckey, rdma_join_multicast) attaches its UD QP
  // once: the QP a restore creates must be in the same groups, or it
  // receives nothing more.
  ibv_qp* pud = nullptr;
  ibv_qp* qud = nullptr;
  UdPair(&pud, &qud);
  ibv_gid group{};
  group.raw[10] = group.raw[11] = 0xff;
  const uint8_t addr[4] = {239, 1, 130, 3};
  memcpy(&group.raw[12], addr, 4);
  ibv_gid left = group;
  left.raw[15] = 4;
  ASSERT_EQ(p_.AttachMcast(pud, &group, 0), 0);
  ASSERT_EQ(p_.AttachMcast(pud, &left, 0), 0);
  ASSERT_EQ(p_.DetachMcast(pud, &left, 0), 0);
  // The shadow QP leads its shim object (objects.h). The release
  // destroyed the real QP and its groups with it.
  auto real_of = [](ibv_qp* shadow) { return reinterpret_cast<const Qp*>(shadow)->real; };
  Move();
  std::vector<ibv_gid> groups = fake_.mcast_groups(real_of(pud));
  ASSERT_EQ(groups.size(), 1u) << "the restored QP is not in exactly its one group";
  EXPECT_EQ(memcmp(groups[0].raw, group.raw, 16), 0);
  // Detached after the move: the next move leaves it out.
  ASSERT_EQ(p_.DetachMcast(pud, &group, 0), 0);
  Move();
  EXPECT_TRUE(fake_.mcast_groups(real_of(pud)).empty());
}

TEST_F(MigrationTest, AUdReceiverMovedTwiceStillFindsTheBufferOfEachDatagram) {
  ibv_qp* pud = pdev_->Qp(IBV_QPT_UD);
  ibv_qp* qud = qdev_->Qp(IBV_QPT_UD);
  ASSERT_EQ(ToRts(p_, pud, 0, {}), 0);
  ASSERT_EQ(ToRts(q_, qud, 0, {}), 0);
  ibv_ah* ah = pdev_->Ah(qdev_->gid);
  constexpr int kDepth = 8;
  constexpr int kSlot = 64;  // a 40-byte GRH, then the datagram
  static char rbuf[kDepth * kSlot];
  ibv_mr* rmr = qdev_->Reg(rbuf, sizeof(rbuf));
  auto post_recv = [&](uint64_t slot) {
    return PostRecvOf(qud, slot, rbuf + kSlot * slot, kSlot, rmr);
  };
  for (int i = 0; i < kDepth; ++i) ASSERT_EQ(post_recv(i), 0);
  // Q moves twice (its receives re-posted each time), then P moves (so
  // only the GRH of each datagram says who sent it), then Q takes many
  // datagrams, each receive re-posted as it completes.
  for (int move = 0; move < 2; ++move) {
    uint32_t drained = 0;
    ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
    ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
    ASSERT_TRUE(q_.Release().ok());
    ASSERT_TRUE(q_.Restore("", {}).ok());
    ASSERT_TRUE(p_.PeerReconnect(ToMapping(q_.Describe())).ok());
    ASSERT_TRUE(q_.Resume().ok());
  }
  Move();
  for (int n = 0; n < 5 * kDepth; ++n) {
    strcpy(pbuf_, "datagram");
    ibv_sge sge = Sge(pbuf_, 9, pmr_);
    ibv_send_wr wr{};
    wr.wr_id = n;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = qud->qp_num;
    wr.wr.ud.remote_qkey = kQkey;
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(pud, &wr, &bad), 0);
    const std::vector<ibv_wc> got = Drain(qdev_->cq);
    ASSERT_EQ(got.size(), 1u) << n;
    ASSERT_EQ(got[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(got[0].src_qp, pud->qp_num) << "datagram " << n << ": the QPN P gave out";
    const char* grh = rbuf + kSlot * got[0].wr_id;
    // RoCE v2 over IPv4: the IPv4 header's source address, at 32.
    EXPECT_TRUE(memcmp(grh + 32, pdev_->gid.raw + 12, 4) == 0)
        << "datagram " << n << ": its GRH names P's address";
    ASSERT_EQ(post_recv(got[0].wr_id), 0);
    Drain(pdev_->cq);
  }
}

// A datagram P sent just before it paused (Q already paused) is polled by
// Q only after P moved again: its source is P's QPN as it was when sent,
// translated through the mapping of then, not the one published since.
TEST_F(MigrationTest, AUdDatagramReceivedBeforeAPeerReconnectNamesItsSenderAsItWasThen) {
  ibv_qp *pud = nullptr, *qud = nullptr;
  UdPair(&pud, &qud);
  ibv_ah* ah = pdev_->Ah(qdev_->gid);
  static char rbuf[1024];
  ibv_mr* rmr = qdev_->Reg(rbuf, sizeof(rbuf));
  for (int i = 0; i < 2; ++i) ASSERT_EQ(PostRecvOf(qud, 500 + i, rbuf + 512 * i, 512, rmr), 0);
  Move();  // P's UD QP: virtual number != physical from now on
  const uint32_t sent_from = ShimQp(pud)->physical_qpn;
  // Lands in Q's CQ while Q is paused.
  Move([&] { EXPECT_EQ(Send(pud, 1, pbuf_, pmr_, "one", ah, qud->qp_num), 0); });
  ASSERT_NE(ShimQp(pud)->physical_qpn, sent_from);
  ASSERT_EQ(Send(pud, 2, pbuf_, pmr_, "two", ah, qud->qp_num), 0);
  const std::vector<ibv_wc> got = Drain(qdev_->cq);
  ASSERT_EQ(WrIds(got), (std::vector<uint64_t>{500, 501}));
  for (const ibv_wc& wc : got) {
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT_EQ(wc.src_qp, pud->qp_num) << "receive " << wc.wr_id << ": the QPN P gave out";
  }
}

TEST_F(MigrationTest, ReleaseLeavesNothingOfTheEndpointOnTheDevice) {
  Connect();
  const int before = fake_.live_objects();
  const EndpointView v = p_.Describe();
  uint32_t drained = 0;
  ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Release().ok());
  // P had a context, a PD, a CQ, an MR and a QP.
  EXPECT_EQ(fake_.live_objects(), before - 5);
  EXPECT_TRUE(p_.Describe().released);
  EXPECT_EQ(v.qps, 1u);
  ASSERT_TRUE(p_.Restore("", {}).ok());
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  ASSERT_TRUE(p_.Resume().ok());
  EXPECT_EQ(fake_.live_objects(), before);
}

TEST_F(MigrationTest, PostsDuringAPauseAreQueuedAndReplayedInOrder) {
  Connect();
  for (int i = 0; i < 3; ++i) PostRecv(q_, qqp_, 100 + i, qbuf_ + 64 * i, qmr_);
  uint32_t drained = 0;
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  const int calls = fake_.post_send_calls();
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "a"), 0) << "reported as posted";
  ASSERT_EQ(Send(pqp_, 2, pbuf_ + 2048 + 64, pmr_, "b"), 0);
  EXPECT_EQ(fake_.post_send_calls(), calls) << "nothing reached the device";
  EXPECT_EQ(p_.Describe().qp_list[0].queued_sends, 2u);
  EXPECT_TRUE(Drain(qdev_->cq).empty());
  ASSERT_TRUE(p_.Resume().ok());
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100, 101}));
  EXPECT_STREQ(qbuf_, "a");
  EXPECT_STREQ(qbuf_ + 64, "b");
  EXPECT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{1, 2}));
}

// Processes whose pause probes their threads (a process's default). Once
// one has moved, its context's entries compare the translating path first
// (InstallTranslatingOps); they must still be right on every path: the
// moved queues' (translated), a pause's (queued), and the marked path of
// a CQ made after the move.
class ProbedMigrationTest : public MigrationTest {
 protected:
  ProbedMigrationTest() : MigrationTest(/*probed=*/true) {}
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(InstallThreadProbe(&why)) << why;
  }
};

TEST_F(ProbedMigrationTest, AMovedProcessesEntriesAreRightOnEveryPath) {
  Connect();
  for (int i = 0; i < 4; ++i) PostRecv(q_, qqp_, 100 + i, qbuf_ + 64 * i, qmr_);
  const ibv_context_ops before = pdev_->ctx->ops;
  Move();
  EXPECT_NE(pdev_->ctx->ops.post_send, before.post_send) << "the translating path first";
  EXPECT_NE(pdev_->ctx->ops.poll_cq, before.poll_cq);
  EXPECT_NE(pdev_->ctx->ops.post_recv, before.post_recv);

  // Translated: P's QP and CQ carry new physical identities.
  PostRecv(p_, pqp_, 200, pbuf_ + 1024, pmr_);
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "moved"), 0);
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100}));
  EXPECT_STREQ(qbuf_, "moved");
  ASSERT_EQ(Send(qqp_, 9, qbuf_ + 2048, qmr_, "back"), 0);
  const std::vector<ibv_wc> back = Drain(pdev_->cq);
  ASSERT_EQ(WrIds(back), (std::vector<uint64_t>{1, 200}));
  EXPECT_EQ(back[1].qp_num, pqp_->qp_num) << "the virtual QPN";
  EXPECT_STREQ(pbuf_ + 1024, "back");
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{9}));

  // Marked: a CQ made after the move, whose QPs' completions carry their
  // virtual QPNs (the QPs translate: the process's lkeys have diverged).
  ibv_cq* cq = pdev_->Cq();
  ibv_qp* a = pdev_->Qp(IBV_QPT_RC, 4, nullptr, cq, cq);
  ibv_qp* b = pdev_->Qp(IBV_QPT_RC, 4, nullptr, cq, cq);
  ASSERT_EQ(ToRts(p_, a, b->qp_num, pdev_->gid), 0);
  ASSERT_EQ(ToRts(p_, b, a->qp_num, pdev_->gid), 0);
  ASSERT_EQ(ShimCq(cq)->path.get(), Path::kMarked);
  ASSERT_EQ(ShimQp(a)->path.get(), Path::kTranslated);
  PostRecv(p_, b, 300, pbuf_ + 3000, pmr_);
  ASSERT_EQ(Send(a, 2, pbuf_ + 3100, pmr_, "new"), 0);
  const std::vector<ibv_wc> got = Drain(cq);
  ASSERT_EQ(WrIds(got), (std::vector<uint64_t>{300, 2}));  // the fake: receive first
  EXPECT_EQ(got[0].qp_num, b->qp_num);
  EXPECT_STREQ(pbuf_ + 3000, "new");

  // Paused: posts are queued, then replayed in order.
  uint32_t drained = 0;
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  const int calls = fake_.post_send_calls();
  ASSERT_EQ(Send(pqp_, 3, pbuf_ + 2048, pmr_, "c"), 0);
  ASSERT_EQ(Send(a, 4, pbuf_ + 3100, pmr_, "d"), 0);
  const size_t recvs = fake_.recvs().size();
  PostRecv(p_, b, 301, pbuf_ + 3200, pmr_);
  EXPECT_EQ(fake_.post_send_calls(), calls) << "nothing reached the device";
  EXPECT_EQ(fake_.recvs().size(), recvs) << "nothing reached the device";
  ibv_wc wc;
  EXPECT_EQ(ibv_poll_cq(pdev_->cq, 1, &wc), 0);
  EXPECT_EQ(ibv_poll_cq(cq, 1, &wc), 0);
  ASSERT_TRUE(p_.Resume().ok());
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{101}));
  EXPECT_STREQ(qbuf_ + 64, "c");
  EXPECT_EQ(WrIds(Drain(cq)), (std::vector<uint64_t>{301, 4}));
  EXPECT_STREQ(pbuf_ + 3200, "d");
  EXPECT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{3}));
}

// During a pause the application posts a receive on each of two of its
// QPs, then a send from each to the other. At the resume every receive is
// posted again before any send: a send replayed before its peer's receive
// would fail (RNR), where it succeeded without the pause. Before, each QP's
// receives and then its sends were replayed, QP after QP: one direction
// failed, whichever QP came first.
TEST_F(MigrationTest, ReceivesQueuedInAPauseArePostedBeforeAnyQueuedSend) {
  auto [a, b] = pdev_->Pair(IBV_QPT_RC);
  uint32_t drained = 0;
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  PostRecv(p_, a, 10, pbuf_, pmr_);
  PostRecv(p_, b, 20, pbuf_ + 64, pmr_);
  ASSERT_EQ(Send(a, 11, pbuf_ + 128, pmr_, "to b"), 0);
  ASSERT_EQ(Send(b, 21, pbuf_ + 192, pmr_, "to a"), 0);
  ASSERT_TRUE(p_.Resume().ok());
  const std::vector<ibv_wc> wcs = Drain(pdev_->cq);
  ASSERT_EQ(wcs.size(), 4u);
  for (const ibv_wc& wc : wcs)
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS)
        << "wr_id " << wc.wr_id << ": " << ibv_wc_status_str(wc.status);
  EXPECT_STREQ(pbuf_, "to a");
  EXPECT_STREQ(pbuf_ + 64, "to b");
}

TEST_F(MigrationTest, CompletionsFoundByTheDrainWaitInTheShadowCq) {
  Connect();
  PostRecv(q_, qqp_, 100, qbuf_, qmr_);
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "x"), 0);  // not polled yet
  uint32_t drained = 0;
  ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  EXPECT_EQ(drained, 1u) << "the signaled send completed during the drain";
  EXPECT_EQ(p_.Describe().pending_completions, 1u);
  EXPECT_TRUE(Drain(pdev_->cq).empty()) << "paused: nothing new";
  ASSERT_TRUE(p_.Release().ok());
  ASSERT_TRUE(p_.Restore("", {}).ok());
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  ASSERT_TRUE(p_.Resume().ok());
  EXPECT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{1})) << "exactly once";
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100}));
  EXPECT_TRUE(Drain(pdev_->cq).empty());
}

// Completions a pause held are handed out on the long way; once they are
// out, the CQ's word is its path's alone again, which the one-compare
// entries take: the marked path after a pause, the translating one after
// a move.
TEST_F(MigrationTest, ACqThatHandedOutHeldCompletionsTakesItsOneCompareEntryAgain) {
  Connect();
  const Cq* cq = ShimCq(pdev_->cq);
  ASSERT_TRUE(cq->path.Is(Path::kMarked));
  for (bool move : {false, true}) {
    PostRecv(q_, qqp_, 100, qbuf_, qmr_);
    ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "x"), 0);  // not polled yet
    Quiesce();
    EXPECT_EQ(p_.Describe().pending_completions, 1u);
    EXPECT_TRUE(cq->path.long_way());
    if (move) {
      ASSERT_TRUE(p_.Release().ok());
      ASSERT_TRUE(p_.Restore("", {}).ok());
      ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());  // Q resumes
    } else {
      ASSERT_TRUE(q_.Resume().ok());
    }
    ASSERT_TRUE(p_.Resume().ok());
    EXPECT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{1})) << "move " << move;
    EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100}));
    EXPECT_FALSE(cq->path.long_way()) << "move " << move;
    EXPECT_TRUE(cq->path.Is(move ? Path::kTranslated : Path::kMarked)) << "move " << move;
  }
}

// A peer re-pointed a second time at the place it was re-pointed at (the
// request asked again by a migrator restarted after the re-point) keeps
// its QP as it is: reset and brought up again, it would start over from
// the PSNs of its first connection while P's QP has gone on (in the lab,
// P's writes stalled for good). A later move of P re-points it again.
TEST_F(MigrationTest, APeerRepointedAgainAtTheSamePlaceKeepsItsConnection) {
  Connect();
  Move();
  const auto q_modifies = [this] {
    int n = 0;
    for (const FakeBackend::ModifyRecord& m : fake_.modifies())
      n += m.qp_num == ShimQp(qqp_)->physical_qpn;
    return n;
  };
  const int modified = q_modifies();
  PostRecv(q_, qqp_, 100, qbuf_, qmr_);
  const size_t recvs = fake_.recvs().size();
  uint32_t drained = 0;
  ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
  const Status again = q_.PeerReconnect(ToMapping(p_.Describe()));
  ASSERT_TRUE(again.ok()) << again.message;
  EXPECT_EQ(q_modifies(), modified) << "Q's QP reset and brought up again";
  EXPECT_EQ(fake_.recvs().size(), recvs) << "Q's receive flushed and posted again";
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "after"), 0);
  EXPECT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{1}));
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100}));
  EXPECT_STREQ(qbuf_, "after");
  Move();
  EXPECT_GT(q_modifies(), modified) << "P moved again: Q re-pointed";
}

TEST_F(MigrationTest, AQpInTheErrorStateDoesNotHoldUpTheDrain) {
  Connect();
  // Q is not ready for it: RNR, retries exhausted, P's QP in error.
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "x"), 0);
  ASSERT_EQ(Send(pqp_, 2, pbuf_ + 2048, pmr_, "y"), 0);
  uint32_t drained = 0;
  const Status st = p_.Quiesce(1000, &drained);
  ASSERT_TRUE(st.ok()) << st.message;
  ASSERT_TRUE(p_.Resume().ok());
  const std::vector<ibv_wc> wcs = Drain(pdev_->cq);
  ASSERT_EQ(wcs.size(), 2u) << "the application still sees both";
  EXPECT_EQ(wcs[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
}

TEST_F(MigrationTest, UdDatagramsReachAMovedQpThroughTheSameAddressHandle) {
  ibv_qp *pud = nullptr, *qud = nullptr;
  UdPair(&pud, &qud);
  ibv_ah* ah = qdev_->Ah(pdev_->gid);
  static char rbuf[4096];
  ibv_mr* rmr = pdev_->Reg(rbuf, sizeof(rbuf));
  for (int i = 0; i < 2; ++i) ASSERT_EQ(PostRecvOf(pud, 300 + i, rbuf + 512 * i, 512, rmr), 0);
  Move();
  // To the virtual QPN P gave out.
  ASSERT_EQ(Send(qud, 7, qbuf_, qmr_, "datagram", ah, pud->qp_num), 0);
  const std::vector<ibv_wc> got = Drain(pdev_->cq);
  ASSERT_EQ(WrIds(got), (std::vector<uint64_t>{300})) << "the receive posted before the move";
  EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
  EXPECT_STREQ(rbuf + FakeBackend::kGrhBytes, "datagram");

  // And back: Q sees the moved sender by the QPN P gave out.
  static char qrbuf[1024];
  ibv_mr* qrmr = qdev_->Reg(qrbuf, sizeof(qrbuf));
  ASSERT_EQ(PostRecvOf(qud, 400, qrbuf, 512, qrmr), 0);
  ibv_ah* back = pdev_->Ah(qdev_->gid);
  ASSERT_EQ(Send(pud, 8, pbuf_, pmr_, "abc", back, qud->qp_num), 0);
  const std::vector<ibv_wc> q = Drain(qdev_->cq);
  ASSERT_EQ(q.size(), 2u);  // Q's send to P, then P's datagram
  EXPECT_EQ(q[1].wr_id, 400u);
  EXPECT_EQ(q[1].src_qp, pud->qp_num) << "the virtual QPN, not the new physical one";
  EXPECT_NE(q[1].src_qp, ShimQp(pud)->physical_qpn);
}

// A datagram whose send completed at Q but that rxe had not yet handed to
// P's QP when P moved (a peer on the same host: the receiver's responder
// runs after the sender's completion) is received, not dropped by the
// release's move to the error state.
TEST_F(MigrationTest, ADatagramStillOnItsWayWhenTheReceiverMovesIsReceived) {
  ibv_qp *pud, *qud;
  UdPair(&pud, &qud);
  ibv_ah* ah = qdev_->Ah(pdev_->gid);
  static char rbuf[4096];
  ibv_mr* rmr = pdev_->Reg(rbuf, sizeof(rbuf));
  for (int i = 0; i < 2; ++i) ASSERT_EQ(PostRecvOf(pud, 300 + i, rbuf + 512 * i, 512, rmr), 0);
  fake_.set_ud_delivery_delay_ms(20);
  ASSERT_EQ(Send(qud, 7, qbuf_, qmr_, "in flight", ah, pud->qp_num), 0);
  fake_.set_ud_delivery_delay_ms(0);
  Move();
  const std::vector<ibv_wc> got = Drain(pdev_->cq);
  ASSERT_EQ(WrIds(got), (std::vector<uint64_t>{300})) << "the datagram was lost in the move";
  EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
  EXPECT_STREQ(rbuf + FakeBackend::kGrhBytes, "in flight");
}

TEST_F(MigrationTest, AFailedRestoreLeavesNothingAndCanBeRetried) {
  Connect();
  uint32_t drained = 0;
  ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Release().ok());
  const int released = fake_.live_objects();
  fake_.FailNext(FakeBackend::Op::kCreateQp, ENOMEM);
  const Status st = p_.Restore("", {});
  EXPECT_EQ(st.code, Code::kResourceExhausted);
  EXPECT_NE(st.message.find("ibv_create_qp"), std::string::npos) << st.message;
  EXPECT_EQ(fake_.live_objects(), released) << "nothing half-created";
  EXPECT_EQ(p_.Restore("no-such-device", {}).code, Code::kNotFound);
  ASSERT_TRUE(p_.Restore("", {}).ok());
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  ASSERT_TRUE(p_.Resume().ok());
}

// Post-copy: a memory region whose pages userfaultfd has not filled yet
// cannot be pinned (EFAULT); the restore brings its pages in and registers
// it again, and the move goes on (without the retry, the restore fails
// with "Bad address"). The release of a post-copy locks the registered
// memory; the restore unlocks it.
TEST_F(MigrationTest, ARegionWhosePagesAreNotInYetIsRegisteredOnceTheyAre) {
  Connect();
  uint32_t drained = 0;
  ASSERT_TRUE(q_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Release(KnownPages(), nullptr, /*lock_registered=*/true).ok());
  fake_.FailNext(FakeBackend::Op::kRegMr, EFAULT);
  ASSERT_TRUE(p_.Restore("", {}).ok());
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  ASSERT_TRUE(p_.Resume().ok());
  ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "after"), 0);
}

TEST_F(MigrationTest, StepsOutOfOrderAreRefused) {
  Connect();
  EXPECT_EQ(p_.Release().code, Code::kFailedPrecondition) << "release before quiesce";
  EXPECT_EQ(p_.Restore("", {}).code, Code::kFailedPrecondition) << "restore while running";
  EXPECT_EQ(q_.PeerReconnect(ToMapping(p_.Describe())).code, Code::kFailedPrecondition);
  uint32_t drained = 0;
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Release().ok());
  EXPECT_EQ(p_.Resume().code, Code::kFailedPrecondition) << "resume while released";
  ASSERT_TRUE(p_.Restore("", {}).ok());
  ASSERT_TRUE(p_.Resume().ok());
}

TEST_F(MigrationTest, AfterARestoreStepsRunOnAThreadThatPolls) {
  Connect();
  p_.set_app_thread_wait_ms(5000);
  std::atomic<bool> stop{false};
  std::thread app = QuiesceWithAPollingThread(&stop);
  EXPECT_TRUE(p_.Release().ok());
  EXPECT_EQ(p_.steps_on_app_threads(), 0) << "the first release: the opener's own credentials";
  EXPECT_TRUE(p_.Restore("", {}).ok());
  EXPECT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  EXPECT_TRUE(p_.Resume().ok());
  stop.store(true);
  app.join();
  EXPECT_EQ(p_.steps_on_app_threads(), 2)
      << "the restore that reopened the device, and the resume, ran on the polling thread";
}

// A step an application thread took up and cannot finish (its verb stuck
// in the kernel) is waited for within a bound and said; no other step
// runs beside it; once it ends, the endpoint moves on.
TEST_F(MigrationTest, AStepStuckOnAnApplicationThreadIsReportedNotWaitedForever) {
  Connect();
  p_.set_app_thread_wait_ms(5000);
  p_.set_step_timeout_ms(300);
  std::atomic<bool> stop{false};
  std::thread app = QuiesceWithAPollingThread(&stop);
  ASSERT_TRUE(p_.Release().ok());
  fake_.set_stall_open_device(true);
  const Status stuck = p_.Restore("", {});
  EXPECT_EQ(stuck.code, Code::kDeadlineExceeded);
  EXPECT_NE(stuck.message.find("the restore step has run on an application thread for 300 ms"),
            std::string::npos)
      << stuck.message;
  const Status refused = p_.Resume();
  EXPECT_EQ(refused.code, Code::kUnavailable);
  EXPECT_NE(refused.message.find("restore step is still running"), std::string::npos)
      << refused.message;
  fake_.set_stall_open_device(false);
  // The stuck restore finishes on its thread; then steps run again.
  Status resumed;
  for (int i = 0; i < 5000; ++i) {
    resumed = p_.Resume();
    if (resumed.code != Code::kUnavailable) break;
    usleep(1000);
  }
  EXPECT_TRUE(resumed.ok()) << resumed.message;
  EXPECT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  stop.store(true);
  app.join();
}

// Until `done` or 10 s; whether it became true.
bool WaitUntil(const std::function<bool()>& done) {
  for (int i = 0; i < 10000; ++i) {
    if (done()) return true;
    usleep(1000);
  }
  return done();
}

// A control verb the application calls while its endpoint is away (released
// for a move) waits for the endpoint to be back and then runs on the
// re-created objects: it never reaches one whose hardware half is gone.
// The waiting thread is an application thread: it runs the restore.
TEST_F(MigrationTest, AControlVerbWhileReleasedWaitsForTheResume) {
  Connect();
  Quiesce();
  ASSERT_TRUE(p_.Release().ok());
  p_.set_app_thread_wait_ms(5000);
  int rc = -1;
  ibv_qp_attr attr{};
  std::thread app([&] {
    ibv_qp_init_attr init{};
    rc = p_.QueryQp(pqp_, &attr, IBV_QP_STATE, &init);
  });
  ASSERT_TRUE(WaitUntil([&] { return p_.control_waiters() == 1; }));
  EXPECT_EQ(rc, -1) << "the verb returned while the endpoint was released";
  const Status st = p_.Restore("", {});
  ASSERT_TRUE(st.ok()) << st.message;
  EXPECT_EQ(p_.steps_on_app_threads(), 1) << "the waiting thread ran the restore";
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  ASSERT_TRUE(p_.Resume().ok());
  app.join();
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_RTS);
}

// What needs no hardware half does not wait for the endpoint to be back
// (a program that exits during a move, or one whose move left it
// released): a QP destroyed while released is gone at once, and the
// restore does not re-create it.
TEST_F(MigrationTest, ADestroyWhileReleasedReturnsAtOnceAndIsNotRecreated) {
  Connect();
  ibv_qp_init_attr attr{};
  attr.send_cq = pdev_->cq;
  attr.recv_cq = pdev_->cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = 4;
  attr.cap.max_recv_wr = 4;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  ibv_qp* extra = p_.CreateQp(pdev_->pd, &attr);
  ASSERT_NE(extra, nullptr);
  Quiesce();
  ASSERT_TRUE(p_.Release().ok());
  std::atomic<int> rc{-1};
  std::thread app([&] { rc = p_.DestroyQp(extra); });
  const bool returned = WaitUntil([&] { return rc.load() != -1; });
  EXPECT_TRUE(returned) << "the destroy waited for the endpoint to be back";
  ASSERT_TRUE(p_.Restore("", {}).ok());
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  ASSERT_TRUE(p_.Resume().ok());
  app.join();
  EXPECT_EQ(rc.load(), 0);
  EXPECT_EQ(p_.Describe().qps, 1u) << "the destroyed QP was re-created";
}

// A release waits for the control verbs already running; one that does not
// return within the bound fails the release, which leaves the endpoint as
// it was (paused); once the verb is back, the release goes through, and
// what the verb made moves with the rest.
TEST_F(MigrationTest, AReleaseWaitsForAControlVerbInFlightWithinABound) {
  Connect();
  p_.set_control_wait_ms(300);
  fake_.set_stall_open_device(true);
  ibv_context* extra = nullptr;
  std::thread app([&] {
    int n = 0;
    ibv_device** list = p_.GetDeviceList(&n);
    extra = p_.OpenDevice(list[0]);
    p_.FreeDeviceList(list);
  });
  ASSERT_TRUE(WaitUntil([&] { return fake_.stalled_opens() == 1; }));
  Quiesce();
  const Status refused = p_.Release();
  EXPECT_EQ(refused.code, Code::kDeadlineExceeded);
  EXPECT_NE(refused.message.find("did not return within 300 ms"), std::string::npos)
      << refused.message;
  EXPECT_FALSE(p_.Describe().released);
  fake_.set_stall_open_device(false);
  app.join();
  ASSERT_NE(extra, nullptr);
  ReleaseRestoreResume();
  ibv_device_attr dev{};
  EXPECT_EQ(p_.QueryDevice(extra, &dev), 0);
  EXPECT_EQ(p_.CloseDevice(extra), 0);
}

TEST(MigrationNotMigratableTest, QuiesceRefusesAShimWhoseQueuesTakeTheFastPath) {
  FakeBackend fake;
  Shim shim(&fake, IdentityMode{});
  uint32_t drained = 0;
  const Status st = shim.Quiesce(100, &drained);
  EXPECT_EQ(st.code, Code::kFailedPrecondition);
  EXPECT_NE(st.message.find("fast path"), std::string::npos);
}

TEST(MigrationGateTest, AMigratableShimsQueuesRunInsideTheThreadsMark) {
  FakeBackend fake;
  Shim shim(&fake, IdentityMode{}, true);
  {
    Device<Shim> dev(shim);
    ibv_qp* qp = dev.Qp(IBV_QPT_RC);
    EXPECT_EQ(ShimQp(qp)->path.get(), Path::kMarked);
    EXPECT_EQ(ShimCq(dev.cq)->path.get(), Path::kMarked);
    // A UD QP's sends are counted where they complete: its CQ translates.
    ibv_qp* ud = dev.Qp(IBV_QPT_UD);
    EXPECT_EQ(ShimQp(ud)->path.get(), Path::kTranslated);
    EXPECT_EQ(ShimCq(dev.cq)->path.get(), Path::kTranslated);
  }
  EXPECT_EQ(fake.live_objects(), 0);
}

TEST(MigrationGateTest, TheFastPathIsDirectWithoutAMigrator) {
  FakeBackend fake;
  Shim shim(&fake, IdentityMode{});
  {
    Device<Shim> dev(shim);
    ibv_qp* qp = dev.Qp(IBV_QPT_RC);
    EXPECT_EQ(ShimQp(qp)->path.get(), Path::kDirect);
    EXPECT_EQ(ShimCq(dev.cq)->path.get(), Path::kDirect);
  }
  EXPECT_EQ(fake.live_objects(), 0);
}

}  // namespace
}  // namespace rdmavirt::shim::testing

namespace rdmavirt::shim::testing {
namespace {

class DrainTest : public TwoEndpointsTest {
 protected:
  void Connect(int access) {
    pqp_ = pdev_->Qp(IBV_QPT_RC);
    qqp_ = qdev_->Qp(IBV_QPT_RC);
    ASSERT_EQ(ToRts(p_, pqp_, qqp_->qp_num, qdev_->gid, kIpv4GidIndex, access), 0);
    ASSERT_EQ(ToRts(q_, qqp_, pqp_->qp_num, pdev_->gid, kIpv4GidIndex, access), 0);
  }
  void Move() {
    Quiesce();
    ReleaseRestoreResume();
  }
  int SendUnsignaled(ibv_qp* qp, char* buf, ibv_mr* mr, const char* text) {
    strcpy(buf, text);
    ibv_sge sge = Sge(buf, static_cast<uint32_t>(strlen(text) + 1), mr);
    ibv_send_wr wr{};
    wr.wr_id = 77;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp, &wr, &bad);
  }
};

// ibv_rc_pingpong allows no remote access on its QPs: the drain's
// zero-length RDMA WRITE must still be accepted (the shim allows remote
// writes on the real QP), and a query shows what the program set.
TEST_F(DrainTest, QpsThatAllowNoRemoteAccessMoveAndShowTheirOwnFlags) {
  Connect(/*access=*/0);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(PostRecvOf(qqp_, 100 + i, qbuf_ + 64 * i, 64, qmr_), 0);
  ASSERT_EQ(SendUnsignaled(pqp_, pbuf_ + 2048, pmr_, "one"), 0);
  const int calls = fake_.post_send_calls();
  Move();
  EXPECT_EQ(fake_.post_send_calls(), calls + 2) << "one marker from each side";
  ASSERT_EQ(Send(pqp_, 2, pbuf_ + 2048 + 64, pmr_, "two"), 0);
  EXPECT_EQ(WrIds(Drain(qdev_->cq)), (std::vector<uint64_t>{100, 101}));
  EXPECT_STREQ(qbuf_, "one");
  EXPECT_STREQ(qbuf_ + 64, "two");
  EXPECT_EQ(WrIds(Drain(pdev_->cq)), (std::vector<uint64_t>{2})) << "no marker is shown";
  for (auto [shim, qp] : {std::pair<Shim*, ibv_qp*>{&p_, pqp_}, {&q_, qqp_}}) {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    ASSERT_EQ(shim->QueryQp(qp, &attr, IBV_QP_ACCESS_FLAGS, &init), 0);
    EXPECT_EQ(attr.qp_access_flags, 0u);
    EXPECT_NE(ShimQp(qp)->path.get(), Path::kDirect);
  }
}

// Receives still posted are counted from their flushes; when the receive
// queue is full there is no room for the marker receive, and all of its
// slots are the count.
TEST_F(DrainTest, AFullReceiveQueueIsPostedAgainWhole) {
  Connect(kAllRemoteAccess);
  const uint32_t slots = ShimQp(pqp_)->init.cap.max_recv_wr;
  ASSERT_LE(slots * 16, 2048u);
  for (uint32_t i = 0; i < slots; ++i)
    ASSERT_EQ(PostRecvOf(pqp_, 1000 + i, pbuf_ + 16 * i, 16, pmr_), 0);
  Move();
  EXPECT_EQ(ShimQp(pqp_)->outstanding.size(), 0u) << "re-posted";
  std::vector<uint64_t> got;
  for (uint32_t i = 0; i < slots; ++i) {
    char text[16];
    snprintf(text, sizeof(text), "m%u", i);
    ASSERT_EQ(Send(qqp_, i, qbuf_ + 2048, qmr_, text), 0);
    for (const ibv_wc& wc : Drain(pdev_->cq)) {
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
      got.push_back(wc.wr_id);
    }
    Drain(qdev_->cq);
  }
  ASSERT_EQ(got.size(), slots);
  for (uint32_t i = 0; i < slots; ++i) {
    EXPECT_EQ(got[i], 1000 + i);
    char text[16];
    snprintf(text, sizeof(text), "m%u", i);
    EXPECT_STREQ(pbuf_ + 16 * i, text);
  }
}

// ib_send_lat sizes its send CQ for one completion. One left unpolled when
// the pause comes, then the drain's marker: the marker must not overflow
// the CQ (it would be lost, and the drain would wait for it forever).
TEST_F(DrainTest, AMarkerFitsACqTheApplicationSizedForOneCompletion) {
  ibv_cq* small = pdev_->Cq(nullptr, nullptr, 1);
  ASSERT_NE(small, nullptr);
  // The depth the device gave, less the shim's slack: at least what was
  // asked (the fake, like mlx5, rounds depths up to 2^n - 1; rxe does not).
  EXPECT_GE(small->cqe, 1);
  uint32_t depth = 1;  // the fake's depth for 1 + slack: 2^n - 1
  while (depth < 1 + Shim::kMarkerSlack) depth = depth * 2 + 1;
  EXPECT_EQ(small->cqe, static_cast<int>(depth) - Shim::kMarkerSlack) << "the slack is hidden";
  pqp_ = pdev_->Qp(IBV_QPT_RC, 4, nullptr, small, pdev_->cq);
  qqp_ = qdev_->Qp(IBV_QPT_RC);
  ASSERT_EQ(ToRts(p_, pqp_, qqp_->qp_num, qdev_->gid), 0);
  ASSERT_EQ(ToRts(q_, qqp_, pqp_->qp_num, pdev_->gid), 0);
  ASSERT_EQ(PostRecvOf(qqp_, 100, qbuf_, 64, qmr_), 0);
  ASSERT_EQ(Send(pqp_, 1, pbuf_, pmr_, "one"), 0);  // its completion stays in the CQ
  uint32_t drained = 0;
  const Status st = p_.Quiesce(300, &drained);
  ASSERT_TRUE(st.ok()) << st.message;
  ASSERT_TRUE(p_.Resume().ok());
  EXPECT_EQ(WrIds(Drain(small)), (std::vector<uint64_t>{1}));
}

// ibv_resize_cq below the completions a CQ holds is refused (EINVAL), as
// the provider refuses it natively: the slack the real CQ keeps for the
// drain's markers must not take them. rdma-core's pyverbs test_resize_cq
// found it (rxe refuses natively; under the shim the resize went through).
TEST_F(DrainTest, ShrinkingACqBelowTheCompletionsItHoldsIsRefused) {
  ibv_cq* small = pdev_->Cq(nullptr, nullptr, 3);
  ASSERT_NE(small, nullptr);
  pqp_ = pdev_->Qp(IBV_QPT_RC, 4, nullptr, small, pdev_->cq);
  qqp_ = qdev_->Qp(IBV_QPT_RC);
  ASSERT_EQ(ToRts(p_, pqp_, qqp_->qp_num, qdev_->gid), 0);
  ASSERT_EQ(ToRts(q_, qqp_, pqp_->qp_num, pdev_->gid), 0);
  ASSERT_EQ(p_.ResizeCq(small, 1), 0) << "an empty CQ shrinks";
  EXPECT_GE(small->cqe, 1);
  ASSERT_EQ(p_.ResizeCq(small, 7), 0);
  EXPECT_GE(small->cqe, 7);
  // Completions up to the depth the CQ shows, less one (as pyverbs does).
  const int cqe = small->cqe;
  const int n = std::min(cqe - 1, 100);
  ASSERT_GE(n, 6);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(PostRecvOf(qqp_, 2000 + i, qbuf_, 16, qmr_), 0);
    ASSERT_EQ(Send(pqp_, 100 + i, pbuf_, pmr_, "x"), 0);
  }
  EXPECT_EQ(p_.ResizeCq(small, 1), EINVAL) << n << " completions do not fit in 1";
  EXPECT_EQ(p_.ResizeCq(small, n - 1), EINVAL) << "nor in " << n - 1;
  EXPECT_EQ(small->cqe, cqe) << "a refused resize leaves the CQ as it was";
  EXPECT_EQ(p_.ResizeCq(small, n), 0) << "they fit in " << n;
  std::vector<uint64_t> want;
  for (int i = 0; i < n; ++i) want.push_back(100 + i);
  EXPECT_EQ(WrIds(Drain(small)), want) << "nothing lost";
  EXPECT_EQ(p_.ResizeCq(small, 1), 0) << "empty again, it shrinks";
  // A pause after it still has the slack for its marker.
  ASSERT_EQ(Send(pqp_, 1, pbuf_, pmr_, "one"), 0);
  uint32_t drained = 0;
  const Status st = p_.Quiesce(300, &drained);
  ASSERT_TRUE(st.ok()) << st.message;
  ASSERT_TRUE(p_.Resume().ok());
  EXPECT_EQ(WrIds(Drain(small)), (std::vector<uint64_t>{1}));
}

// Many QPs on one CQ (qp_holder's 1024, UCX's): the drain's markers and
// the release's and the reconnect's flushes go out for many QPs at a time,
// within the CQ's room, not one QP per round (each round a poll and a
// sleep); every receive still posted is posted again, once.
TEST_F(DrainTest, ManyQpsOnOneCqDrainAndFlushTogether) {
  constexpr int kQps = 40;
  ibv_cq* shared = pdev_->Cq(nullptr, nullptr, 2 * kQps);  // a send and a receive each
  ASSERT_NE(shared, nullptr);
  std::vector<ibv_qp*> pq, qq;
  for (int i = 0; i < kQps; ++i) {
    pq.push_back(pdev_->Qp(IBV_QPT_RC, 4, nullptr, shared, shared));
    qq.push_back(qdev_->Qp(IBV_QPT_RC));
    ASSERT_EQ(ToRts(p_, pq[i], qq[i]->qp_num, qdev_->gid, kIpv4GidIndex, kAllRemoteAccess), 0);
    ASSERT_EQ(ToRts(q_, qq[i], pq[i]->qp_num, pdev_->gid, kIpv4GidIndex, kAllRemoteAccess), 0);
    ASSERT_EQ(PostRecvOf(pq[i], 1000 + i, pbuf_ + 16 * i, 16, pmr_), 0);
    ASSERT_EQ(PostRecvOf(qq[i], 2000 + i, qbuf_ + 16 * i, 16, qmr_), 0);
  }
  uint32_t drained = 0;
  int polls = fake_.poll_cq_calls();
  ASSERT_TRUE(q_.Quiesce(1000, &drained, &pdev_->gid).ok());
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  ASSERT_TRUE(p_.Release().ok());
  EXPECT_LT(fake_.poll_cq_calls() - polls, kQps) << "markers and flushes one QP at a time";
  ASSERT_TRUE(p_.Restore("", {}).ok());
  polls = fake_.poll_cq_calls();
  ASSERT_TRUE(q_.PeerReconnect(ToMapping(p_.Describe())).ok());
  EXPECT_LT(fake_.poll_cq_calls() - polls, kQps) << "the peer's flushes one QP at a time";
  ASSERT_TRUE(p_.Resume().ok());
  std::vector<uint64_t> at_p, at_q, want_p, want_q;
  for (int i = 0; i < kQps; ++i) {
    ASSERT_EQ(Send(qq[i], i, qbuf_ + 2048, qmr_, "to p"), 0);
    ASSERT_EQ(Send(pq[i], i, pbuf_ + 2048, pmr_, "to q"), 0);
    want_p.push_back(1000 + i);
    want_q.push_back(2000 + i);
  }
  for (const ibv_wc& wc : Drain(shared))
    if (wc.opcode & IBV_WC_RECV) at_p.push_back(wc.wr_id);
  for (const ibv_wc& wc : Drain(qdev_->cq))
    if (wc.opcode & IBV_WC_RECV) at_q.push_back(wc.wr_id);
  std::sort(at_p.begin(), at_p.end());
  std::sort(at_q.begin(), at_q.end());
  EXPECT_EQ(at_p, want_p) << "P's receives, posted again after its move";
  EXPECT_EQ(at_q, want_q) << "Q's receives, posted again after the reconnect";
}

// A drain that gave up leaves its markers to complete later: the
// translating path takes them out (Cq::markers_late), one at a time and
// in batches, and hands out what came around them in order.
TEST_F(DrainTest, AMarkerThatCompletesAfterTheDrainGaveUpIsNotShown) {
  Connect(kAllRemoteAccess);
  Qp* qp = const_cast<Qp*>(ShimQp(pqp_));
  Cq* cq = qp->send_cq;
  for (int batch : {1, 16}) {
    ASSERT_EQ(Send(pqp_, 1, pbuf_ + 2048, pmr_, "one"), 0);
    ibv_send_wr marker{};  // as the drain posts it
    marker.wr_id = SendMarkerId(qp);
    marker.opcode = IBV_WR_RDMA_WRITE;
    marker.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(qp->real_post_send(qp->real, &marker, &bad), 0);
    ASSERT_EQ(Send(pqp_, 2, pbuf_ + 2048, pmr_, "two"), 0);
    MarkersLate(cq);  // what the drain does when it gives up
    std::vector<uint64_t> got;
    ibv_wc wc[16];
    // A poll that found only the marker finds nothing: the next one goes on.
    for (int polls = 0; polls < 8 && got.size() < 2; ++polls) {
      const int n = ibv_poll_cq(pdev_->cq, batch, wc);
      ASSERT_GE(n, 0);
      for (int i = 0; i < n; ++i) got.push_back(wc[i].wr_id);
    }
    EXPECT_EQ(ibv_poll_cq(pdev_->cq, batch, wc), 0);
    EXPECT_EQ(got, (std::vector<uint64_t>{1, 2})) << "polled " << batch << " at a time";
    Drain(qdev_->cq);
  }
}

// A snapshot suspends both sides at once: an endpoint quiesced as a peer
// is quiesced again as itself. Nothing reached its send queues in between,
// so the second drain posts no marker (a marker toward a peer released
// meanwhile would never be acknowledged).
TEST_F(DrainTest, ASecondQuiesceInOnePauseDrainsNothingAgain) {
  Connect(kAllRemoteAccess);
  uint32_t drained = 0;
  int calls = fake_.post_send_calls();
  ASSERT_TRUE(p_.Quiesce(1000, &drained, &qdev_->gid).ok());
  EXPECT_EQ(fake_.post_send_calls(), calls + 1);
  ASSERT_EQ(Send(pqp_, 5, pbuf_, pmr_, "queued"), 0);  // queued: the pause holds it
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  EXPECT_EQ(fake_.post_send_calls(), calls + 1) << "drained already in this pause";
  ASSERT_TRUE(p_.Resume().ok());
  calls = fake_.post_send_calls();
  ASSERT_TRUE(p_.Quiesce(1000, &drained).ok());
  EXPECT_EQ(fake_.post_send_calls(), calls + 1) << "a new pause drains again";
  ASSERT_TRUE(p_.Resume().ok());
}

// A peer's quiesce drains only its QPs toward the endpoint that moves.
TEST_F(DrainTest, AQuiesceTowardAGidPostsMarkersOnlyOnQpsConnectedThere) {
  Connect(kAllRemoteAccess);
  uint32_t drained = 0;
  ibv_gid elsewhere = pdev_->gid;
  elsewhere.raw[15] ^= 0x55;
  int calls = fake_.post_send_calls();
  ASSERT_TRUE(q_.Quiesce(1000, &drained, &elsewhere).ok());
  EXPECT_EQ(fake_.post_send_calls(), calls);
  ASSERT_TRUE(q_.Resume().ok());
  calls = fake_.post_send_calls();
  ASSERT_TRUE(q_.Quiesce(1000, &drained, &pdev_->gid).ok());
  EXPECT_EQ(fake_.post_send_calls(), calls + 1);
  ASSERT_TRUE(q_.Resume().ok());
  EXPECT_TRUE(Drain(qdev_->cq).empty());
}

}  // namespace
}  // namespace rdmavirt::shim::testing
