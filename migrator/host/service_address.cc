#include "migrator/host/service_address.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <linux/if_packet.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <net/if_arp.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "migrator/host/scoped_fd.h"

namespace rdmavirt::migrator {
namespace {

uint32_t Mask(int prefix) { return prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix); }

std::string Dotted(uint32_t host_order) {
  in_addr a{htonl(host_order)};
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a, buf, sizeof(buf));
  return buf;
}

// Every IPv4 address of the host: (interface, address, prefix, up).
struct IfAddr {
  std::string ifname;
  uint32_t addr;
  int prefix;
  bool up;
};

absl::StatusOr<std::vector<IfAddr>> ListAddresses() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return absl::ErrnoToStatus(errno, "listing the host's addresses");
  std::vector<IfAddr> out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    IfAddr a;
    a.ifname = i->ifa_name;
    a.addr = ntohl(reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr);
    const uint32_t mask =
        i->ifa_netmask == nullptr
            ? ~uint32_t{0}
            : ntohl(reinterpret_cast<const sockaddr_in*>(i->ifa_netmask)->sin_addr.s_addr);
    a.prefix = __builtin_popcount(mask);
    a.up = (i->ifa_flags & IFF_UP) != 0;
    out.push_back(std::move(a));
  }
  freeifaddrs(list);
  return out;
}

// One rtnetlink request carrying an address, acknowledged by the kernel:
// 0 or the errno of the failure.
int AddressRequest(uint16_t type, uint16_t flags, const std::string& ifname,
                   const ServiceAddress& a) {
  const unsigned index = if_nametoindex(ifname.c_str());
  if (index == 0) return ENODEV;
  struct {
    nlmsghdr h;
    ifaddrmsg m;
    char attrs[64];
  } req{};
  req.h.nlmsg_type = type;
  req.h.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK | flags;
  req.h.nlmsg_seq = 1;
  req.m.ifa_family = AF_INET;
  req.m.ifa_prefixlen = static_cast<unsigned char>(a.prefix);
  req.m.ifa_scope = RT_SCOPE_UNIVERSE;
  req.m.ifa_index = index;
  size_t len = NLMSG_LENGTH(sizeof(ifaddrmsg));
  const uint32_t net = htonl(a.addr);
  for (uint16_t attr : {uint16_t{IFA_LOCAL}, uint16_t{IFA_ADDRESS}}) {
    auto* rta = reinterpret_cast<rtattr*>(reinterpret_cast<char*>(&req) + NLMSG_ALIGN(len));
    rta->rta_type = attr;
    rta->rta_len = RTA_LENGTH(sizeof(net));
    std::memcpy(RTA_DATA(rta), &net, sizeof(net));
    len = NLMSG_ALIGN(len) + RTA_ALIGN(rta->rta_len);
  }
  req.h.nlmsg_len = static_cast<uint32_t>(len);

  ScopedFd fd(socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE));
  if (fd.get() < 0) return errno;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (sendto(fd.get(), &req, len, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel)) < 0)
    return errno;
  alignas(nlmsghdr) char buf[8192];
  for (;;) {
    const ssize_t n = recv(fd.get(), buf, sizeof(buf), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    int left = static_cast<int>(n);
    for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
      if (h->nlmsg_type != NLMSG_ERROR) continue;
      return -reinterpret_cast<nlmsgerr*>(NLMSG_DATA(h))->error;
    }
  }
}

