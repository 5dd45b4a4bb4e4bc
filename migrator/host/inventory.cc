#include "migrator/host/inventory.h"

#include <arpa/inet.h>

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "migrator/host/addresses.h"
#include "migrator/host/log.h"
#include "migrator/move/migrator_internal.h"

namespace rdmavirt::migrator {

namespace {

using etcdserverpb::Compare;
using etcdserverpb::KeyValue;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out);
  return out;
}

template <typename M>
absl::StatusOr<M> FromJson(const std::string& text, const std::string& key) {
  M m;
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = true;  // written by a newer migrator
  if (!google::protobuf::util::JsonStringToMessage(text, &m, o).ok())
    return absl::DataLossError(
        absl::StrCat("the inventory's ", key, " is not what a migrator writes"));
  return m;
}

// The end of the range of keys that start with `prefix`.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<unsigned char>(prefix.back()) != 0xff) {
      prefix.back() = static_cast<char>(prefix.back() + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

bool Retryable(const grpc::Status& st) {
  return st.error_code() == grpc::StatusCode::UNAVAILABLE ||
         st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// A member that answered while its cluster elects a leader (the leader
// was killed, say): it will serve once the election is over.
bool Electing(const grpc::Status& st) {
  return st.error_code() == grpc::StatusCode::UNAVAILABLE &&
         (absl::StrContains(st.error_message(), "leader changed") ||
          absl::StrContains(st.error_message(), "no leader"));
}

constexpr absl::Duration kElectionRetry = absl::Milliseconds(200);

}  // namespace

std::string GidKey(const std::string& gid) { return absl::BytesToHexString(gid); }

Inventory::Inventory(Options options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<Inventory>> Inventory::Create(Options options) {
  std::vector<std::string> urls;
  for (const std::string& e : options.endpoints)
    for (absl::string_view part : absl::StrSplit(e, ',', absl::SkipWhitespace()))
      urls.emplace_back(part);
  if (urls.empty()) return absl::InvalidArgumentError("no inventory endpoint given");
  if (options.prefix.empty() || options.prefix.back() != '/')
    return absl::InvalidArgumentError(
        absl::StrCat("the inventory prefix \"", options.prefix, "\" must end with /"));
  if (options.ttl < absl::Seconds(3))
    return absl::InvalidArgumentError("the inventory lease must last 3 s or more");
  options.endpoints = urls;
  std::unique_ptr<Inventory> inv(new Inventory(options));
  for (const std::string& url : urls) {
    const bool tls = absl::StartsWith(url, "https://");
    if (!tls && !absl::StartsWith(url, "http://"))
      return absl::InvalidArgumentError(
          absl::StrCat("inventory endpoint \"", url, "\" is not http(s)://HOST:PORT"));
    const std::string target = url.substr(tls ? 8 : 7);
    if (target.empty() || target.find(':') == std::string::npos ||
        target.find('/') != std::string::npos)
      return absl::InvalidArgumentError(
          absl::StrCat("inventory endpoint \"", url, "\" is not http(s)://HOST:PORT"));
    if (tls && options.tls.cert.empty())
      return absl::InvalidArgumentError(absl::StrCat(url, " needs this host's certificate"));
    std::shared_ptr<grpc::ChannelCredentials> creds =
        tls ? MutualTlsChannelCredentials(options.tls) : grpc::InsecureChannelCredentials();
    // A member that restarts is back within seconds: retry its connection
    // soon (gRPC's default backoff grows to two minutes).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, creds, args);
    inv->endpoints_.push_back(
        Endpoint{url, etcdserverpb::KV::NewStub(channel), etcdserverpb::Lease::NewStub(channel)});
  }
  return inv;
}

Inventory::~Inventory() { StopRegistration(/*revoke=*/false); }

std::string Inventory::Describe() const { return absl::StrJoin(options_.endpoints, ","); }

absl::Status Inventory::Call(
    const std::string& what,
    const std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>& call) {
  const size_t first = current_.load();
  std::vector<std::string> failures;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    const size_t n = (first + i) % endpoints_.size();
    const absl::Time deadline = absl::Now() + options_.rpc_timeout;
    grpc::Status st;
    for (;;) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      // A member being reconnected to gets until the deadline.
      ctx.set_wait_for_ready(true);
      st = call(endpoints_[n], &ctx);
      // One in an election is asked again until then: the other members
      // may be the one that went away and one as busy.
      if (!Electing(st) || absl::Now() + kElectionRetry >= deadline) break;
      absl::SleepFor(kElectionRetry);
    }
    if (st.ok()) {
      current_.store(n);
      return absl::OkStatus();
    }
    if (!Retryable(st)) return FromGrpc(st, absl::StrCat(what, " (", endpoints_[n].url, ")"));
    failures.push_back(absl::StrCat(endpoints_[n].url, ": ", st.error_message()));
  }
  return absl::UnavailableError(absl::StrCat(what, ": the inventory cannot be reached (",
                                             absl::StrJoin(failures, "; "), ")"));
}

