// FakeHost: one simulated host for the migrator's unit tests. It is at the
// same time the host's shims (ShimChannel), its processes (ProcessControl)
// and its CRIU (Checkpointer), so that each behaves as the real one would
// given the others: a released shim reconnects only once its resume marker
// exists and its process is not stopped; a dump refuses a process whose
// control socket is still open; a restore brings back a released endpoint
// that waits for its marker. It is also the host's network addresses
// (AddressControl): eth0 holds 10.0.0.N/24, and a dump or restore with
// tcp_established of an endpoint that holds a TCP connection (tcp_address)
// fails like CRIU's unless that address is where CRIU needs it. Switches
// inject faults. Thread-safe.
#ifndef RDMAVIRT_TESTS_MIGRATOR_FAKE_HOST_H_
#define RDMAVIRT_TESTS_MIGRATOR_FAKE_HOST_H_

#include <atomic>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "migrator/criu/checkpointer.h"
#include "migrator/host/process_control.h"
#include "migrator/host/service_address.h"
#include "migrator/transport/shim_channel.h"

namespace rdmavirt::migrator::testing {

// A 16-byte IPv4-mapped GID for 10.0.0.N.
std::string Gid(int n);

// A meeting point of calls on several hosts: each waits, 5 s at most,
// until `expected` have arrived. Whether they all met says whether their
// callers asked them at once or one after the other.
struct Rendezvous {
  absl::Mutex mu;
  int expected = 0;
  int arrived ABSL_GUARDED_BY(mu) = 0;
  bool all_met ABSL_GUARDED_BY(mu) = true;
  void Arrive();
};

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
  std::vector<std::string> ud_peer_pgids;  // where its address handles point
  bool alive = true;
  bool stopped = false;
  bool connected = true;
  v1::EndpointPhase hello_phase = v1::ENDPOINT_PHASE_RUNNING;
  bool paused = false;
  bool released = false;
  uint32_t qpn_base = 100;
  std::vector<std::string> log;  // every command received, in order
  std::vector<v1::Mapping> reconnected_to;
  std::vector<v1::Mapping> restored_with;        // the peers of its last restore
  std::map<std::string, absl::StatusCode> fail;  // command -> the shim's answer
  std::string tcp_address;  // "a.b.c.d": the local address of its TCP connection
};

