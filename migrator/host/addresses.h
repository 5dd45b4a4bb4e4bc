// Host addresses: the HOST[:PORT] syntax of the CLI and of MigrateRequest,
// and where the migrator owning a peer endpoint is (its IPv4-mapped RoCE
// v2 GID names the host; migrators share one TCP port). Free functions.
#ifndef RDMAVIRT_MIGRATOR_HOST_ADDRESSES_H_
#define RDMAVIRT_MIGRATOR_HOST_ADDRESSES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmavirt::migrator {

inline constexpr int kDefaultPort = 7700;

struct HostPort {
  std::string host;  // an IPv4 address, a DNS name, or an IPv6 address without brackets
  int port = kDefaultPort;
  // "host:port" as gRPC takes it (IPv6 in brackets).
  std::string Target() const;
};

// INVALID_ARGUMENT, saying what is wrong, for anything but HOST, HOST:PORT,
// [V6] or [V6]:PORT with a port in 1..65535.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, int default_port = kDefaultPort);

// The address of this host that a connection to `host` leaves from, as
// text; UNAVAILABLE when `host` does not resolve or has no route.
absl::StatusOr<std::string> LocalAddressToward(const std::string& host);

// "a.b.c.d" for an IPv4-mapped GID (::ffff:a.b.c.d), "" otherwise.
std::string GidIpv4(absl::string_view gid);
// The GID's text form ("" for anything but 16 bytes).
std::string GidText(absl::string_view gid);

// Whether `ip` is an address of this host (any interface, loopback too).
bool IsLocalAddress(const std::string& ip);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_ADDRESSES_H_