// "Who has A? Tell A", from A's own MAC: every neighbor that caches A
// updates it to this interface (RFC 5227's ARP announcement).
absl::Status Announce(const std::string& ifname, const ServiceAddress& a) {
  ScopedFd fd(socket(AF_PACKET, SOCK_DGRAM | SOCK_CLOEXEC, htons(ETH_P_ARP)));
  if (fd.get() < 0) return absl::ErrnoToStatus(errno, "opening a packet socket");
  ifreq ifr{};
  if (ifname.size() >= sizeof(ifr.ifr_name))
    return absl::InvalidArgumentError(absl::StrCat("interface name too long: ", ifname));
  std::memcpy(ifr.ifr_name, ifname.c_str(), ifname.size() + 1);
  if (ioctl(fd.get(), SIOCGIFHWADDR, &ifr) != 0)
    return absl::ErrnoToStatus(errno, absl::StrCat("the MAC address of ", ifname));
  if (ifr.ifr_hwaddr.sa_family != ARPHRD_ETHER)
    return absl::OkStatus();  // no ARP on this link (loopback, tunnels)
  struct __attribute__((packed)) {
    arphdr h;
    unsigned char sha[ETH_ALEN];
    uint32_t spa;
    unsigned char tha[ETH_ALEN];
    uint32_t tpa;
  } pkt{};
  pkt.h.ar_hrd = htons(ARPHRD_ETHER);
  pkt.h.ar_pro = htons(ETH_P_IP);
  pkt.h.ar_hln = ETH_ALEN;
  pkt.h.ar_pln = 4;
  pkt.h.ar_op = htons(ARPOP_REQUEST);
  std::memcpy(pkt.sha, ifr.ifr_hwaddr.sa_data, ETH_ALEN);
  pkt.spa = pkt.tpa = htonl(a.addr);
  sockaddr_ll to{};
  to.sll_family = AF_PACKET;
  to.sll_protocol = htons(ETH_P_ARP);
  to.sll_ifindex = static_cast<int>(if_nametoindex(ifname.c_str()));
  to.sll_halen = ETH_ALEN;
  std::memset(to.sll_addr, 0xff, ETH_ALEN);
  // Twice: a single frame lost on a busy segment would leave peers talking
  // to the old host until their cache entry goes stale.
  for (int i = 0; i < 2; ++i) {
    if (sendto(fd.get(), &pkt, sizeof(pkt), 0, reinterpret_cast<sockaddr*>(&to), sizeof(to)) < 0)
      return absl::ErrnoToStatus(errno, absl::StrCat("announcing ", a.Text(), " on ", ifname));
  }
  return absl::OkStatus();
}

class NetlinkAddressControl final : public AddressControl {
 public:
  absl::StatusOr<std::string> Holder(ServiceAddress* a) override {
    absl::StatusOr<std::vector<IfAddr>> all = ListAddresses();
    if (!all.ok()) return all.status();
    for (const IfAddr& i : *all) {
      if (i.addr != a->addr) continue;
      a->prefix = i.prefix;
      return i.ifname;
    }
    return absl::NotFoundError(absl::StrCat(Dotted(a->addr), " is not an address of this host"));
  }

  absl::StatusOr<std::string> Home(const ServiceAddress& a) override {
    absl::StatusOr<std::vector<IfAddr>> all = ListAddresses();
    if (!all.ok()) return all.status();
    std::string home;
    for (const IfAddr& i : *all) {
      if (i.addr == a.addr)
        return absl::AlreadyExistsError(
            absl::StrCat(Dotted(a.addr), " is already an address of this host (", i.ifname, ")"));
      if (home.empty() && i.up && a.SameSubnet(i.addr)) home = i.ifname;
    }
    if (home.empty())
      return absl::FailedPreconditionError(
          absl::StrCat("no interface of this host is on the subnet of ", a.Text()));
    return home;
  }

  absl::Status Add(const std::string& ifname, const ServiceAddress& a) override {
    // EEXIST: put back by an earlier try; announced again all the same.
    if (int err = AddressRequest(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, ifname, a);
        err != 0 && err != EEXIST)
      return absl::ErrnoToStatus(err, absl::StrCat("adding ", a.Text(), " to ", ifname));
    if (absl::Status st = Announce(ifname, a); !st.ok()) {
      // Without the announcement the peers' packets go to the old host.
      if (absl::Status undo = Remove(ifname, a); !undo.ok())
        return absl::Status(st.code(), absl::StrCat(st.message(), "; ", undo.message()));
      return st;
    }
    return absl::OkStatus();
  }

