// Service addresses: an IPv4 address that belongs to a workload, not to a
// host, and moves with it. A program such as perftest keeps a TCP
// connection to its peer open for its whole run; CRIU can carry an
// established connection (tcp_established), but the restored socket is
// only reachable if its local address is on the destination host.
//
// On a live move with service addresses (MigrateRequest.addresses):
//   prepare  the source must hold each address, the destination must have
//            an interface on its subnet and not hold it yet;
//   dump     the source removes them once the process is stopped, before
//            the final dump: packets of the peer then find no one, and the
//            socket the dump saw cannot change any more (its FIN, when the
//            source process is killed at the end, has no route either);
//   restore  the destination adds and announces them (gratuitous ARP, so
//            that peers stop sending to the source's MAC), then restores;
//   rollback whoever added them removes them; the source adds them back.
//
// AddressControl is the host's network configuration, behind an interface
// so that the orchestration can be tested with a fake. Implementations are
// safe for concurrent use.
#ifndef RDMAVIRT_MIGRATOR_HOST_SERVICE_ADDRESS_H_
#define RDMAVIRT_MIGRATOR_HOST_SERVICE_ADDRESS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmavirt::migrator {

struct ServiceAddress {
  uint32_t addr = 0;  // host byte order
  int prefix = 32;
  std::string Text() const;  // "a.b.c.d/len"
  // Whether `other` (host byte order) is on this address's subnet.
  bool SameSubnet(uint32_t other) const;
};

// "a.b.c.d/len" with len in 8..32 (a bare "a.b.c.d" is /32). Anything else,
// IPv6 included, is INVALID_ARGUMENT saying what is wrong; so are the
// addresses no workload can own (0.0.0.0, loopback, multicast, broadcast).
absl::StatusOr<ServiceAddress> ParseServiceAddress(absl::string_view text);

class AddressControl {
 public:
  virtual ~AddressControl() = default;
  // The interface that holds `a`, whose prefix becomes the one it has
  // there (the host's configuration wins over what an operator typed);
  // NOT_FOUND when no interface holds it.
  virtual absl::StatusOr<std::string> Holder(ServiceAddress* a) = 0;
  // The interface `a` would go on here: an interface that is up and has an
  // address on a's subnet. ALREADY_EXISTS when this host holds `a`
  // already; FAILED_PRECONDITION when no interface is on its subnet.
  virtual absl::StatusOr<std::string> Home(const ServiceAddress& a) = 0;
  // Adds `a` to `ifname` (OK if it is there already), then announces it
  // with gratuitous ARP. An error leaves the address absent.
  virtual absl::Status Add(const std::string& ifname, const ServiceAddress& a) = 0;
  // Removes `a` from `ifname`; OK when it was not there.
  virtual absl::Status Remove(const std::string& ifname, const ServiceAddress& a) = 0;
  // Makes every IPv4 and IPv6 route the kernel keeps cached in a socket stale, to be
  // looked up again on its next use. rxe caches the route of an RC QP's
  // packets in the QP's socket and keeps it across modify_qp: a QP
  // re-pointed from a peer on this host (a local route, through lo) to one
  // on another host would go on sending its packets to itself.
  virtual absl::Status ForgetCachedRoutes() = 0;
  // The host's secondary IPv4 addresses: each on an interface that had an
  // address on its subnet before it (the kernel's IFA_F_SECONDARY). Those
  // are the addresses a workload can own; a host's primary addresses
  // (the first on each subnet) never move.
  virtual absl::StatusOr<std::vector<ServiceAddress>> Secondaries() = 0;
};

// The kernel's: rtnetlink for the addresses, a packet socket for the ARP
// announcements (CAP_NET_ADMIN and CAP_NET_RAW).
std::unique_ptr<AddressControl> NewNetlinkAddressControl();

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_SERVICE_ADDRESS_H_
