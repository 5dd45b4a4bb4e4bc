// A Migrator over a FakeHost (tests/migrator/fake_host.h: the host's shims,
// processes, CRIU and addresses) with a state directory of the caller's,
// for the migrator's fuzz targets and their seeds. Three endpoints run on
// the host: pids 100 and 200 connected to each other, pid 300 connected
// to an endpoint of another host. Timeouts are short, and every other
// migrator it calls answers UNIMPLEMENTED at once (an in-process gRPC
// server without services): no input makes a run wait.
//
// The Migrator is thread-safe; the fixture is used from one thread.
#ifndef RDMAVIRT_TESTS_FUZZ_MIGRATOR_FIXTURE_H_
#define RDMAVIRT_TESTS_FUZZ_MIGRATOR_FIXTURE_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "migrator/move/migrator.h"
#include "tests/migrator/fake_host.h"

namespace rdmavirt::fuzz {

class MigratorFixture {
 public:
  static constexpr int kHost = 2;
  static constexpr int kOtherHost = 3;
  static constexpr pid_t kPid = 100;
  static constexpr pid_t kPeerPid = 200;
  static constexpr pid_t kRemotePeerPid = 300;

  // Whatever `state_dir` holds (records, guests.pb) is read as the
  // Migrator starts, as rdmavirt-migratord reads it.
  explicit MigratorFixture(const std::string& state_dir);
  MigratorFixture(const MigratorFixture&) = delete;
  MigratorFixture& operator=(const MigratorFixture&) = delete;

  migrator::Migrator& migrator() { return *migrator_; }
  migrator::testing::FakeHost& host() { return host_; }

  // The virtual GID of endpoint n (16 bytes).
  static std::string VirtualGid(int n);

 private:
  migrator::testing::FakeHost host_{kHost};
  std::unique_ptr<migrator::Migrator> migrator_;
};

}  // namespace rdmavirt::fuzz

#endif  // RDMAVIRT_TESTS_FUZZ_MIGRATOR_FIXTURE_H_