absl::StatusOr<std::vector<KeyValue>> Inventory::Range(const std::string& key, bool prefix) {
  etcdserverpb::RangeRequest req;
  req.set_key(key);
  if (prefix) req.set_range_end(PrefixEnd(key));
  etcdserverpb::RangeResponse resp;
  absl::Status st = Call(absl::StrCat("reading ", key), [&](Endpoint& e, grpc::ClientContext* c) {
    return e.kv->Range(c, req, &resp);
  });
  if (!st.ok()) return st;
  return std::vector<KeyValue>(resp.kvs().begin(), resp.kvs().end());
}

absl::Status Inventory::Txn(const std::string& what, const TxnRequest& txn, TxnResponse* out) {
  return Call(what, [&](Endpoint& e, grpc::ClientContext* c) { return e.kv->Txn(c, txn, out); });
}

// ---- registration ----------------------------------------------------------

absl::Status Inventory::Register(const v1::InventoryHost& host) {
  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(absl::ToInt64Seconds(options_.ttl));
  etcdserverpb::LeaseGrantResponse granted;
  absl::Status st = Call("granting a lease", [&](Endpoint& e, grpc::ClientContext* c) {
    return e.lease->LeaseGrant(c, grant, &granted);
  });
  if (!st.ok()) return st;
  if (!granted.error().empty())
    return absl::UnavailableError(absl::StrCat("granting a lease: ", granted.error()));

  TxnRequest txn;
  auto put = [&](const std::string& key, const std::string& value) {
    etcdserverpb::PutRequest* p = txn.add_success()->mutable_request_put();
    p->set_key(key);
    p->set_value(value);
    p->set_lease(granted.id());
  };
  const std::string value = ToJson(host);
  put(absl::StrCat(options_.prefix, "hosts/", host.name()), value);
  std::vector<std::string> gid_keys;
  for (const v1::RdmaDevice& d : host.info().devices())
    for (const v1::RdmaPort& p : d.ports())
      for (const std::string& text : p.gids()) {
        unsigned char gid[16];
        if (inet_pton(AF_INET6, text.c_str(), gid) != 1) continue;
        const std::string key = absl::StrCat(options_.prefix, "gids/",
                                             GidKey(std::string(reinterpret_cast<char*>(gid), 16)));
        if (std::find(gid_keys.begin(), gid_keys.end(), key) != gid_keys.end()) continue;
        gid_keys.push_back(key);
        put(key, host.name());
      }
  TxnResponse done;
  st = Txn("registering this host", txn, &done);
  if (!st.ok()) return st;

  int64_t old = 0;
  {
    absl::MutexLock lock(&mu_);
    old = lease_;
    lease_ = granted.id();
    published_ = value;
    gid_keys_ = gid_keys;
  }
  // An earlier lease (etcd lost us for a while) takes its keys with it.
  if (old != 0) {
    etcdserverpb::LeaseRevokeRequest revoke;
    revoke.set_id(old);
    etcdserverpb::LeaseRevokeResponse revoked;
    (void)Call("revoking the old lease", [&](Endpoint& e, grpc::ClientContext* c) {
      return e.lease->LeaseRevoke(c, revoke, &revoked);
    });
  }
  Log("inventory: registered %s (%d GIDs) at %s, lease %x for %s", host.name(), gid_keys.size(),
      Describe(), granted.id(), absl::FormatDuration(options_.ttl));
  return absl::OkStatus();
}

absl::Status Inventory::StartRegistration(std::function<v1::InventoryHost()> describe) {
  {
    absl::MutexLock lock(&mu_);
    describe_ = describe;
    stopping_ = false;
  }
  absl::Status first = Register(describe());
  if (!first.ok()) Log("inventory: %s; trying again in the background", first.message());
  thread_ = std::thread([this] { RegistrationLoop(); });
  return first;
}