class FakeHost final : public ShimChannel,
                       public ProcessControl,
                       public Checkpointer,
                       public AddressControl {
 public:
  explicit FakeHost(int n);

  FakeEndpoint& Add(pid_t pid, const std::string& vgid, std::vector<FakeQp> qps);
  // A copy of the endpoint's state (empty pid when there is none).
  FakeEndpoint Get(pid_t pid);
  // The shim answers `command` with `code`; NOT_FOUND: the process ends
  // as the command comes (its shim gone with it).
  void Fail(pid_t pid, const std::string& command, absl::StatusCode code);
  // The endpoint holds a TCP connection on `address` ("a.b.c.d/len").
  void SetTcpAddress(pid_t pid, const std::string& address);
  // A process that is not under the shim.
  void AddPlainProcess(pid_t pid);
  // `child` (a process added before) is a child of `parent`: a dump of
  // `parent` takes it, and a restore brings both back.
  void AddChild(pid_t parent, pid_t child);
  // The process with `pid` is gone and a stranger (not under the shim) was
  // given its pid: Exists is true, Identity differs.
  void ReusePid(pid_t pid);
  // The process holds these terminals, comma-separated
  // (ProcessControl::Terminals).
  void SetTerminal(pid_t pid, const std::string& tty);
  // The process holds the master side of /dev/pts/`index`.
  void AddPtyMaster(pid_t pid, int index);
  // The process holds this RDMA device file (ProcessControl::DeviceFiles).
  void AddDeviceFile(pid_t pid, const std::string& path);
  const std::string& gid() const { return gid_; }

  // Network: `ifname` holds `address` ("a.b.c.d/len").
  void HoldAddress(const std::string& ifname, const std::string& address);
  // "a.b.c.d/len@ifname" for every address held, sorted.
  std::vector<std::string> Addresses();
  absl::Status add_address_error;
  // What happened to processes, images and addresses, in order: "stop 100",
  // "continue 100", "kill 100", "dump 100 tcp", "restore tcp",
  // "add 10.0.0.50/24@eth0", "remove 10.0.0.50/24@eth0" ("tcp" when
  // tcp_established was asked for).
  std::vector<std::string> Events();

  // CRIU switches and counters.
  absl::Status check_error, predump_error, dump_error, restore_error;
  // Set: Check() notifies `check_entered` (if set), then waits for it.
  absl::Notification* check_gate = nullptr;
  absl::Notification* check_entered = nullptr;
  // LazyDump fails so once the destination has restored (its pages did not
  // all go).
  absl::Status lazy_serve_error;
  absl::Status kill_error;  // every Kill fails with it (a task stuck in the kernel)
  int predumps = 0, dumps = 0, restores = 0;
  // While set, Restore waits (before it counts), as a slow CRIU does.
  std::atomic<bool> stall_restore{false};
  // With restore_error: the restore fails after it made the dumped
  // endpoint's process (CRIU killed part way), which it leaves behind.
  bool failed_restore_leaves_process = false;
  // Set by a test: each peer_reconnect on this host meets there first.
  Rendezvous* reconnect_rendezvous = nullptr;
  // The same for each describe.
  Rendezvous* describe_rendezvous = nullptr;
  std::atomic<int> restores_started{0};
  uint64_t predump_bytes = 64 << 10;
  // When set, the size of each pre-dump in turn (the last one repeats).
  std::vector<uint64_t> predump_sizes;

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
  std::string Identity(pid_t pid) override;
  std::vector<pid_t> Descendants(pid_t pid) override;
  absl::Status Stop(pid_t pid) override;
  absl::Status Continue(pid_t pid) override;
  absl::Status Kill(pid_t pid) override;
  std::set<int> PtyMasters(pid_t pid) override;
  std::vector<std::string> Terminals(pid_t pid, const std::set<int>& masters_in_tree) override;
  std::vector<std::string> DeviceFiles(pid_t pid) override;
  pid_t Parent(pid_t pid) override;
  std::string Program(pid_t pid) override;
  std::set<uint32_t> TcpAddresses(pid_t pid) override;
  // Checkpointer
  absl::Status Check() override;
  absl::StatusOr<DumpStats> PreDump(pid_t pid, const std::string& dir,
                                    const std::string& parent) override;
  absl::StatusOr<DumpStats> Dump(pid_t pid, const std::string& dir, const std::string& parent,
                                 bool leave_running, bool tcp_established) override;
  absl::StatusOr<DumpStats> LazyDump(
      pid_t pid, const std::string& dir, const std::string& parent, bool tcp_established,
      const LazyPages& serve, const std::function<void(const PostCopyHelper&)>& written) override;
  void CancelLazyDump(const LazyPages& serve) override;
  absl::StatusOr<pid_t> Restore(const std::string& dir, bool tcp_established, bool new_terminal,
                                const LazyPages* lazy_from, PostCopyHelper* helper) override;
  absl::StatusOr<std::vector<pid_t>> DumpedPids(const std::string& dir) override;
  // AddressControl
  absl::StatusOr<std::string> Holder(ServiceAddress* a) override;
  absl::StatusOr<std::string> Home(const ServiceAddress& a) override;
  absl::Status Add(const std::string& ifname, const ServiceAddress& a) override;
  absl::Status Remove(const std::string& ifname, const ServiceAddress& a) override;
  absl::Status ForgetCachedRoutes() override;
  // Every address held or added but the host's own (10.0.0.N).
  absl::StatusOr<std::vector<ServiceAddress>> Secondaries() override;
  // Its command name (Program); "" unless set.
  void SetProgram(pid_t pid, const std::string& comm);
  int routes_forgotten() {
    absl::MutexLock lock(&mu_);
    return routes_forgotten_;
  }

 private:
  v1::EndpointSummary Summary(const FakeEndpoint& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Tick() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string gid_;
  const int n_;
  absl::Mutex mu_;
  std::map<pid_t, FakeEndpoint> eps_ ABSL_GUARDED_BY(mu_);
  std::set<pid_t> plain_ ABSL_GUARDED_BY(mu_);
  std::multimap<pid_t, pid_t> children_ ABSL_GUARDED_BY(mu_);
  std::vector<pid_t> DescendantsLocked(pid_t pid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreEndpoint(const v1::EndpointSummary& s, const std::string& tcp_address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<pid_t, int> incarnation_ ABSL_GUARDED_BY(mu_);  // Identity's

  std::map<pid_t, std::string> terminals_ ABSL_GUARDED_BY(mu_);
  std::map<pid_t, std::vector<std::string>> device_files_ ABSL_GUARDED_BY(mu_);
  std::map<pid_t, std::set<int>> pty_masters_ ABSL_GUARDED_BY(mu_);
  std::map<pid_t, std::string> programs_ ABSL_GUARDED_BY(mu_);
  std::map<pid_t, std::string> plain_tcp_ ABSL_GUARDED_BY(mu_);  // plain processes' SetTcpAddress
  std::set<pid_t> markers_ ABSL_GUARDED_BY(mu_);
  // address (host order) -> (interface, prefix)
  std::map<uint32_t, std::pair<std::string, int>> addrs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  int routes_forgotten_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdmavirt::migrator::testing

#endif  // RDMAVIRT_TESTS_MIGRATOR_FAKE_HOST_H_
