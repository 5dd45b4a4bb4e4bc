// Status: what every shim operation that can fail for a reason worth
// telling (the migration steps, the control protocol) returns: a code the
// caller acts on and a message for the operator. Header-only, no
// allocation but the message's; safe on any thread.
//
// The codes are absl::StatusCode's / grpc::StatusCode's numbers, so a
// status crosses the control socket and the migrator's gRPC unchanged;
// the shim links no absl (it lives inside other people's programs).
#ifndef RDMAVIRT_SHIM_CORE_STATUS_H_
#define RDMAVIRT_SHIM_CORE_STATUS_H_

#include <string>
#include <utility>

namespace rdmavirt::shim {

// Codes as absl::StatusCode / grpc::StatusCode, so they cross the wire
// unchanged.
enum class Code : int {
  kOk = 0,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kInternal = 13,
  kUnavailable = 14,
};

struct Status {
  Code code = Code::kOk;
  std::string message;
  bool ok() const { return code == Code::kOk; }
};

inline Status Error(Code code, std::string message) { return {code, std::move(message)}; }

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_STATUS_H_
