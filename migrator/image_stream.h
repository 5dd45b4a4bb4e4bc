// Moving a directory of CRIU images from one migrator to another over
// Transfer.PushImages (protos/rdmavirt/v1/migrator.proto): the sender
// streams the files its Manifest lists; the receiver checks every name,
// offset and size against that manifest before writing a byte, and the
// SHA-256 of every file once the stream ends.
#ifndef RDMAVIRT_MIGRATOR_IMAGE_STREAM_H_
#define RDMAVIRT_MIGRATOR_IMAGE_STREAM_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rdmavirt/v1/migrator.grpc.pb.h"

namespace rdmavirt::migrator {

inline constexpr size_t kChunkBytes = 1 << 20;
inline constexpr uint32_t kMaxPreDumpIterations = 64;

// A name a manifest may list: relative, no "..", "." or empty component,
// not one of the names the migrator writes itself (manifest.pb, parent).
bool ValidImageName(const std::string& name);

// Where a stream's files go under an incoming migration's directory:
// "pre-K" for pre-dump iteration K, "final" otherwise.
std::string StreamSubdir(bool pre_dump, uint32_t iteration);

using BytesProgress = std::function<void(uint64_t done, uint64_t total)>;

// Streams the files of `manifest`, read from `dir`, to `stub`. Returns the
// bytes sent. UNAVAILABLE when the destination cannot be reached or breaks
// the stream; the destination's own code when it refuses.
absl::StatusOr<uint64_t> SendImages(v1::Transfer::StubInterface* stub,
                                    const std::string& migration_id, const std::string& dir,
                                    const v1::Manifest& manifest, bool pre_dump, uint32_t iteration,
                                    absl::Duration timeout, const BytesProgress& progress);

// The receiving end of one PushImages stream. Not thread-safe: one stream.
class ImageReceiver {
 public:
  // `root`: the incoming migration's directory.
  explicit ImageReceiver(std::string root) : root_(std::move(root)) {}
  ~ImageReceiver();

  // The stream's first message: it must carry the manifest.
  // INVALID_ARGUMENT on a missing manifest or a name it may not list.
  absl::Status Begin(const v1::ImageChunk& first);
  // A piece of a file. INVALID_ARGUMENT when it is not the next piece of a
  // manifest file or goes past the file's size.
  absl::Status Add(const v1::ImageChunk& chunk);
  // Every file complete and matching its digest (DATA_LOSS otherwise), the
  // manifest written beside them.
  absl::Status Finish();

  uint64_t bytes() const { return bytes_; }
  const std::string& dir() const { return dir_; }

 private:
  absl::Status Open(const std::string& name);

  const std::string root_;
  std::string dir_;
  v1::Manifest manifest_;
  std::map<std::string, uint64_t> expected_;  // name -> size
  std::map<std::string, uint64_t> written_;
  std::string current_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
};

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_IMAGE_STREAM_H_
