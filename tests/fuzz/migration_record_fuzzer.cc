// What crash recovery reads back from disk (migrator/move/record_store.cc
// ReadRecord, ListRecords) and acts on (migrator/move/recovery.cc
// Migrator::Recover, rolling back or finishing each move a previous run
// left in flight), plus the guests' NIC table read at start
// (migrator/move/guests.cc LoadGuestNics): over a FakeHost, in a scratch
// state directory.
//
// Input: messages (fuzz_util.h SplitMessages): the record.pb of a source
// move (STATE/migrations/m1), that of an incoming one (STATE/incoming/i1),
// and STATE/guests.pb; missing messages are missing files.
//
// Properties: no crash, leak or undefined behaviour; nothing is written
// outside the state directory; after Recover every record is done (the
// outcome recorded, so the next start does not act on it again) but an
// incoming move restored and confirmed, which waits for its source; Status
// and GetHostInfo still answer.
#include <filesystem>
#include <fstream>
#include <string>

#include "migrator/move/record_store.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/migrator_fixture.h"

namespace rdmavirt::fuzz {
namespace {

constexpr char kStateBelowScratch[] = "a/b/state";

void WriteFile(const std::string& path, std::string_view data) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  Check(out.good(), "writing an input file");
}

}  // namespace
}  // namespace rdmavirt::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  rdmavirt::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmavirt;
  const std::vector<std::string_view> files = fuzz::SplitMessages(data, size, 3);
  fuzz::ScratchDir scratch("migration_record");
  const std::string state = scratch.path() + "/" + fuzz::kStateBelowScratch;
  const char* const where[] = {"/migrations/m1/record.pb", "/incoming/i1/record.pb", "/guests.pb"};
  for (size_t i = 0; i < files.size(); ++i) fuzz::WriteFile(state + where[i], files[i]);
  {
    fuzz::MigratorFixture f(state);
    f.migrator().Recover();
    (void)f.migrator().Status();
    (void)f.migrator().GetHostInfo();
  }
  for (const auto& [path, record] : migrator::ListRecords(state + "/migrations"))
    fuzz::Check(record.done(), "a source's record left not done after Recover");
  // A restored, confirmed incoming move waits for its source (recovery.cc).
  for (const auto& [path, record] : migrator::ListRecords(state + "/incoming"))
    fuzz::Check(record.done() || record.confirmed(),
                "an incoming record left neither done nor confirmed after Recover");
  for (const std::string& e : scratch.List())
    fuzz::Check(std::string(fuzz::kStateBelowScratch).starts_with(e) ||
                    e.starts_with(std::string(fuzz::kStateBelowScratch) + "/"),
                "recovery wrote outside the state directory");
  return 0;
}