void Inventory::RegistrationLoop() {
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  for (;;) {
    int64_t lease = 0;
    std::function<v1::InventoryHost()> describe;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      lease = lease_;
      describe = describe_;
    }
    if (lease == 0) {
      if (absl::Status st = Register(describe()); !st.ok())
        Log("inventory: %s; trying again", st.message());
    } else {
      KeepAlive(lease);
    }
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Seconds(1));
  }
}

void Inventory::PublishIfChanged(int64_t lease) {
  // What the host offers changes (guest NICs, ports, CRIU): put it again.
  std::function<v1::InventoryHost()> describe;
  {
    absl::MutexLock lock(&mu_);
    describe = describe_;
  }
  const v1::InventoryHost host = describe();
  const std::string value = ToJson(host);
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    changed = value != published_;
  }
  if (!changed) return;
  TxnRequest txn;
  etcdserverpb::PutRequest* p = txn.add_success()->mutable_request_put();
  p->set_key(absl::StrCat(options_.prefix, "hosts/", host.name()));
  p->set_value(value);
  p->set_lease(lease);
  TxnResponse done;
  if (Txn("updating this host", txn, &done).ok()) {
    absl::MutexLock lock(&mu_);
    published_ = value;
  }
}

void Inventory::KeepAlive(int64_t lease) {
  size_t n = current_.load() % endpoints_.size();
  grpc::ClientContext ctx;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stream_ = &ctx;
  }
  auto stream = endpoints_[n].lease->LeaseKeepAlive(&ctx);
  const absl::Duration every = options_.ttl / 3;
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || refresh_; };
  for (;;) {
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseKeepAliveResponse resp;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      // etcd lost the lease (restored from nothing, or a new cluster): the
      // stream ends with "lease not found", and the host registers again.
      ctx.TryCancel();
      const grpc::Status st = stream->Finish();
      absl::MutexLock lock(&mu_);
      if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
        Log("inventory: lease %x not found (%s); registering again", lease, st.error_message());
        if (lease_ == lease) lease_ = 0;
      } else if (!stopping_ && endpoints_.size() > 1) {
        // That member is gone (or cut off): the next keep-alive goes to the
        // next one, which also says whether the lease outlived the gap.
        Log("inventory: keep-alive with %s ended (%s); trying %s", endpoints_[n].url,
            st.error_message(), endpoints_[(n + 1) % endpoints_.size()].url);
        current_.compare_exchange_strong(n, (n + 1) % endpoints_.size());
      }
      stream_ = nullptr;
      return;
    }
    if (resp.ttl() <= 0) {
      Log("inventory: lease %x expired (etcd lost this host for longer than %s); registering again",
          lease, absl::FormatDuration(options_.ttl));
      absl::MutexLock lock(&mu_);
      if (lease_ == lease) lease_ = 0;
      break;
    }
    PublishIfChanged(lease);
    // Until the next keep-alive, or sooner when told that what the host
    // offers changed (Refresh).
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&woken), every);
    if (stopping_) break;
    refresh_ = false;
  }
  {
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
  }
  ctx.TryCancel();
  (void)stream->Finish();
}

void Inventory::Refresh() {
  absl::MutexLock lock(&mu_);
  refresh_ = true;
}

void Inventory::StopRegistration(bool revoke) {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (stream_ != nullptr) stream_->TryCancel();
    lease = lease_;
  }
  if (thread_.joinable()) thread_.join();
  if (!revoke || lease == 0) return;
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseRevokeResponse resp;
  absl::Status st = Call("revoking this host's lease", [&](Endpoint& e, grpc::ClientContext* c) {
    return e.lease->LeaseRevoke(c, req, &resp);
  });
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    lease_ = 0;
    Log("inventory: this host left %s", Describe());
  } else {
    Log("inventory: %s; the host drops out when its lease expires", st.message());
  }
}

bool Inventory::Registered() const {
  absl::MutexLock lock(&mu_);
  return lease_ != 0;
}

// ---- lookups ---------------------------------------------------------------

absl::StatusOr<v1::InventoryHost> Inventory::OwnerOfGid(const std::string& gid) {
  const std::string key = absl::StrCat(options_.prefix, "gids/", GidKey(gid));
  absl::StatusOr<std::vector<KeyValue>> owner = Range(key, /*prefix=*/false);
  if (!owner.ok()) return owner.status();
  if (owner->empty())
    return absl::NotFoundError(absl::StrCat("no migrator owns GID ", GidText(gid),
                                            " (no live host of the inventory at ", Describe(),
                                            " has it)"));
  const std::string name = (*owner)[0].value();
  absl::StatusOr<std::vector<KeyValue>> host =
      Range(absl::StrCat(options_.prefix, "hosts/", name), /*prefix=*/false);
  if (!host.ok()) return host.status();
  if (host->empty())
    return absl::NotFoundError(absl::StrCat("no migrator owns GID ", GidText(gid), " (host ", name,
                                            " left the inventory)"));
  return FromJson<v1::InventoryHost>((*host)[0].value(), (*host)[0].key());
}

