// Errors from the device come back through the shim unchanged (same
// return value, same errno), and the shim keeps nothing of a failed call:
// TearDown checks the device holds no object and LeakSanitizer checks the
// shim freed its shadows.
#include <gtest/gtest.h>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim::testing {
namespace {

using Op = FakeBackend::Op;
using ErrorsTest = ShimTest;

TEST_F(ErrorsTest, OpenDeviceFailure) {
  fake_.FailNext(Op::kOpenDevice, ENOMEM);
  errno = 0;
  EXPECT_EQ(shim_.OpenDevice(fake_.device()), nullptr);
  EXPECT_EQ(errno, ENOMEM);
}

TEST_F(ErrorsTest, AllocPdFailure) {
  fake_.FailNext(Op::kAllocPd, ENOSPC);
  errno = 0;
  EXPECT_EQ(shim_.AllocPd(dev().ctx), nullptr);
  EXPECT_EQ(errno, ENOSPC);
}

TEST_F(ErrorsTest, RegMrFailureFreesItsSlot) {
  char buf[16];
  const int live = fake_.live_objects();
  fake_.FailNext(Op::kRegMr, EFAULT);
  errno = 0;
  EXPECT_EQ(shim_.RegMr(dev().pd, buf, sizeof(buf), reinterpret_cast<uintptr_t>(buf), kAllAccess),
            nullptr);
  EXPECT_EQ(errno, EFAULT);
  EXPECT_TRUE(shim_.Mrs().empty());
  EXPECT_EQ(fake_.live_objects(), live);
  // The next registration works and translates.
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(shim_.mr_table().ToPhysical(mr->lkey), ShimMr(mr)->real->lkey);
}

TEST_F(ErrorsTest, ReregAndDeregFailuresKeepTheMr) {
  char buf[16];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  const uint32_t lkey = mr->lkey;
  fake_.FailNext(Op::kReregMr, EINVAL);
  EXPECT_EQ(
      shim_.ReregMr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_LOCAL_WRITE),
      EINVAL);
  fake_.FailNext(Op::kDeregMr, EBUSY);
  EXPECT_EQ(shim_.DeregMr(mr), EBUSY);
  EXPECT_EQ(mr->lkey, lkey);
  EXPECT_EQ(shim_.mr_table().ToPhysical(lkey), ShimMr(mr)->real->lkey);
}

TEST_F(ErrorsTest, ReregKeepsTheVirtualLkeyAndFollowsTheRkey) {
  char buf[16];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  const uint32_t lkey = mr->lkey;
  ASSERT_EQ(shim_.ReregMr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, kAllAccess), 0);
  EXPECT_EQ(mr->lkey, lkey);
  EXPECT_EQ(mr->rkey, ShimMr(mr)->real->rkey | kRkeyMarker);
  EXPECT_EQ(shim_.mr_table().ToPhysical(lkey), ShimMr(mr)->real->lkey);
}

