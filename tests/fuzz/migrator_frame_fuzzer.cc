// The migrator's framing of what a shim sends it (migrator/transport/frame.cc
// ReadFrame): the input is the byte stream a shim wrote to its socket
// before closing it, read back frame by frame from a real socket.
//
// Properties, as frame.h promises: each frame is the 4-byte little-endian
// length and that many bytes, in order; the stream ends with OUT_OF_RANGE
// at a frame boundary, DATA_LOSS inside a frame, RESOURCE_EXHAUSTED at a
// length over kMaxFrame (and nothing after it is read); and WriteFrame
// writes back exactly the bytes each frame was read from.
#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "migrator/transport/frame.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// Both ends of a stream socket; writes of the whole input fit its buffer
// (tools/fuzz keeps inputs under 64 KiB).
struct SocketPair {
  SocketPair() {
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd) != 0)
      rdmavirt::fuzz::Fail("socketpair");
    const int buffer = 1 << 20;
    setsockopt(fd[0], SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
    setsockopt(fd[1], SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
  }
  ~SocketPair() {
    close(fd[0]);
    close(fd[1]);
  }
  int fd[2];
};

void WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's SIGALRM
    if (n <= 0) rdmavirt::fuzz::Fail("writing the input to the socket");
    data.remove_prefix(static_cast<size_t>(n));
  }
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  using fuzz::Check;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  SocketPair in;
  WriteAll(in.fd[0], input);
  shutdown(in.fd[0], SHUT_WR);

  size_t at = 0;  // where the next frame starts in the input
  SocketPair out;
  for (;;) {
    absl::StatusOr<std::string> frame = migrator::ReadFrame(in.fd[1]);
    const size_t left = size - at;
    if (!frame.ok()) {
      const absl::StatusCode code = frame.status().code();
      if (left == 0) {
        Check(code == absl::StatusCode::kOutOfRange,
              "a stream ending between frames: not OUT_OF_RANGE");
        break;
      }
      uint32_t n = 0;
      for (size_t i = 0; i < 4 && i < left; ++i) n |= uint32_t{data[at + i]} << (8 * i);
      if (left >= 4 && n > migrator::kMaxFrame) {
        Check(code == absl::StatusCode::kResourceExhausted,
              "a length over kMaxFrame: not RESOURCE_EXHAUSTED");
        // Nothing after the length was read.
        Check(ReadAll(in.fd[1]) == input.substr(at + 4),
              "bytes after an oversized length were consumed");
      } else {
        Check(code == absl::StatusCode::kDataLoss, "a stream cut inside a frame: not DATA_LOSS");
        Check(left < 4 || left - 4 < n, "DATA_LOSS for a frame that was all there");
      }
      break;
    }
    Check(left >= 4 + frame->size(), "a frame longer than what was written");
    uint32_t n = 0;
    for (size_t i = 0; i < 4; ++i) n |= uint32_t{data[at + i]} << (8 * i);
    Check(n == frame->size(), "a frame whose size is not its length field");
    Check(input.substr(at + 4, n) == *frame, "a frame's bytes differ from what was written");
    Check(migrator::WriteFrame(out.fd[0], *frame).ok(), "WriteFrame of a frame it read");
    at += 4 + n;
  }
  shutdown(out.fd[0], SHUT_WR);
  const std::string rewritten = ReadAll(out.fd[1]);
  Check(rewritten == input.substr(0, at),
        "WriteFrame did not write back the bytes its frames were read from");
  return 0;
}
