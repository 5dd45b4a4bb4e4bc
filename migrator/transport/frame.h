// Framing of the shim control protocol (protos/rdmavirt/v1/control.proto):
// a 4-byte little-endian length, then that many bytes of one message.
// Blocking reads and writes on a stream socket; callable from any thread,
// one reader and one writer per fd at a time.
#ifndef RDMAVIRT_MIGRATOR_TRANSPORT_FRAME_H_
#define RDMAVIRT_MIGRATOR_TRANSPORT_FRAME_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmavirt::migrator {

inline constexpr uint32_t kMaxFrame = 16u << 20;

// One frame's payload. OUT_OF_RANGE: the peer closed the connection cleanly
// between frames. DATA_LOSS: it closed in the middle of a frame.
// RESOURCE_EXHAUSTED: the length is over kMaxFrame (nothing more is read).
// DEADLINE_EXCEEDED: the socket's receive timeout passed. UNAVAILABLE: any
// other socket error.
absl::StatusOr<std::string> ReadFrame(int fd);

// UNAVAILABLE when the peer is gone; INVALID_ARGUMENT over kMaxFrame.
absl::Status WriteFrame(int fd, const std::string& payload);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_TRANSPORT_FRAME_H_
