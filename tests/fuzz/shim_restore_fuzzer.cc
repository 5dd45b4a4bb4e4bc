// The endpoint state a shim acts on: the migrator's requests (quiesce,
// release, restore with its peers' mappings, peer_quiesce toward a GID,
// peer_reconnect with a moved peer's mapping, resume), decoded by the shim
// (shim/migration/control.cc DecodeRequest) and carried out on a live endpoint
// (Execute: shim/migration/release.cc Quiesce, Release, restore.cc Restore, PeerReconnect,
// Resume; shim/core/remote_map.cc for the mappings), over FakeBackend.
//
// Input: messages (fuzz_util.h SplitMessages). A message of one byte is a
// step of the application (ShimPair::AppStep: posts and polls between the
// steps of a move); any other is one MigratorToShim, as a frame's payload.
//
// Properties: no crash, leak or undefined behaviour whatever the order of
// the requests and whatever mappings they carry; every reply is a
// ShimToMigrator the migrator parses, answering the request's id; and once
// the application destroys everything, the shim has given every real
// object back (ShimPair::CloseAndCheck).
#include <algorithm>
#include <string>

#include "rdmavirt/v1/control.pb.h"
#include "shim/migration/control.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/shim_pair.h"

namespace {

// A drain waits for sends to complete; the fake completes them at post
// time or never (a peer GID it does not have). Its timeout is not what is
// fuzzed here.
constexpr uint32_t kMaxDrainMs = 2;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  fuzz::ShimPair pair;
  pair.q().set_app_thread_wait_ms(0);
  for (std::string_view m : fuzz::SplitMessages(data, size, 32)) {
    if (m.size() == 1) {
      if (fuzz::Tracing()) fuzz::Trace("app step " + std::to_string(static_cast<uint8_t>(m[0])));
      pair.AppStep(static_cast<uint8_t>(m[0]));
      continue;
    }
    shim::ControlRequest req;
    std::string why;
    if (!shim::DecodeRequest(m, &req, &why)) {
      if (fuzz::Tracing()) fuzz::Trace("refused: " + why);
      continue;
    }
    req.drain_timeout_ms = std::clamp<uint32_t>(req.drain_timeout_ms, 1, kMaxDrainMs);
    bool released = false;
    const std::string reply = shim::Execute(&pair.q(), req, "fuzz-endpoint", 4242, &released);
    v1::ShimToMigrator parsed;
    fuzz::Check(parsed.ParseFromString(reply), "a reply the migrator cannot parse");
    if (fuzz::Tracing())
      fuzz::Trace("request " + std::to_string(static_cast<int>(req.kind)) + " with " +
                  std::to_string(req.peers.size()) +
                  " peers: " + parsed.reply().ShortDebugString());
    fuzz::Check(parsed.has_reply() && parsed.request_id() == req.id,
                "a reply that does not answer the request's id");
    fuzz::Check(released == (parsed.reply().summary().phase() == v1::ENDPOINT_PHASE_RELEASED),
                "the reply's phase and Execute's `released` disagree");
  }
  pair.CloseAndCheck();
  return 0;
}
