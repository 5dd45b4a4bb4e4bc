#include "shim/core/tables.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace rdmavirt::shim {
namespace {

TEST(MrTableTest, TranslatesKnownKeys) {
  MrTable t;
  uint32_t slot;
  ASSERT_TRUE(t.Allocate(&slot));
  const uint32_t v = MakeVirtualLkey(slot, 0x5a3f1, true);
  t.Set(slot, v, 0x5a3f1);
  EXPECT_EQ(t.ToPhysical(v), 0x5a3f1u);
}

TEST(MrTableTest, UnknownKeysPassThrough) {
  MrTable t;
  uint32_t slot;
  ASSERT_TRUE(t.Allocate(&slot));
  const uint32_t v = MakeVirtualLkey(slot, 0x5a3f1, false);
  t.Set(slot, v, 0x5a3f1);
  // Same slot, other tag; an empty slot; a key nobody made.
  EXPECT_EQ(t.ToPhysical(v ^ 0x01), v ^ 0x01);
  const uint32_t empty = MakeVirtualLkey(slot + 1, 0x22, false);
  EXPECT_EQ(t.ToPhysical(empty), empty);
  EXPECT_EQ(t.ToPhysical(0xdeadbeef), 0xdeadbeefu);
  EXPECT_EQ(t.ToPhysical(0), 0u);
  // The offset bit is part of the key: the other mode's key is unknown.
  EXPECT_EQ(t.ToPhysical(v | kLkeyOffsetBit), v | kLkeyOffsetBit);
}

// The data path reads a key's index from its bytes in memory
// (ToPhysicalAt): the same answers as from its value, for known, unknown,
// empty and other-mode keys.
TEST(MrTableTest, KeysInMemoryTranslateAsTheirValues) {
  MrTable t;
  uint32_t slot;
  ASSERT_TRUE(t.Allocate(&slot));
  const uint32_t v = MakeVirtualLkey(slot, 0x5a3f1, true);
  t.Set(slot, v, 0x5a3f1);
  const MrLookup lookup = t.lookup();
  for (const uint32_t key : {v, v ^ 0x01, v | 0xff00u, MakeVirtualLkey(slot + 1, 0x22, true),
                             0xdeadbeefu, 0u, ~0u, v & ~kLkeyOffsetBit}) {
    const uint32_t in_memory = key;
    EXPECT_EQ(lookup.ToPhysicalAt(&in_memory), lookup.ToPhysical(key)) << std::hex << key;
  }
  const uint32_t in_memory = v;
  EXPECT_EQ(lookup.ToPhysicalAt(&in_memory), 0x5a3f1u);
}

TEST(MrTableTest, ClearedKeysPassThrough) {
  MrTable t;
  uint32_t slot;
  ASSERT_TRUE(t.Allocate(&slot));
  const uint32_t v = MakeVirtualLkey(slot, 0x5a3f1, false);
  t.Set(slot, v, 0x5a3f1);
  t.Clear(slot);
  EXPECT_EQ(t.ToPhysical(v), v);
}

TEST(MrTableTest, AllocatesDistinctSlots) {
  MrTable t;
  uint32_t a, b;
  ASSERT_TRUE(t.Allocate(&a));
  t.Set(a, MakeVirtualLkey(a, 1, false), 1);
  ASSERT_TRUE(t.Allocate(&b));
  EXPECT_NE(a, b);
}

TEST(MrTableTest, ReusesSlotAfterClear) {
  MrTable t;
  std::vector<uint32_t> slots;
  for (uint32_t i = 0; i < kMaxMrs - 1; ++i) {
    uint32_t s;
    ASSERT_TRUE(t.Allocate(&s));
    t.Set(s, MakeVirtualLkey(s, i, false), i + 1);
    slots.push_back(s);
  }
  uint32_t s;
  ASSERT_FALSE(t.Allocate(&s)) << "table should be full";
  t.Clear(slots[1234]);
  ASSERT_TRUE(t.Allocate(&s));
  EXPECT_EQ(s, slots[1234]);
}

TEST(MrTableTest, FullTableRefusesAndKeepsTranslating) {
  MrTable t;
  uint32_t s = 0;
  uint32_t n = 0;
  while (t.Allocate(&s)) {
    t.Set(s, MakeVirtualLkey(s, 0x42, true), 0x10000 + s);
    ++n;
  }
  // One slot is never handed out: (kMaxMrs-1)+1 would overflow the slot field.
  EXPECT_EQ(n, kMaxMrs - 1);
  EXPECT_EQ(t.ToPhysical(MakeVirtualLkey(0, 0x42, true)), 0x10000u);
  EXPECT_EQ(t.ToPhysical(MakeVirtualLkey(kMaxMrs - 2, 0x42, true)), 0x10000u + kMaxMrs - 2);
}

TEST(MrTableTest, ReservedEntryIsNotAKey) {
  // RegMr reserves its slot with (0xffffffff, 0) while the HCA registers.
  MrTable t;
  uint32_t s;
  ASSERT_TRUE(t.Allocate(&s));
  t.Set(s, 0xffffffffu, 0);
  const uint32_t v = MakeVirtualLkey(s, 0x42, false);
  EXPECT_EQ(t.ToPhysical(v), v);
  uint32_t other;
  ASSERT_TRUE(t.Allocate(&other));
  EXPECT_NE(other, s);
}

class QpIndexTest : public ::testing::Test {
 protected:
  Qp* NewQp(uint32_t pqpn) {
    qps_.push_back(std::make_unique<Qp>());
    qps_.back()->physical_qpn = pqpn;
    return qps_.back().get();
  }
  QpIndex index_;
  std::vector<std::unique_ptr<Qp>> qps_;
};

TEST_F(QpIndexTest, InsertFindRemove) {
  Qp* a = NewQp(0x1d1);
  Qp* b = NewQp(0x1d2);
  ASSERT_TRUE(index_.Insert(a->physical_qpn, a));
  ASSERT_TRUE(index_.Insert(b->physical_qpn, b));
  EXPECT_EQ(index_.Find(0x1d1), a);
  EXPECT_EQ(index_.Find(0x1d2), b);
  EXPECT_EQ(index_.Find(0x1d3), nullptr);
  index_.Remove(a->physical_qpn, a);
  EXPECT_EQ(index_.Find(0x1d1), nullptr);
  EXPECT_EQ(index_.Find(0x1d2), b);
}

// A free slot holds the empty QP, never taken for one: the completion
// path's one compare does not match any hardware QPN (24 bits), and Find
// says not found even for the empty QP's own number.
TEST_F(QpIndexTest, AFreeSlotHoldsAnEmptyQpThatIsNeverFound) {
  for (const uint32_t n : {0u, 0x1d1u, 0xffffffu, Qp::kNoQpn}) {
    const Qp* home = index_.Home(n);
    ASSERT_NE(home, nullptr);
    EXPECT_NE(home->plain_qpn, n & 0xffffffu) << n;
    EXPECT_EQ(index_.Find(n), nullptr) << n;
  }
  Qp* a = NewQp(0x1d1);
  a->plain_completions = true;
  a->SetPhysicalQpn(0x1d1);
  ASSERT_TRUE(index_.Insert(a->physical_qpn, a));
  EXPECT_EQ(index_.Home(0x1d1), a);
  EXPECT_EQ(index_.Home(0x1d1)->plain_qpn, 0x1d1u);
  index_.Remove(a->physical_qpn, a);
  EXPECT_NE(index_.Home(0x1d1), a);
  EXPECT_EQ(index_.Find(0x1d1), nullptr);
  // A QP whose completions need more than their QPN is found, not plain.
  Qp* b = NewQp(0x1d2);
  b->SetPhysicalQpn(0x1d2);
  ASSERT_TRUE(index_.Insert(b->physical_qpn, b));
  EXPECT_EQ(index_.Find(0x1d2), b);
  EXPECT_EQ(b->plain_qpn, Qp::kNoQpn);
}

TEST_F(QpIndexTest, CollisionGoesToOverflow) {
  // Same low kBits: same home slot.
  const uint32_t home = 0x00005;
  const uint32_t other = home | (1u << QpIndex::kBits);
  Qp* a = NewQp(home);
  Qp* b = NewQp(other);
  ASSERT_TRUE(index_.Insert(home, a));
  ASSERT_TRUE(index_.Insert(other, b));
  EXPECT_EQ(index_.Find(home), a);
  EXPECT_EQ(index_.Find(other), b);
  // Removing the home occupant leaves the overflow entry findable.
  index_.Remove(home, a);
  EXPECT_EQ(index_.Find(home), nullptr);
  EXPECT_EQ(index_.Find(other), b);
  index_.Remove(other, b);
  EXPECT_EQ(index_.Find(other), nullptr);
}

TEST_F(QpIndexTest, HomeSlotIsReusedAfterRemove) {
  const uint32_t home = 0x00007;
  Qp* a = NewQp(home);
  Qp* b = NewQp(home | (2u << QpIndex::kBits));
  ASSERT_TRUE(index_.Insert(a->physical_qpn, a));
  index_.Remove(a->physical_qpn, a);
  ASSERT_TRUE(index_.Insert(b->physical_qpn, b));
  EXPECT_EQ(index_.Find(b->physical_qpn), b);
  EXPECT_EQ(index_.Find(a->physical_qpn), nullptr);
}

TEST_F(QpIndexTest, OverflowFillsUpThenRefuses) {
  const uint32_t home = 0x00009;
  std::vector<Qp*> qps;
  for (uint32_t i = 0; i <= QpIndex::kOverflow; ++i) {
    Qp* qp = NewQp(home | (i << QpIndex::kBits));
    ASSERT_TRUE(index_.Insert(qp->physical_qpn, qp)) << i;
    qps.push_back(qp);
  }
  Qp* extra = NewQp(home | ((QpIndex::kOverflow + 1) << QpIndex::kBits));
  EXPECT_FALSE(index_.Insert(extra->physical_qpn, extra));
  for (Qp* qp : qps) EXPECT_EQ(index_.Find(qp->physical_qpn), qp);
  EXPECT_EQ(index_.Find(extra->physical_qpn), nullptr);
  // Freeing an overflow entry makes room again.
  index_.Remove(qps[3]->physical_qpn, qps[3]);
  EXPECT_TRUE(index_.Insert(extra->physical_qpn, extra));
  EXPECT_EQ(index_.Find(extra->physical_qpn), extra);
}

TEST_F(QpIndexTest, RemoveOfAbsentQpIsHarmless) {
  Qp* a = NewQp(0x1d1);
  Qp* stranger = NewQp(0x1d1);
  ASSERT_TRUE(index_.Insert(a->physical_qpn, a));
  index_.Remove(0x1d1, stranger);
  EXPECT_EQ(index_.Find(0x1d1), a);
}

}  // namespace
}  // namespace rdmavirt::shim
