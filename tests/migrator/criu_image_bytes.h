// Bytes of CRIU images for tests that write images by hand: protobuf's
// wire format (varints, fields) and CRIU's framing (little-endian magics,
// each entry after its 32-bit size).
#ifndef RDMAVIRT_TESTS_MIGRATOR_CRIU_IMAGE_BYTES_H_
#define RDMAVIRT_TESTS_MIGRATOR_CRIU_IMAGE_BYTES_H_

#include <cstdint>
#include <string>

namespace rdmavirt::migrator::image_bytes {

inline void Varint(std::string* s, uint64_t v) {
  while (v >= 0x80) {
    s->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  s->push_back(static_cast<char>(v));
}

inline void Le32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}

// Field `n` of a message: a varint, or bytes (a string, a nested message).
inline void VarintField(std::string* m, int n, uint64_t v) {
  Varint(m, static_cast<uint64_t>(n) << 3);
  Varint(m, v);
}
inline void BytesField(std::string* m, int n, const std::string& b) {
  Varint(m, (static_cast<uint64_t>(n) << 3) | 2);
  Varint(m, b.size());
  m->append(b);
}

// An image's entry: its size, then the message.
inline void Message(std::string* img, const std::string& m) {
  Le32(img, static_cast<uint32_t>(m.size()));
  img->append(m);
}

}  // namespace rdmavirt::migrator::image_bytes

#endif  // RDMAVIRT_TESTS_MIGRATOR_CRIU_IMAGE_BYTES_H_
