// The endpoint state a migrator receives from another host and acts on
// (migrator/move/incoming.cc, migrator/move/migrator.cc: the Transfer service's
// Prepare with the moving endpoint's EndpointSummary, PushImages into the
// incoming directory, RestoreIncoming with the peers' Mappings,
// QuiescePeers toward a virtual GID and QPNs, ReconnectPeers with the
// moved endpoint's Mapping, AbortIncoming), over a FakeHost whose
// endpoints are peers of the one that moves, in a scratch state directory.
//
// Input: messages (fuzz_util.h SplitMessages). A message's first byte
// chooses the call, the rest is its request: 0 Prepare, 1 PushImages (its
// first chunk; the messages after it whose first byte is 2 are the rest of
// the stream), 3 RestoreIncoming, 4 AbortIncoming, 5 QuiescePeers,
// 6 ReconnectPeers, 7 the reads (ListEndpoints, Status, GetHostInfo).
//
// Properties: no crash, leak or undefined behaviour whatever the order
// and content of the calls; nothing is written outside the state
// directory.
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/migrator_fixture.h"

namespace rdmavirt::fuzz {
namespace {

constexpr char kStateBelowScratch[] = "a/b/state";
constexpr uint8_t kPushChunk = 2;

template <typename Request>
bool Parse(std::string_view m, Request* r) {
  return r->ParseFromArray(m.data() + 1, static_cast<int>(m.size() - 1));
}

// Runs the call `messages[*i]` chooses; advances *i past what it used.
void RunCall(migrator::Migrator& m, const std::vector<std::string_view>& messages, size_t* i) {
  const std::string_view msg = messages[(*i)++];
  switch (msg[0] % 8) {
    case 0: {
      v1::PrepareRequest r;
      if (Parse(msg, &r)) (void)m.Prepare(r);
      break;
    }
    case 1: {
      std::vector<std::string_view> stream = {msg};
      while (*i < messages.size() && !messages[*i].empty() && messages[*i][0] % 8 == kPushChunk)
        stream.push_back(messages[(*i)++]);
      size_t next = 0;
      (void)m.PushImages([&](v1::ImageChunk* c) {
        while (next < stream.size())
          if (Parse(stream[next++], c)) return true;
        return false;
      });
      break;
    }
    case 3: {
      v1::RestoreIncomingRequest r;
      if (Parse(msg, &r)) (void)m.RestoreIncoming(r);
      break;
    }
    case 4: {
      v1::AbortIncomingRequest r;
      if (Parse(msg, &r)) (void)m.AbortIncoming(r);
      break;
    }
    case 5: {
      v1::QuiescePeersRequest r;
      if (Parse(msg, &r)) (void)m.QuiescePeers(r);
      break;
    }
    case 6: {
      v1::ReconnectPeersRequest r;
      if (Parse(msg, &r)) (void)m.ReconnectPeers(r);
      break;
    }
    case 7:
      (void)m.ListEndpoints();
      (void)m.Status();
      (void)m.GetHostInfo();
      break;
    default:  // a stray chunk
      break;
  }
}

}  // namespace
}  // namespace rdmavirt::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  std::vector<std::string_view> messages = fuzz::SplitMessages(data, size, 32);
  std::erase_if(messages, [](std::string_view m) { return m.empty(); });
  fuzz::ScratchDir scratch("migrator_transfer");
  const std::string state = scratch.path() + "/" + fuzz::kStateBelowScratch;
  {
    fuzz::MigratorFixture f(state);
    for (size_t i = 0; i < messages.size();) fuzz::RunCall(f.migrator(), messages, &i);
  }
  for (const std::string& e : scratch.List())
    fuzz::Check(std::string(fuzz::kStateBelowScratch).starts_with(e) ||
                    e.starts_with(std::string(fuzz::kStateBelowScratch) + "/"),
                "the migrator wrote outside its state directory");
  return 0;
}
