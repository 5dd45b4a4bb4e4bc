// What the fuzz targets (tests/fuzz/*_fuzzer.cc) and the corpus writer
// share: how one input carries several messages, scratch directories, and
// how a target says that a property of the code under test failed.
//
// Not thread-safe: libFuzzer runs one input at a time, on one thread.
#ifndef RDMAVIRT_TESTS_FUZZ_FUZZ_UTIL_H_
#define RDMAVIRT_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rdmavirt::fuzz {

// An input that carries several messages (a stream of image chunks, a
// sequence of control requests) holds each as a 4-byte little-endian length
// and that many bytes, the control protocol's framing. The last message
// takes what is left when its length says more. At most `max` messages.
std::vector<std::string_view> SplitMessages(const uint8_t* data, size_t size, size_t max = 64);
// The inverse, for seeds.
std::string JoinMessages(const std::vector<std::string>& messages);

// Call from LLVMFuzzerInitialize. Keeps a copy of stderr for Fail():
// tools/fuzz runs targets with -close_fd_mask=2 (the migrator logs every
// refusal there, thousands a second). Quiets the shim's log.
void InitTarget();

// A property the target checks does not hold: says which, on the stderr
// kept by InitTarget, and aborts, so that libFuzzer keeps the input.
[[noreturn]] void Fail(std::string_view what);
inline void Check(bool ok, std::string_view what) {
  if (!ok) Fail(what);
}

// Whether RDMAVIRT_FUZZ_TRACE is set: then a target says what it does, on
// the stderr kept by InitTarget (replaying an input to see why it fails).
bool Tracing();
void Trace(std::string_view what);

// A new directory, $TMPDIR/rdmavirt-fuzz-NAME.XXXXXX (default /tmp),
// removed with everything in it when this goes away. Fail()s when it
// cannot be made.
class ScratchDir {
 public:
  explicit ScratchDir(std::string_view name);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  // Every entry below path() (relative, sorted), symlinks not followed;
  // `*symlinks` counts the symlinks among them.
  std::vector<std::string> List(int* symlinks = nullptr) const;

 private:
  std::string path_;
};

}  // namespace rdmavirt::fuzz

#endif  // RDMAVIRT_TESTS_FUZZ_FUZZ_UTIL_H_
