#include "migrator/host/service_address.h"

#include "gtest/gtest.h"

namespace rdmavirt::migrator {
namespace {

TEST(ServiceAddressTest, ParsesAnAddressWithOrWithoutItsPrefix) {
  absl::StatusOr<ServiceAddress> a = ParseServiceAddress("10.77.0.101/24");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->addr, 0x0a4d0065u);
  EXPECT_EQ(a->prefix, 24);
  EXPECT_EQ(a->Text(), "10.77.0.101/24");
  a = ParseServiceAddress("192.168.1.7");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->prefix, 32);
  EXPECT_EQ(a->Text(), "192.168.1.7/32");
}

TEST(ServiceAddressTest, RefusesWhatNoWorkloadCanOwnSayingWhy) {
  struct Case {
    const char* text;
    const char* why;
  };
  for (const Case& c :
       {Case{"fe80::1/64", "only IPv4"}, Case{"10.0.0.256", "not an IPv4"},
        Case{"host1", "not an IPv4"}, Case{"", "not an IPv4"}, Case{"10.0.0.1/33", "8..32"},
        Case{"10.0.0.1/4", "8..32"}, Case{"10.0.0.1/", "8..32"}, Case{"10.0.0.1/x", "8..32"},
        Case{"127.0.0.1", "cannot be"}, Case{"0.0.0.0", "cannot be"},
        Case{"224.0.0.5", "cannot be"}, Case{"10.0.0.255/24", "cannot be"},
        Case{"10.0.0.0/24", "network's own"}}) {
    absl::StatusOr<ServiceAddress> a = ParseServiceAddress(c.text);
    ASSERT_FALSE(a.ok()) << c.text;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(a.status().message().find(c.why), absl::string_view::npos)
        << c.text << ": " << a.status();
  }
}

TEST(ServiceAddressTest, PointToPointPrefixesHaveNoNetworkOrBroadcastAddress) {
  EXPECT_TRUE(ParseServiceAddress("10.0.0.0/31").ok());
  EXPECT_TRUE(ParseServiceAddress("10.0.0.1/31").ok());
  EXPECT_TRUE(ParseServiceAddress("10.0.0.255/32").ok());
}

TEST(ServiceAddressTest, SameSubnetFollowsThePrefix) {
  const ServiceAddress a = *ParseServiceAddress("10.77.0.101/24");
  EXPECT_TRUE(a.SameSubnet(0x0a4d0002u));   // 10.77.0.2
  EXPECT_FALSE(a.SameSubnet(0x0a4d0102u));  // 10.77.1.2
  const ServiceAddress host = *ParseServiceAddress("10.77.0.101/32");
  EXPECT_FALSE(host.SameSubnet(0x0a4d0002u));
}

}  // namespace
}  // namespace rdmavirt::migrator