  absl::Status Remove(const std::string& ifname, const ServiceAddress& a) override {
    const int err = AddressRequest(RTM_DELADDR, 0, ifname, a);
    // The kernel says EADDRNOTAVAIL for an address that is not there.
    if (err == 0 || err == EADDRNOTAVAIL) return absl::OkStatus();
    return absl::ErrnoToStatus(err, absl::StrCat("removing ", a.Text(), " from ", ifname));
  }

  // What `ip route flush cache` does: a write to this file bumps the
  // namespace's IPv4 route generation, which every cached route is checked
  // against before use.
  // IPv4's and IPv6's: a peer reached through an IPv6 GID (link-local or
  // global) has its route cached the same way. A kernel without IPv6 has
  // no IPv6 file, and nothing to forget there.
  absl::StatusOr<std::vector<ServiceAddress>> Secondaries() override {
    absl::StatusOr<std::vector<IfAddr>> all = ListAddresses();
    if (!all.ok()) return all.status();
    // getifaddrs lists an interface's addresses in the kernel's order,
    // primaries first.
    std::vector<ServiceAddress> out;
    for (size_t i = 0; i < all->size(); ++i) {
      const IfAddr& a = (*all)[i];
      const ServiceAddress s{a.addr, a.prefix};
      for (size_t j = 0; j < i; ++j) {
        const IfAddr& b = (*all)[j];
        if (b.ifname == a.ifname && s.SameSubnet(b.addr)) {
          out.push_back(s);
          break;
        }
      }
    }
    return out;
  }

  absl::Status ForgetCachedRoutes() override {
    if (absl::Status st = Flush("/proc/sys/net/ipv4/route/flush", false); !st.ok()) return st;
    return Flush("/proc/sys/net/ipv6/route/flush", true);
  }

 private:
  static absl::Status Flush(const char* path, bool may_be_absent) {
    const int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 && may_be_absent && errno == ENOENT) return absl::OkStatus();
    if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("opening ", path));
    const ssize_t n = write(fd, "1\n", 2);
    const int err = errno;
    close(fd);
    if (n != 2) return absl::ErrnoToStatus(n < 0 ? err : EIO, absl::StrCat("writing ", path));
    return absl::OkStatus();
  }
};

}  // namespace

std::string ServiceAddress::Text() const { return absl::StrCat(Dotted(addr), "/", prefix); }

bool ServiceAddress::SameSubnet(uint32_t other) const {
  return (addr & Mask(prefix)) == (other & Mask(prefix));
}

absl::StatusOr<ServiceAddress> ParseServiceAddress(absl::string_view text) {
  const std::string t(text);
  const size_t slash = t.find('/');
  const std::string ip = t.substr(0, slash);
  ServiceAddress out;
  in_addr a{};
  if (inet_pton(AF_INET, ip.c_str(), &a) != 1) {
    in6_addr a6{};
    if (inet_pton(AF_INET6, ip.c_str(), &a6) == 1)
      return absl::InvalidArgumentError(
          absl::StrCat("\"", text, "\": only IPv4 service addresses can move"));
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not an IPv4 address (a.b.c.d/len)"));
  }
  out.addr = ntohl(a.s_addr);
  if (slash != std::string::npos) {
    int len = 0;
    if (!absl::SimpleAtoi(t.substr(slash + 1), &len) || len < 8 || len > 32)
      return absl::InvalidArgumentError(
          absl::StrCat("\"", text, "\": the prefix length must be 8..32"));
    out.prefix = len;
  }
  const uint32_t first = out.addr >> 24;
  if (out.addr == 0 || first == 127 || (first >= 224 && first <= 239) || out.addr == ~uint32_t{0} ||
      (out.prefix < 31 && (out.addr & ~Mask(out.prefix)) == ~Mask(out.prefix)))
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" cannot be a workload's address"));
  if (out.prefix < 31 && (out.addr & ~Mask(out.prefix)) == 0)
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is the network's own address, not a host's"));
  return out;
}

std::unique_ptr<AddressControl> NewNetlinkAddressControl() {
  return std::make_unique<NetlinkAddressControl>();
}

}  // namespace rdmavirt::migrator