TEST_F(ErrorsTest, CqAndChannelFailures) {
  fake_.FailNext(Op::kCreateCompChannel, EMFILE);
  errno = 0;
  EXPECT_EQ(shim_.CreateCompChannel(dev().ctx), nullptr);
  EXPECT_EQ(errno, EMFILE);
  fake_.FailNext(Op::kCreateCq, ENOMEM);
  errno = 0;
  EXPECT_EQ(shim_.CreateCq(dev().ctx, 8, nullptr, nullptr, 0), nullptr);
  EXPECT_EQ(errno, ENOMEM);
  ibv_cq_init_attr_ex attr{};
  attr.cqe = 8;
  fake_.FailNext(Op::kCreateCq, EINVAL);
  errno = 0;
  EXPECT_EQ(shim_.CreateCqEx(dev().ctx, &attr), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // What the device does not support comes back as the device says.
  attr.wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP;
  errno = 0;
  EXPECT_EQ(shim_.CreateCqEx(dev().ctx, &attr), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

TEST_F(ErrorsTest, CreateQpFailurePassesErrnoAndKeepsNothing) {
  const int live = fake_.live_objects();
  fake_.FailNext(Op::kCreateQp, ENOSPC);
  ibv_qp_init_attr attr{};
  attr.send_cq = attr.recv_cq = dev().cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  errno = 0;
  EXPECT_EQ(shim_.CreateQp(dev().pd, &attr), nullptr);
  EXPECT_EQ(errno, ENOSPC);
  EXPECT_TRUE(shim_.Qps().empty());
  EXPECT_EQ(fake_.live_objects(), live);
  // Capacities the device refuses: its errno, unchanged.
  attr.cap.max_send_sge = FakeBackend::kMaxSge + 1;
  errno = 0;
  EXPECT_EQ(shim_.CreateQp(dev().pd, &attr), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_TRUE(shim_.Qps().empty());
}

TEST_F(ErrorsTest, CreateQpExFailure) {
  fake_.FailNext(Op::kCreateQp, EAGAIN);
  ibv_qp_init_attr_ex attr{};
  attr.send_cq = attr.recv_cq = dev().cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  attr.pd = dev().pd;
  attr.send_ops_flags = IBV_QP_EX_WITH_SEND;
  errno = 0;
  EXPECT_EQ(shim_.CreateQpEx(dev().ctx, &attr), nullptr);
  EXPECT_EQ(errno, EAGAIN);
  EXPECT_TRUE(shim_.Qps().empty());
}

TEST_F(ErrorsTest, ModifyQpFailureReturnsTheDevicesError) {
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  fake_.FailNext(Op::kModifyQp, ETIMEDOUT);
  EXPECT_EQ(ToRts(shim_, qp, qp->qp_num, dev().gid), ETIMEDOUT);
  EXPECT_EQ(qp->state, IBV_QPS_RESET);
  // Without the shim a missing attribute gives the same error.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  EXPECT_EQ(shim_.ModifyQp(qp, &attr, IBV_QP_STATE), EINVAL);
  FakeBackend bare;
  Device<FakeBackend> d(bare);
  ibv_qp* bare_qp = d.Qp(IBV_QPT_RC);
  EXPECT_EQ(bare.ModifyQp(bare_qp, &attr, IBV_QP_STATE), EINVAL);
}

TEST_F(ErrorsTest, DestroyQpFailureKeepsTheQpWorking) {
  auto [a, b] = dev().Pair(IBV_QPT_RC);
  fake_.FailNext(Op::kDestroyQp, EBUSY);
  EXPECT_EQ(shim_.DestroyQp(a), EBUSY);
  EXPECT_EQ(shim_.Qps().size(), 2u);
  // Completions still find the QP (it went back into the index).
  char buf[4];
  ibv_mr* mr = dev().Reg(buf, sizeof(buf));
  ibv_sge sge = Sge(buf, 4, mr);
  ibv_recv_wr rwr{};
  rwr.sg_list = &sge;
  rwr.num_sge = 1;
  ibv_recv_wr* rbad;
  ASSERT_EQ(ibv_post_recv(b, &rwr, &rbad), 0);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  const auto wcs = Drain(dev().cq);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[1].qp_num, a->qp_num);
}

TEST_F(ErrorsTest, DestroyFailuresOfOtherObjects) {
  fake_.FailNext(Op::kDestroyCq, EBUSY);
  EXPECT_EQ(shim_.DestroyCq(dev().cq), EBUSY);
  ibv_srq* srq = dev().Srq();
  fake_.FailNext(Op::kDestroySrq, EBUSY);
  EXPECT_EQ(shim_.DestroySrq(srq), EBUSY);
  ibv_ah* ah = dev().Ah(dev().gid);
  fake_.FailNext(Op::kDestroyAh, EIO);
  EXPECT_EQ(shim_.DestroyAh(ah), EIO);
  fake_.FailNext(Op::kDeallocPd, EBUSY);
  EXPECT_EQ(shim_.DeallocPd(dev().pd), EBUSY);
  fake_.FailNext(Op::kCloseDevice, EIO);
  EXPECT_EQ(shim_.CloseDevice(dev().ctx), EIO);
  // All still usable; the fixture destroys them for real.
}

TEST_F(ErrorsTest, DeallocPdInUseIsRefusedByTheDevice) {
  char buf[4];
  dev().Reg(buf, sizeof(buf));
  EXPECT_EQ(shim_.DeallocPd(dev().pd), EBUSY);
}

TEST_F(ErrorsTest, CreateSrqAndAhFailures) {
  ibv_srq_init_attr sattr{};
  sattr.attr.max_wr = 4;
  sattr.attr.max_sge = 1;
  fake_.FailNext(Op::kCreateSrq, ENOMEM);
  errno = 0;
  EXPECT_EQ(shim_.CreateSrq(dev().pd, &sattr), nullptr);
  EXPECT_EQ(errno, ENOMEM);
  ibv_ah_attr aattr{};
  aattr.is_global = 1;
  aattr.grh.dgid = dev().gid;
  aattr.grh.sgid_index = 1;
  aattr.port_num = 1;
  fake_.FailNext(Op::kCreateAh, ETIMEDOUT);
  errno = 0;
  EXPECT_EQ(shim_.CreateAh(dev().pd, &aattr), nullptr);
  EXPECT_EQ(errno, ETIMEDOUT);
  // RoCE needs a GRH: the device's EINVAL.
  aattr.is_global = 0;
  errno = 0;
  EXPECT_EQ(shim_.CreateAh(dev().pd, &aattr), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(ErrorsTest, QueryFailuresAreNotTranslated) {
  fake_.FailNext(Op::kQueryGid, EIO);
  ibv_gid gid;
  memset(&gid, 0xaa, sizeof(gid));
  errno = 0;
  EXPECT_EQ(shim_.QueryGid(dev().ctx, 1, 0, &gid), -1);
  EXPECT_EQ(errno, EIO);
  EXPECT_EQ(gid.raw[14], 0xaa) << "nothing virtualized on failure";
  errno = 0;
  EXPECT_EQ(shim_.QueryGid(dev().ctx, 1, 5, &gid), -1);
  EXPECT_EQ(errno, EINVAL);
  ibv_gid_entry entries[1];
  EXPECT_EQ(shim_.QueryGidTable(dev().ctx, entries, 1, 0, sizeof(entries[0])), -EINVAL);
  ibv_qp* qp = dev().Qp(IBV_QPT_RC);
  fake_.FailNext(Op::kQueryQp, EIO);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  EXPECT_EQ(shim_.QueryQp(qp, &attr, IBV_QP_STATE, &init), EIO);
}

TEST_F(ErrorsTest, ShadowsOfTheWrongKindAreNotShadows) {
  // A CQ where a channel is expected: EINVAL, nothing reaches the device.
  errno = 0;
  EXPECT_EQ(shim_.CreateCq(dev().ctx, 8, nullptr, reinterpret_cast<ibv_comp_channel*>(dev().cq), 0),
            nullptr);
  EXPECT_EQ(errno, EINVAL);
}

}  // namespace
}  // namespace rdmavirt::shim::testing
