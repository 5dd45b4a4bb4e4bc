// FakeHost: one simulated host for the migrator's unit tests. It is at the
// same time the host's shims (ShimChannel), its processes (ProcessControl)
// and its CRIU (Checkpointer), so that each behaves as the real one would
// given the others: a released shim reconnects only once its resume marker
// exists and its process is not stopped; a dump refuses a process whose
// control socket is still open; a restore brings back a released endpoint
// that waits for its marker. Switches inject faults. Thread-safe.
#ifndef RDMAVIRT_TESTS_MIGRATOR_FAKE_HOST_H_
#define RDMAVIRT_TESTS_MIGRATOR_FAKE_HOST_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "migrator/checkpointer.h"
#include "migrator/process_control.h"
#include "migrator/shim_channel.h"

namespace rdmavirt::migrator::testing {

// A 16-byte IPv4-mapped GID for 10.0.0.N.
std::string Gid(int n);

struct FakeQp {
  uint32_t virtual_qpn = 0;
  uint32_t type = 2;  // IBV_QPT_RC
  std::string remote_vgid;
  uint32_t remote_vqpn = 0;
  std::string remote_pgid;
};

struct FakeEndpoint {
  pid_t pid = 0;
  std::string endpoint_id;
  std::string vgid;
  std::vector<FakeQp> qps;
  bool alive = true;
  bool stopped = false;
  bool connected = true;
  v1::EndpointPhase hello_phase = v1::ENDPOINT_PHASE_RUNNING;
  bool paused = false;
  bool released = false;
  uint32_t qpn_base = 100;
  std::vector<std::string> log;  // every command received, in order
  std::vector<v1::Mapping> reconnected_to;
  std::map<std::string, absl::StatusCode> fail;  // command -> the shim's answer
};

class FakeHost final : public ShimChannel, public ProcessControl, public Checkpointer {
 public:
  explicit FakeHost(int n) : gid_(Gid(n)), n_(n) {}

  FakeEndpoint& Add(pid_t pid, const std::string& vgid, std::vector<FakeQp> qps);
  // A copy of the endpoint's state (empty pid when there is none).
  FakeEndpoint Get(pid_t pid);
  void Fail(pid_t pid, const std::string& command, absl::StatusCode code);
  // A process that is not under the shim.
  void AddPlainProcess(pid_t pid);
  const std::string& gid() const { return gid_; }

  // CRIU switches and counters.
  absl::Status check_error, predump_error, dump_error, restore_error;
  int predumps = 0, dumps = 0, restores = 0;
  uint64_t predump_bytes = 64 << 10;

  // ShimChannel
  std::vector<ShimInfo> Connected() override;
  absl::StatusOr<v1::Reply> Call(pid_t pid, v1::MigratorToShim request,
                                 absl::Duration timeout) override;
  absl::Status WaitClosed(pid_t pid, absl::Duration timeout) override;
  absl::StatusOr<ShimInfo> WaitHello(pid_t pid, v1::EndpointPhase phase,
                                     absl::Duration timeout) override;
  absl::Status SetResumeMarker(pid_t pid, bool present) override;
  // ProcessControl
  bool Exists(pid_t pid) override;
  absl::Status Stop(pid_t pid) override;
  absl::Status Continue(pid_t pid) override;
  absl::Status Kill(pid_t pid) override;
  // Checkpointer
  absl::Status Check() override;
  absl::StatusOr<DumpStats> PreDump(pid_t pid, const std::string& dir,
                                    const std::string& parent) override;
  absl::StatusOr<DumpStats> Dump(pid_t pid, const std::string& dir, const std::string& parent,
                                 bool leave_running) override;
  absl::StatusOr<pid_t> Restore(const std::string& dir) override;

 private:
  v1::EndpointSummary Summary(const FakeEndpoint& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Tick() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string gid_;
  const int n_;
  absl::Mutex mu_;
  std::map<pid_t, FakeEndpoint> eps_ ABSL_GUARDED_BY(mu_);
  std::set<pid_t> plain_ ABSL_GUARDED_BY(mu_);
  std::set<pid_t> markers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdmavirt::migrator::testing

#endif  // RDMAVIRT_TESTS_MIGRATOR_FAKE_HOST_H_