absl::StatusOr<std::vector<v1::InventoryHost>> Inventory::Hosts() {
  absl::StatusOr<std::vector<KeyValue>> kvs = Range(options_.prefix + "hosts/", /*prefix=*/true);
  if (!kvs.ok()) return kvs.status();
  std::vector<v1::InventoryHost> hosts;
  for (const KeyValue& kv : *kvs) {
    absl::StatusOr<v1::InventoryHost> h = FromJson<v1::InventoryHost>(kv.value(), kv.key());
    if (!h.ok()) return h.status();
    hosts.push_back(*std::move(h));
  }
  return hosts;
}

// ---- moves -----------------------------------------------------------------

absl::Status Inventory::Claim(const v1::MoveClaim& claim) {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;
  }
  if (lease == 0)
    return absl::UnavailableError(absl::StrCat(
        "this host is not registered in the inventory at ", Describe(),
        " (see the migrator's log), so a move of ", claim.subject(), " cannot be recorded there"));
  const std::string key = absl::StrCat(options_.prefix, "moves/", claim.subject());
  TxnRequest txn;
  Compare* absent = txn.add_compare();
  absent->set_key(key);
  absent->set_target(Compare::CREATE);
  absent->set_result(Compare::EQUAL);
  absent->set_create_revision(0);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(ToJson(claim));
  put->set_lease(lease);
  txn.add_failure()->mutable_request_range()->set_key(key);
  TxnResponse resp;
  absl::Status st = Txn(absl::StrCat("claiming ", claim.subject()), txn, &resp);
  if (!st.ok()) return st;
  if (resp.succeeded()) return absl::OkStatus();
  v1::MoveClaim other;
  if (resp.responses_size() > 0 && resp.responses(0).response_range().kvs_size() > 0) {
    absl::StatusOr<v1::MoveClaim> c =
        FromJson<v1::MoveClaim>(resp.responses(0).response_range().kvs(0).value(), key);
    if (c.ok()) other = *c;
  }
  return absl::FailedPreconditionError(
      absl::StrCat(claim.subject(), " is being moved already: ", other.kind(), " ",
                   other.migration_id(), " from ", other.source(), " to ", other.destination(),
                   ", started ", other.started_at(), " (inventory key ", key, ")"));
}

absl::Status Inventory::Unclaim(const std::string& subject, const std::string& migration_id) {
  const std::string key = absl::StrCat(options_.prefix, "moves/", subject);
  absl::StatusOr<std::vector<KeyValue>> kvs = Range(key, /*prefix=*/false);
  if (!kvs.ok()) return kvs.status();
  if (kvs->empty()) return absl::OkStatus();
  absl::StatusOr<v1::MoveClaim> c = FromJson<v1::MoveClaim>((*kvs)[0].value(), key);
  if (c.ok() && c->migration_id() != migration_id) return absl::OkStatus();  // not ours
  TxnRequest txn;
  Compare* same = txn.add_compare();
  same->set_key(key);
  same->set_target(Compare::MOD);
  same->set_result(Compare::EQUAL);
  same->set_mod_revision((*kvs)[0].mod_revision());
  txn.add_success()->mutable_request_delete_range()->set_key(key);
  TxnResponse resp;
  return Txn(absl::StrCat("releasing ", subject), txn, &resp);
}

absl::StatusOr<std::vector<v1::MoveClaim>> Inventory::Moves() {
  absl::StatusOr<std::vector<KeyValue>> kvs = Range(options_.prefix + "moves/", /*prefix=*/true);
  if (!kvs.ok()) return kvs.status();
  std::vector<v1::MoveClaim> moves;
  for (const KeyValue& kv : *kvs) {
    absl::StatusOr<v1::MoveClaim> c = FromJson<v1::MoveClaim>(kv.value(), kv.key());
    if (!c.ok()) return c.status();
    moves.push_back(*std::move(c));
  }
  return moves;
}

}  // namespace rdmavirt::migrator
