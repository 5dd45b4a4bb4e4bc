// rdmavirtctl's VM helpers that need no libvirt: naming, XML, group
// snapshots' descriptions, hosts files.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/rdmavirtctl/domain_xml.h"
#include "tools/rdmavirtctl/drain.h"
#include "tools/rdmavirtctl/snapshot.h"

namespace rdmavirt::ctl {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

TEST(VmTest, UriHostIsTheHostPartOfALibvirtUri) {
  EXPECT_EQ(UriHost("qemu+ssh://node2/system"), "node2");
  EXPECT_EQ(UriHost("qemu+ssh://root@node2:2222/system"), "node2");
  EXPECT_EQ(UriHost("qemu+tcp://10.0.0.2/system"), "10.0.0.2");
  EXPECT_EQ(UriHost("qemu:///system"), "");
}

TEST(VmTest, InterfaceWithAliasFindsTheRdmaNic) {
  const std::string xml =
      "<domain><devices>"
      "<interface type='network'><mac address='52:54:00:00:00:01'/>"
      "<alias name='net0'/></interface>"
      "<interface type='bridge'><source bridge='br-fabric'/>"
      "<mac address='52:54:00:79:00:01'/><alias name='ua-rdmavirt-nic'/></interface>"
      "</devices></domain>";
  const std::string nic = InterfaceWithAlias(xml, "ua-rdmavirt-nic");
  EXPECT_THAT(nic, HasSubstr("br-fabric"));
  EXPECT_EQ(ElementAttribute(nic, "mac", "address"), "52:54:00:79:00:01");
  EXPECT_EQ(ElementAttribute(nic, "source", "bridge"), "br-fabric");
  EXPECT_EQ(ElementAttribute(nic, "source", "network"), "");
  EXPECT_EQ(InterfaceWithAlias(xml, "ua-other"), "");
}

TEST(VmTest, HostsFileLinesAndTheirErrors) {
  auto ok = ParseHostsFile("# fabric\nqemu+ssh://n2/system n2:7700\n\nqemu+ssh://n3/system n3\n");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_THAT(*ok, ElementsAre(Pair("qemu+ssh://n2/system", "n2:7700"),
                               Pair("qemu+ssh://n3/system", "n3")));
  auto bad = ParseHostsFile("qemu+ssh://n2/system\n");
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("line 1"));
}

TEST(VmTest, MembersNameADomainAndMaybeItsLibvirt) {
  EXPECT_THAT(ParseMember("guest2", "qemu:///system"), Pair("guest2", "qemu:///system"));
  EXPECT_THAT(ParseMember("guest2@qemu+ssh://root@n2/system", "qemu:///system"),
              Pair("guest2", "qemu+ssh://root@n2/system"));
}

TEST(VmTest, GroupDescriptionsRoundTrip) {
  const std::vector<std::string> members = {"guest1@qemu:///system", "guest2@qemu+ssh://n2/system"};
  const std::string d = GroupDescription(members);
  EXPECT_EQ(GroupMembers(d), members);
  EXPECT_THAT(GroupMembers("\n" + d), IsEmpty());  // the header comes first
  EXPECT_THAT(GroupMembers("before the upgrade"), IsEmpty());
  EXPECT_THAT(GroupMembers(""), IsEmpty());
}

TEST(VmTest, SnapshotNames) {
  EXPECT_TRUE(ValidSnapshotName("before-upgrade_2.1"));
  EXPECT_FALSE(ValidSnapshotName(""));
  EXPECT_FALSE(ValidSnapshotName("-x"));
  EXPECT_FALSE(ValidSnapshotName(".x"));
  EXPECT_FALSE(ValidSnapshotName("a b"));
  EXPECT_FALSE(ValidSnapshotName("a/b"));
  EXPECT_FALSE(ValidSnapshotName("<x>"));
}

}  // namespace
v1::InventoryHost Live(const std::string& name, bool criu = true, uint32_t ports = 1) {
  v1::InventoryHost h;
  h.set_name(name);
  h.set_address(name + ":7700");
  h.mutable_info()->set_criu_ok(criu);
  h.set_active_ports(ports);
  return h;
}

TEST(PickProcessHostTest, SpreadsOverLiveHostsThatCanTakeAProcessAndSkipsTheDead) {
  const std::vector<v1::InventoryHost> hosts = {Live("h1"), Live("h2"), Live("h3"),
                                                Live("nocriu", false), Live("noport", true, 0)};
  std::map<std::string, int> placed;
  std::vector<std::string> picks;
  for (int i = 0; i < 4; ++i) {
    const std::string p = PickProcessHost(hosts, "h1", {}, placed);
    picks.push_back(p);
    ++placed[p.substr(0, p.find(':'))];
  }
  // Never itself nor a host that cannot take it; one each, then again.
  EXPECT_EQ(picks, (std::vector<std::string>{"h2:7700", "h3:7700", "h2:7700", "h3:7700"}));
  EXPECT_EQ(PickProcessHost(hosts, "h1", {"h2"}, {}), "h3:7700");
  EXPECT_EQ(PickProcessHost(hosts, "h1", {"h2", "h3"}, {}), "");
  EXPECT_EQ(PickProcessHost({}, "h1", {}, {}), "");
}

}  // namespace rdmavirt::ctl
