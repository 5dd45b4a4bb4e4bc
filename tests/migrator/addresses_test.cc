#include "migrator/host/addresses.h"

#include "gtest/gtest.h"
#include "tests/migrator/fake_host.h"

namespace rdmavirt::migrator {
namespace {

TEST(AddressesTest, ParsesHostAndPort) {
  EXPECT_EQ(ParseHostPort("10.77.0.2")->Target(), "10.77.0.2:7700");
  EXPECT_EQ(ParseHostPort("10.77.0.2:7701")->Target(), "10.77.0.2:7701");
  EXPECT_EQ(ParseHostPort("host-1.example")->Target(), "host-1.example:7700");
  EXPECT_EQ(ParseHostPort("[::1]:9")->Target(), "[::1]:9");
  EXPECT_EQ(ParseHostPort("[fe80::1]")->Target(), "[fe80::1]:7700");
}

TEST(AddressesTest, RefusesWhatIsNotAHost) {
  for (const char* bad : {"", ":7700", "10.77.0.2:", "10.77.0.2:0", "10.77.0.2:65536",
                          "10.77.0.2:7x", "::1", "[::1", "[nothex]:1", "a b", "-x", "h:+1"})
    EXPECT_EQ(ParseHostPort(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
}

TEST(AddressesTest, FindsTheIpv4OfAMappedGid) {
  EXPECT_EQ(GidIpv4(testing::Gid(3)), "10.0.0.3");
  EXPECT_EQ(GidIpv4(std::string(16, '\x01')), "");
  EXPECT_EQ(GidIpv4("short"), "");
  EXPECT_EQ(GidText(testing::Gid(3)), "::ffff:10.0.0.3");
  EXPECT_TRUE(IsLocalAddress("127.0.0.1"));
  EXPECT_FALSE(IsLocalAddress("192.0.2.77"));
}

}  // namespace
}  // namespace rdmavirt::migrator
