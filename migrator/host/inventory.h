// Inventory: where the migrators of a cluster find each other, in etcd
// (v3 API over gRPC; keys in protos/rdmavirt/v1/inventory.proto). A
// migrator registers its host under a lease it keeps alive, so that a host
// whose migrator stops or dies drops out when the lease expires; it looks
// up which host owns a peer's GID; and it claims a process for the length
// of a move, so that two moves of one process cannot start from two hosts.
//
// Thread-safe: every method may be called from any thread. The calls that
// reach etcd block for at most Options::rpc_timeout per endpoint tried and
// return UNAVAILABLE when no endpoint answers.
#ifndef RDMAVIRT_MIGRATOR_HOST_INVENTORY_H_
#define RDMAVIRT_MIGRATOR_HOST_INVENTORY_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcd_v3.grpc.pb.h"
#include "migrator/transport/tls.h"
#include "rdmavirt/v1/inventory.pb.h"

namespace rdmavirt::migrator {

class Inventory {
 public:
  struct Options {
    // "https://HOST:PORT" (mutual TLS with `tls`) or "http://HOST:PORT",
    // tried in order; a comma-separated list is accepted too.
    std::vector<std::string> endpoints;
    std::string prefix = "/rdmavirt/";
    // The registration's lease; kept alive every ttl / 3.
    absl::Duration ttl = absl::Seconds(10);
    absl::Duration rpc_timeout = absl::Seconds(5);
    TlsFiles tls;  // for https: this host's certificate and the CA
  };

  // INVALID_ARGUMENT for an endpoint that is not http(s)://HOST:PORT, or
  // https without a certificate. Does not reach etcd yet.
  static absl::StatusOr<std::unique_ptr<Inventory>> Create(Options options);
  ~Inventory();  // stops registering, without revoking the lease

  // "https://10.78.0.1:2379,...": for messages.
  std::string Describe() const;

  // ---- registration
  // Keeps this host registered until StopRegistration: `describe` says what
  // to publish (called again every round; a changed value is put again).
  // Registers at once and returns its result; when etcd cannot be reached,
  // keeps trying in the background either way.
  absl::Status StartRegistration(std::function<v1::InventoryHost()> describe)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `revoke`: the lease is revoked and the host drops out at once; else it
  // drops out when the lease expires.
  void StopRegistration(bool revoke) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the host's keys are in etcd under a live lease (as far as the
  // last keep-alive knows).
  bool Registered() const ABSL_LOCKS_EXCLUDED(mu_);
  // What `describe` says changed: it is asked again now, not at the next
  // keep-alive (a third of the lease later).
  void Refresh() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- lookups
  // The host that owns `gid` (16 bytes). NOT_FOUND "no migrator owns GID
  // ..." when no live host claims it.
  absl::StatusOr<v1::InventoryHost> OwnerOfGid(const std::string& gid);
  // Every live host, by name.
  absl::StatusOr<std::vector<v1::InventoryHost>> Hosts();

  // ---- moves
  // Claims claim.subject() under this host's lease. FAILED_PRECONDITION
  // naming the move that holds it; UNAVAILABLE when this host is not
  // registered (its claim would outlive nothing).
  absl::Status Claim(const v1::MoveClaim& claim) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the claim if it is still `migration_id`'s.
  absl::Status Unclaim(const std::string& subject, const std::string& migration_id);
  absl::StatusOr<std::vector<v1::MoveClaim>> Moves();

 private:
  struct Endpoint {
    std::string url;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  };
  explicit Inventory(Options options);

  // Runs `call` against each endpoint in turn, from the last that answered,
  // until one does not fail with UNAVAILABLE or DEADLINE_EXCEEDED.
  absl::Status Call(const std::string& what,
                    const std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>& call);
  absl::StatusOr<std::vector<etcdserverpb::KeyValue>> Range(const std::string& key, bool prefix);
  absl::Status Txn(const std::string& what, const etcdserverpb::TxnRequest& txn,
                   etcdserverpb::TxnResponse* out);
  // Grants a lease and puts the host's keys; deletes the GID keys of an
  // earlier registration that the host no longer has.
  absl::Status Register(const v1::InventoryHost& host) ABSL_LOCKS_EXCLUDED(mu_);
  void RegistrationLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // One keep-alive stream, until it fails or registration stops.
  void KeepAlive(int64_t lease) ABSL_LOCKS_EXCLUDED(mu_);
  // The host's description put again under `lease` if it changed since it
  // was put last; a failure is left for the next keep-alive.
  void PublishIfChanged(int64_t lease) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  std::vector<Endpoint> endpoints_;
  std::atomic<size_t> current_{0};  // the endpoint that answered last

  mutable absl::Mutex mu_;
  std::function<v1::InventoryHost()> describe_ ABSL_GUARDED_BY(mu_);
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  std::string published_ ABSL_GUARDED_BY(mu_);  // the value put last
  std::vector<std::string> gid_keys_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool refresh_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* stream_ ABSL_GUARDED_BY(mu_) = nullptr;  // to cancel
  std::thread thread_;
};

// A 16-byte GID's key form, 32 lowercase hex digits (text form: GidText,
// addresses.h).
std::string GidKey(const std::string& gid);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_HOST_INVENTORY_H_
