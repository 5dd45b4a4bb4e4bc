// The shim's decoder of what the migrator sends it over the control socket
// (shim/migration/control.cc DecodeRequest, on shim/migration/wire.cc's WireReader): one
// MigratorToShim message, as the payload of a frame.
//
// Properties: the decoder never crashes or reads out of bounds; a refusal
// says why; an accepted request has an id and a command (and peer_reconnect
// its mapping, which Execute() takes); and what it accepts means what
// protoc's generated code says the same bytes mean.
#include <cstring>
#include <string>

#include "rdmavirt/v1/control.pb.h"
#include "shim/migration/control.h"
#include "shim/migration/wire.h"
#include "tests/fuzz/fuzz_util.h"

namespace rdmavirt::fuzz {
namespace {

using Kind = shim::ControlRequest::Kind;

std::string Raw(const ibv_gid& g) { return std::string(reinterpret_cast<const char*>(g.raw), 16); }

bool SamePairs(const std::vector<std::pair<uint32_t, uint32_t>>& got,
               const google::protobuf::RepeatedPtrField<v1::IdPair>& want) {
  if (got.size() != static_cast<size_t>(want.size())) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    const v1::IdPair& w = want.Get(static_cast<int>(i));
    if (got[i].first != w.virtual_id() || got[i].second != w.physical_id()) return false;
  }
  return true;
}

bool SameMapping(const shim::RemoteMapping& got, const v1::Mapping& want) {
  return Raw(got.virtual_gid) == want.virtual_gid() &&
         Raw(got.physical_gid) == want.physical_gid() && SamePairs(got.qpns, want.qpns()) &&
         SamePairs(got.rkeys, want.rkeys());
}

Kind KindOf(v1::MigratorToShim::CommandCase c) {
  switch (c) {
    case v1::MigratorToShim::kQuiesce:
      return Kind::kQuiesce;
    case v1::MigratorToShim::kRelease:
      return Kind::kRelease;
    case v1::MigratorToShim::kRestore:
      return Kind::kRestore;
    case v1::MigratorToShim::kResume:
      return Kind::kResume;
    case v1::MigratorToShim::kPeerQuiesce:
      return Kind::kPeerQuiesce;
    case v1::MigratorToShim::kPeerReconnect:
      return Kind::kPeerReconnect;
    case v1::MigratorToShim::kDescribe:
      return Kind::kDescribe;
    case v1::MigratorToShim::COMMAND_NOT_SET:
      break;
  }
  return Kind::kNone;
}

// What the generated code reads from the same bytes.
void CheckAgainstSchema(std::string_view bytes, const shim::ControlRequest& req) {
  v1::MigratorToShim m;
  // The schema's parser is stricter on strings (UTF-8) and knows groups;
  // only what both read is compared.
  if (!m.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return;
  Check(m.request_id() == req.id, "request_id differs from the schema's");
  Check(KindOf(m.command_case()) == req.kind, "the command differs from the schema's");
  switch (req.kind) {
    case Kind::kQuiesce:
      Check(m.quiesce().drain_timeout_ms() == req.drain_timeout_ms,
            "quiesce: drain_timeout_ms differs from the schema's");
      break;
    case Kind::kPeerQuiesce:
      Check(m.peer_quiesce().drain_timeout_ms() == req.drain_timeout_ms,
            "peer_quiesce: drain_timeout_ms differs from the schema's");
      Check(req.has_toward == !m.peer_quiesce().virtual_gid().empty(),
            "peer_quiesce: virtual_gid present for one decoder only");
      if (req.has_toward)
        Check(Raw(req.toward) == m.peer_quiesce().virtual_gid(),
              "peer_quiesce: virtual_gid differs from the schema's");
      break;
    case Kind::kRestore: {
      Check(req.device == m.restore().device(), "restore: device differs from the schema's");
      Check(req.peers.size() == static_cast<size_t>(m.restore().peers_size()),
            "restore: a different number of peers than the schema's");
      for (size_t i = 0; i < req.peers.size(); ++i)
        Check(SameMapping(req.peers[i], m.restore().peers(static_cast<int>(i))),
              "restore: a peer's mapping differs from the schema's");
      break;
    }
    case Kind::kPeerReconnect:
      Check(SameMapping(req.peers.front(), m.peer_reconnect().mapping()),
            "peer_reconnect: the mapping Execute() uses differs from the schema's");
      break;
    case Kind::kRelease:
    case Kind::kResume:
    case Kind::kDescribe:
    case Kind::kNone:
      break;
  }
}

// The reader alone: it stops at the end or at the first malformed field,
// never past the input.
void WalkFields(std::string_view bytes) {
  shim::WireReader r(bytes);
  size_t fields = 0;
  while (r.Next()) {
    ++fields;
    if (r.is_bytes()) {
      const std::string_view b = r.bytes();
      Check(b.data() >= bytes.data() && b.data() + b.size() <= bytes.data() + bytes.size(),
            "WireReader: a length-delimited field outside its input");
    }
    Check(r.field() != 0, "WireReader: field number 0 accepted");
  }
  Check(fields <= bytes.size(), "WireReader: more fields than bytes");
}

}  // namespace
}  // namespace rdmavirt::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  fuzz::WalkFields(bytes);
  shim::ControlRequest req;
  std::string why;
  if (!shim::DecodeRequest(bytes, &req, &why)) {
    fuzz::Check(!why.empty(), "a refusal without a reason");
    return 0;
  }
  fuzz::Check(req.id != 0, "a request without an id accepted");
  fuzz::Check(req.kind != fuzz::Kind::kNone, "a request without a command accepted");
  fuzz::Check(req.kind != fuzz::Kind::kPeerReconnect || !req.peers.empty(),
              "peer_reconnect accepted without a mapping (Execute takes peers.front())");
  fuzz::CheckAgainstSchema(bytes, req);
  return 0;
}
