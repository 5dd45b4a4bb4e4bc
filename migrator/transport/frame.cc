#include "migrator/transport/frame.h"

#include <errno.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace rdmavirt::migrator {
namespace {

// Reads exactly n bytes; *got says how many arrived before an error or EOF.
absl::Status ReadExactly(int fd, char* p, size_t n, size_t* got) {
  *got = 0;
  while (*got < n) {
    const ssize_t r = recv(fd, p + *got, n - *got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return absl::DeadlineExceededError("timed out waiting for a frame");
    if (r < 0) return absl::ErrnoToStatus(errno, "reading a frame");
    if (r == 0) return absl::OutOfRangeError("connection closed");
    *got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadFrame(int fd) {
  unsigned char len[4];
  size_t got = 0;
  absl::Status st = ReadExactly(fd, reinterpret_cast<char*>(len), 4, &got);
  if (!st.ok()) {
    if (absl::IsOutOfRange(st) && got > 0)
      return absl::DataLossError("connection closed inside a frame's length");
    if (!absl::IsOutOfRange(st) && !absl::IsDeadlineExceeded(st))
      return absl::UnavailableError(st.message());
    return st;
  }
  const uint32_t n = len[0] | len[1] << 8 | len[2] << 16 | uint32_t{len[3]} << 24;
  if (n > kMaxFrame)
    return absl::ResourceExhaustedError(
        absl::StrCat("frame of ", n, " bytes is over the limit of ", kMaxFrame));
  std::string payload(n, '\0');
  st = ReadExactly(fd, payload.data(), n, &got);
  if (!st.ok()) {
    if (absl::IsOutOfRange(st))
      return absl::DataLossError(
          absl::StrCat("connection closed after ", got, " of a frame's ", n, " bytes"));
    if (!absl::IsDeadlineExceeded(st)) return absl::UnavailableError(st.message());
    return st;
  }
  return payload;
}

absl::Status WriteFrame(int fd, const std::string& payload) {
  if (payload.size() > kMaxFrame)
    return absl::InvalidArgumentError(absl::StrCat("frame of ", payload.size(), " bytes"));
  const uint32_t n = static_cast<uint32_t>(payload.size());
  std::string out;
  out.reserve(4 + n);
  out.push_back(static_cast<char>(n));
  out.push_back(static_cast<char>(n >> 8));
  out.push_back(static_cast<char>(n >> 16));
  out.push_back(static_cast<char>(n >> 24));
  out.append(payload);
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t w = send(fd, out.data() + done, out.size() - done, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return absl::UnavailableError(absl::StrCat("writing a frame: ", strerror(errno)));
    done += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace rdmavirt::migrator
