// A small codec for the protobuf wire format, so the shim can speak the
// control protocol (protos/rdmavirt/v1/control.proto) without linking
// protobuf into the application (which may link its own, of another
// version). Only what that schema uses: varints, length-delimited fields
// and nested messages; unknown fields of any wire type are skipped.
// tests/shim/wire_test.cc checks it against protoc's generated code.
//
// Control path only (it allocates). Not thread-safe; one per message.
#ifndef RDMAVIRT_SHIM_MIGRATION_WIRE_H_
#define RDMAVIRT_SHIM_MIGRATION_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace rdmavirt::shim {

class WireWriter {
 public:
  // proto3: fields equal to their default are not written.
  void Varint(uint32_t field, uint64_t v);
  void Int32(uint32_t field, int32_t v);  // negative values as 10-byte varints
  void Bool(uint32_t field, bool v) { Varint(field, v ? 1 : 0); }
  void Bytes(uint32_t field, const void* data, size_t n);
  // proto3 parsers refuse a whole message whose string is not UTF-8 (a
  // /proc/self/comm cut inside a character, a device name): each byte that
  // does not belong to a valid sequence is written as '?'.
  void String(uint32_t field, std::string_view s);
  // A nested message, written even when empty (so a oneof member is set).
  void Message(uint32_t field, const WireWriter& sub);

  const std::string& data() const { return buf_; }

 private:
  void Tag(uint32_t field, uint32_t type) { Raw((uint64_t{field} << 3) | type); }
  void Raw(uint64_t v);
  std::string buf_;
};

class WireReader {
 public:
  WireReader(const void* data, size_t n) : p_(static_cast<const uint8_t*>(data)), end_(p_ + n) {}
  explicit WireReader(std::string_view s) : WireReader(s.data(), s.size()) {}

  // The next field; false at the end of the input or when it is malformed
  // (then ok() is false).
  bool Next();
  bool ok() const { return ok_; }

  uint32_t field() const { return field_; }
  bool is_varint() const { return type_ == 0; }
  bool is_bytes() const { return type_ == 2; }
  uint64_t varint() const { return varint_; }
  std::string_view bytes() const { return bytes_; }

 private:
  bool ReadVarint(uint64_t* v);
  bool Fail() {
    ok_ = false;
    return false;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
  uint32_t field_ = 0;
  uint32_t type_ = 0;
  uint64_t varint_ = 0;
  std::string_view bytes_;
};

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_MIGRATION_WIRE_H_
