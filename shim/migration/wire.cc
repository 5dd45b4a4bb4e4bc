#include "shim/migration/wire.h"

namespace rdmavirt::shim {

void WireWriter::Raw(uint64_t v) {
  while (v >= 0x80) {
    buf_.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  buf_.push_back(static_cast<char>(v));
}

void WireWriter::Varint(uint32_t field, uint64_t v) {
  if (v == 0) return;
  Tag(field, 0);
  Raw(v);
}

void WireWriter::Int32(uint32_t field, int32_t v) {
  // As protobuf: an int32 is sign-extended to 64 bits.
  Varint(field, static_cast<uint64_t>(static_cast<int64_t>(v)));
}

void WireWriter::Bytes(uint32_t field, const void* data, size_t n) {
  if (n == 0) return;
  Tag(field, 2);
  Raw(n);
  buf_.append(static_cast<const char*>(data), n);
}

namespace {

// The length of the UTF-8 sequence at p (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), or 0 if none starts there.
size_t Utf8Sequence(const uint8_t* p, size_t n) {
  const uint8_t b = p[0];
  if (b < 0x80) return 1;
  size_t len;
  uint8_t lo = 0x80, hi = 0xbf;  // bounds of the second byte
  if (b >= 0xc2 && b <= 0xdf) {
    len = 2;
  } else if (b >= 0xe0 && b <= 0xef) {
    len = 3;
    if (b == 0xe0) lo = 0xa0;
    if (b == 0xed) hi = 0x9f;
  } else if (b >= 0xf0 && b <= 0xf4) {
    len = 4;
    if (b == 0xf0) lo = 0x90;
    if (b == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (n < len || p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < len; ++i)
    if (p[i] < 0x80 || p[i] > 0xbf) return 0;
  return len;
}

}  // namespace

void WireWriter::String(uint32_t field, std::string_view s) {
  std::string utf8;
  utf8.reserve(s.size());
  const uint8_t* p = reinterpret_cast<const uint8_t*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t len = Utf8Sequence(p + i, s.size() - i);
    if (len == 0) {
      utf8.push_back('?');
      ++i;
    } else {
      utf8.append(s.data() + i, len);
      i += len;
    }
  }
  Bytes(field, utf8.data(), utf8.size());
}

void WireWriter::Message(uint32_t field, const WireWriter& sub) {
  Tag(field, 2);
  Raw(sub.buf_.size());
  buf_.append(sub.buf_);
}

bool WireReader::ReadVarint(uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (p_ == end_) return false;
    const uint8_t b = *p_++;
    *v |= uint64_t{b & 0x7fu} << shift;
    if ((b & 0x80) == 0) return true;
  }
  return false;  // more than 10 bytes
}

bool WireReader::Next() {
  if (!ok_ || p_ == end_) return false;
  uint64_t tag;
  if (!ReadVarint(&tag)) return Fail();
  field_ = static_cast<uint32_t>(tag >> 3);
  type_ = static_cast<uint32_t>(tag & 7);
  if (field_ == 0 || (tag >> 3) > 0x1fffffff) return Fail();
  switch (type_) {
    case 0:
      if (!ReadVarint(&varint_)) return Fail();
      return true;
    case 1:  // fixed64
      if (end_ - p_ < 8) return Fail();
      p_ += 8;
      return true;
    case 2: {
      uint64_t n;
      if (!ReadVarint(&n) || n > static_cast<uint64_t>(end_ - p_)) return Fail();
      bytes_ = std::string_view(reinterpret_cast<const char*>(p_), static_cast<size_t>(n));
      p_ += n;
      return true;
    }
    case 5:  // fixed32
      if (end_ - p_ < 4) return Fail();
      p_ += 4;
      return true;
    default:  // groups are not used by proto3
      return Fail();
  }
}

}  // namespace rdmavirt::shim
