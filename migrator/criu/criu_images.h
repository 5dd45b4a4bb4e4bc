// CRIU's image files read and written without CRIU's own descriptions of
// them (images/*.proto): an image opens with two magics, then holds its
// entries, each a 32-bit little-endian length and a protobuf message, whose
// fields are read off the wire by number. What reads them: the
// pseudo-terminals' renumbering (pty_images.h) and the pids of a dumped
// tree (DumpedTreePids).
#ifndef RDMAVIRT_MIGRATOR_CRIU_CRIU_IMAGES_H_
#define RDMAVIRT_MIGRATOR_CRIU_CRIU_IMAGES_H_

#include <google/protobuf/wire_format_lite.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace rdmavirt::migrator {
namespace criu_images {

// One field of a message as it was on the wire: a varint's value, or the
// bytes of a length-delimited or fixed-size field.
struct Field {
  int number = 0;
  google::protobuf::internal::WireFormatLite::WireType type =
      google::protobuf::internal::WireFormatLite::WIRETYPE_VARINT;
  uint64_t varint = 0;
  std::string bytes;
};

// The fields of `msg`, in order (false: it does not parse).
bool Fields(std::string_view msg, std::vector<Field>* out);

// The varint field `number` of `msg`, if it has one.
std::optional<uint64_t> VarintOf(std::string_view msg, int number);

// An image: its two magics, then its entries' messages.
struct Image {
  std::string head;
  std::vector<std::string> entries;
};

// The image `name` of `dir`; nullopt when the dump has none. DATA_LOSS
// when it is not a CRIU image or is cut short.
absl::StatusOr<std::optional<Image>> ReadImage(const std::string& dir, const char* name);

// The bytes of `img` as a file.
std::string Serialize(const Image& img);

}  // namespace criu_images

// The pids of the processes CRIU dumped into `dir` (pstree.img: each
// PstreeEntry's pid), root first. DATA_LOSS when pstree.img is missing or
// does not parse.
absl::StatusOr<std::vector<pid_t>> DumpedTreePids(const std::string& dir);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CRIU_CRIU_IMAGES_H_
