// The GRH area's layout, told apart as libibverbs does: every case rxe
// produces, and an IPv6 GRH whose bytes happen to look like IPv4.
#include "shim/core/grh.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/shim/verbs_test_util.h"

namespace rdmavirt::shim {
namespace {

constexpr uint8_t kSrc[4] = {10, 0, 0, 1};
constexpr uint8_t kDst[4] = {10, 0, 0, 2};

// RoCE v2 over IPv4: 20 zero bytes, then the IPv4 header.
void Ipv4Grh(uint8_t grh[40], bool checksum) {
  memset(grh, 0, 40);
  uint8_t* ip = grh + 20;
  ip[0] = 0x45;
  ip[8] = 64;
  ip[9] = 17;
  memcpy(ip + 12, kSrc, 4);
  memcpy(ip + 16, kDst, 4);
  if (checksum) {
    const uint16_t sum = Ipv4HeaderChecksum(ip);
    ip[10] = static_cast<uint8_t>(sum >> 8);
    ip[11] = static_cast<uint8_t>(sum);
  }
}

ibv_gid V4Mapped(const uint8_t a[4]) {
  ibv_gid g{};
  g.raw[10] = g.raw[11] = 0xff;
  memcpy(&g.raw[12], a, 4);
  return g;
}

using testing::GidEq;

TEST(GrhTest, Ipv4SentBetweenHostsCarriesAChecksum) {
  uint8_t grh[40];
  Ipv4Grh(grh, true);
  EXPECT_EQ(LayoutOf(grh), GrhLayout::kIpv4);
}

TEST(GrhTest, Ipv4LoopedBackOnOneHostHasNoChecksumAndIsStillIpv4) {
  uint8_t grh[40];
  Ipv4Grh(grh, false);
  EXPECT_EQ(LayoutOf(grh), GrhLayout::kIpv4);
  ibv_sge sge{reinterpret_cast<uint64_t>(grh), sizeof(grh), 0};
  ibv_gid source;
  ASSERT_TRUE(ReadGrhSource(&sge, 1, &source));
  EXPECT_TRUE(GidEq(source, V4Mapped(kSrc)));
}

TEST(GrhTest, Ipv6GrhWhoseBytesLookLikeIpv4WithoutItsChecksumIsIpv6) {
  uint8_t grh[40] = {};
  grh[0] = 0x60;
  grh[20] = 0x45;  // a byte of the source GID
  grh[30] = 0x12;
  EXPECT_EQ(LayoutOf(grh), GrhLayout::kIpv6);
  ibv_sge sge{reinterpret_cast<uint64_t>(grh), sizeof(grh), 0};
  ibv_gid source;
  ASSERT_TRUE(ReadGrhSource(&sge, 1, &source));
  EXPECT_EQ(memcmp(source.raw, grh + 8, 16), 0);
}

TEST(GrhTest, NeitherLayoutIsLeftAlone) {
  uint8_t grh[40] = {};
  EXPECT_EQ(LayoutOf(grh), GrhLayout::kNone);
  uint8_t before[40];
  memcpy(before, grh, 40);
  RewriteGrh(grh, [](const ibv_gid&) { return ibv_gid{}; });
  EXPECT_EQ(memcmp(grh, before, 40), 0);
  ibv_sge sge{reinterpret_cast<uint64_t>(grh), sizeof(grh), 0};
  ibv_gid source;
  EXPECT_FALSE(ReadGrhSource(&sge, 1, &source));
}

TEST(GrhTest, RewritingALoopedBackHeaderMapsBothAddressesAndFillsTheChecksum) {
  uint8_t grh[40];
  Ipv4Grh(grh, false);
  const uint8_t virt[4] = {10, 9, 9, 9};
  RewriteGrh(grh, [&](const ibv_gid& g) { return GidEq(g, V4Mapped(kSrc)) ? V4Mapped(virt) : g; });
  const uint8_t* ip = grh + 20;
  EXPECT_EQ(memcmp(ip + 12, virt, 4), 0);
  EXPECT_EQ(memcmp(ip + 16, kDst, 4), 0);
  EXPECT_EQ(ip[10] << 8 | ip[11], Ipv4HeaderChecksum(ip));
  EXPECT_EQ(LayoutOf(grh), GrhLayout::kIpv4);
}

}  // namespace
}  // namespace rdmavirt::shim
