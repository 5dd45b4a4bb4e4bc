#include "shim/core/identity.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim {
namespace {

ibv_gid MakeGid(std::initializer_list<uint8_t> bytes) {
  ibv_gid g{};
  int i = 0;
  for (uint8_t b : bytes) g.raw[i++] = b;
  return g;
}

ibv_gid Ipv4Mapped(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  return MakeGid({0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d});
}

using testing::GidEq;

TEST(IdentityModeTest, DefaultModeIsTheIdentity) {
  const IdentityMode mode;
  for (uint32_t v : {0u, 17u, 0x1d1u, 0x7fffffu, kQpnMarker | 5}) {
    EXPECT_EQ(mode.VirtualQpn(v), v);
    EXPECT_EQ(mode.PhysicalQpn(v), v);
  }
  for (uint32_t v : {0u, 0x5a3f1u, kRkeyMarker | 0x100u, 0xffffffffu}) {
    EXPECT_EQ(mode.VirtualRkey(v), v);
    EXPECT_EQ(mode.PhysicalRkey(v), v);
  }
  const ibv_gid g = Ipv4Mapped(10, 77, 0, 9);
  EXPECT_TRUE(GidEq(mode.VirtualGid(g), g));
  EXPECT_TRUE(GidEq(mode.PhysicalGid(g), g));
}

TEST(IdentityModeTest, OffsetModeMarksQpnsAndRkeys) {
  const IdentityMode mode{.offset = true};
  EXPECT_EQ(mode.VirtualQpn(0x1d1), 0x1d1 | kQpnMarker);
  EXPECT_NE(mode.VirtualQpn(0x1d1), 0x1d1u);
  EXPECT_EQ(mode.PhysicalQpn(mode.VirtualQpn(0x1d1)), 0x1d1u);
  EXPECT_EQ(mode.VirtualRkey(0x5a3f1), 0x5a3f1 | kRkeyMarker);
  EXPECT_EQ(mode.PhysicalRkey(mode.VirtualRkey(0x5a3f1)), 0x5a3f1u);
  // The result stays a 24-bit QPN.
  EXPECT_EQ(mode.VirtualQpn(0x7fffff) >> 24, 0u);
}

TEST(IdentityModeTest, OffsetModeLeavesUnmarkedNumbersAlone) {
  // A physical QPN handed out by someone else (kernel CM) has no marker:
  // PhysicalQpn must not change it.
  const IdentityMode mode{.offset = true};
  EXPECT_EQ(mode.PhysicalQpn(0x1d1), 0x1d1u);
  EXPECT_EQ(mode.PhysicalRkey(0x5a3f1), 0x5a3f1u);
}

TEST(IdentityModeTest, OffsetModeKeepsIpv4MappedGidsIpv4Mapped) {
  // The marker is a bit of the third IPv4 octet, so the virtual GID still
  // fits the IPv4 header of a RoCEv2 UD receive's GRH.
  const IdentityMode mode{.offset = true};
  const ibv_gid phys = Ipv4Mapped(10, 77, 0, 9);
  const ibv_gid virt = mode.VirtualGid(phys);
  EXPECT_FALSE(GidEq(virt, phys));
  EXPECT_TRUE(GidEq(virt, Ipv4Mapped(10, 77, 0 | kGidMarkerBit, 9)));
  EXPECT_TRUE(GidEq(mode.PhysicalGid(virt), phys));
}

TEST(IdentityModeTest, OffsetModeMarksLinkLocalGids) {
  const IdentityMode mode{.offset = true};
  const ibv_gid ll = MakeGid({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 0x16, 0x3e, 0xff, 0xfe, 0x4d, 0, 9});
  const ibv_gid virt = mode.VirtualGid(ll);
  EXPECT_FALSE(GidEq(virt, ll));
  EXPECT_EQ(virt.raw[kGidMarkerByte], kGidMarkerBit);
  EXPECT_EQ(memcmp(virt.raw, ll.raw, kGidMarkerByte), 0);
  EXPECT_TRUE(GidEq(mode.PhysicalGid(virt), ll));
}

TEST(IdentityModeTest, OffsetModePhysicalGidOfUnmarkedGidIsItself) {
  // A GID from outside (no marker) passes through PhysicalGid unchanged.
  const IdentityMode mode{.offset = true};
  const ibv_gid g = Ipv4Mapped(192, 168, 1, 1);
  EXPECT_TRUE(GidEq(mode.PhysicalGid(g), g));
}

TEST(IdentityModeTest, OffsetModeLeavesMulticastGroupsAndTheirQpnAlone) {
  // mckey under the shim in offset mode: a send to ::ffff:239.1.2.3 went
  // to QPN 0x7fffff, and no member of the group received it. A group's
  // GID (and its third octet's high bit) is every member's, not an
  // endpoint's.
  const IdentityMode mode{.offset = true};
  EXPECT_EQ(mode.PhysicalQpn(kMulticastQpn), kMulticastQpn);
  EXPECT_EQ(mode.VirtualQpn(kMulticastQpn), kMulticastQpn);
  for (const ibv_gid& group :
       {Ipv4Mapped(239, 1, 2, 3), Ipv4Mapped(239, 1, 130, 3), Ipv4Mapped(224, 0, 0, 251),
        MakeGid({0xff, 0x12, 0x40, 0x1b, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x80, 1})}) {
    EXPECT_TRUE(IdentityMode::IsMulticast(group));
    EXPECT_TRUE(GidEq(mode.VirtualGid(group), group));
    EXPECT_TRUE(GidEq(mode.PhysicalGid(group), group));
  }
  // Unicast neighbours of the ranges are still marked.
  for (const ibv_gid& unicast : {Ipv4Mapped(223, 1, 2, 3), Ipv4Mapped(240, 1, 2, 3)}) {
    EXPECT_FALSE(IdentityMode::IsMulticast(unicast));
    EXPECT_FALSE(GidEq(mode.VirtualGid(unicast), unicast));
  }
}

TEST(IdentityModeTest, OffsetModeLeavesAnEmptyGidEmpty) {
  // ibv_devinfo -v lists only nonzero GIDs: a marked empty entry showed
  // all 1024 entries of rxe's table in offset mode.
  const IdentityMode mode{.offset = true};
  const ibv_gid empty{};
  EXPECT_TRUE(GidEq(mode.VirtualGid(empty), empty));
  EXPECT_TRUE(GidEq(mode.PhysicalGid(empty), empty));
}

TEST(VirtualLkeyTest, SlotRoundTripsInBothModes) {
  for (bool offset : {false, true}) {
    for (uint32_t slot : {0u, 1u, 255u, 256u, 0x1234u, kMaxMrs - 2}) {
      const uint32_t v = MakeVirtualLkey(slot, 0x5a3f1, offset);
      EXPECT_EQ(LkeySlot(v), slot) << "slot " << slot << " offset " << offset;
    }
  }
}

TEST(VirtualLkeyTest, TagIsThePhysicalKeysLowByte) {
  EXPECT_EQ(MakeVirtualLkey(0, 0x5a3f1, false), (1u << 8) | 0xf1);
  EXPECT_EQ(MakeVirtualLkey(7, 0x5a3f1, false) & 0xff, 0xf1u);
  EXPECT_EQ(MakeVirtualLkey(7, 0x5a300, false) & 0xff, 0u);
}

TEST(VirtualLkeyTest, OffsetModeSetsItsBitAndNothingElse) {
  for (uint32_t slot : {0u, 42u, kMaxMrs - 2}) {
    const uint32_t plain = MakeVirtualLkey(slot, 0xabcdef, false);
    const uint32_t marked = MakeVirtualLkey(slot, 0xabcdef, true);
    EXPECT_EQ(marked, plain | kLkeyOffsetBit);
    EXPECT_EQ(plain & kLkeyOffsetBit, 0u);
  }
}

TEST(VirtualLkeyTest, NeverZero) {
  // Slot 0 is encoded as 1 << 8: a zeroed SGE lkey is never a live key.
  EXPECT_NE(MakeVirtualLkey(0, 0, false), 0u);
}

}  // namespace
}  // namespace rdmavirt::shim
