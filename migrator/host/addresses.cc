#include "migrator/host/addresses.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "migrator/host/scoped_fd.h"

namespace rdmavirt::migrator {
namespace {

bool ValidDnsName(absl::string_view h) {
  if (h.empty() || h.size() > 253 || h.front() == '.' || h.front() == '-') return false;
  for (char c : h)
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-') return false;
  return true;
}

}  // namespace

std::string HostPort::Target() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, int default_port) {
  HostPort out;
  out.port = default_port;
  absl::string_view host = text, port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos)
      return absl::InvalidArgumentError(absl::StrCat("\"", text, "\": missing ']'"));
    host = text.substr(1, close - 1);
    absl::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':')
        return absl::InvalidArgumentError(absl::StrCat("\"", text, "\": expected :PORT after ]"));
      port = rest.substr(1);
      if (port.empty())
        return absl::InvalidArgumentError(absl::StrCat("\"", text, "\": empty port"));
    }
    in6_addr a;
    if (inet_pton(AF_INET6, std::string(host).c_str(), &a) != 1)
      return absl::InvalidArgumentError(absl::StrCat("\"", host, "\" is not an IPv6 address"));
  } else {
    const size_t colon = text.rfind(':');
    if (colon != absl::string_view::npos) {
      if (text.find(':') != colon)
        return absl::InvalidArgumentError(
            absl::StrCat("\"", text, "\": write an IPv6 address as [ADDRESS]:PORT"));
      host = text.substr(0, colon);
      port = text.substr(colon + 1);
      if (port.empty())
        return absl::InvalidArgumentError(absl::StrCat("\"", text, "\": empty port"));
    }
    if (!ValidDnsName(host))
      return absl::InvalidArgumentError(
          absl::StrCat("\"", host, "\" is not a host name or IPv4 address"));
  }
  if (!port.empty()) {
    int p = 0;
    if (!absl::SimpleAtoi(port, &p) || p < 1 || p > 65535 ||
        port.find_first_not_of("0123456789") != absl::string_view::npos)
      return absl::InvalidArgumentError(
          absl::StrCat("\"", port, "\" is not a port number (1..65535)"));
    out.port = p;
  }
  out.host = std::string(host);
  return out;
}

std::string GidIpv4(absl::string_view gid) {
  static constexpr unsigned char kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (gid.size() != 16 || memcmp(gid.data(), kPrefix, 12) != 0) return "";
  const auto* b = reinterpret_cast<const unsigned char*>(gid.data()) + 12;
  return absl::StrCat(b[0], ".", b[1], ".", b[2], ".", b[3]);
}

std::string GidText(absl::string_view gid) {
  if (gid.size() != 16) return "";
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.data(), buf, sizeof(buf));
  return buf;
}

bool IsLocalAddress(const std::string& ip) {
  in_addr want;
  if (inet_pton(AF_INET, ip.c_str(), &want) != 1) return false;
  if ((ntohl(want.s_addr) >> 24) == 127) return true;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    found = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want.s_addr;
  }
  freeifaddrs(list);
  return found;
}

// The address of this host that a connection to `host` leaves from (no
// packet is sent: a UDP socket's connect only picks the route).
absl::StatusOr<std::string> LocalAddressToward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), "9", &hints, &res); rc != 0)
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  absl::Cleanup free_res = [&] { freeaddrinfo(res); };
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    ScopedFd fd(socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (fd.get() < 0 || connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 ||
        getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0)
      continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* a =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr;
    if (inet_ntop(local.ss_family, a, text, sizeof(text)) != nullptr) return std::string(text);
  }
  return absl::UnavailableError(absl::StrCat("no route from this host to ", host));
}

}  // namespace rdmavirt::migrator
