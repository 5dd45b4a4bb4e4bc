#include "tests/shim/fake_cm.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace rdmavirt::shim::testing {

namespace {

// The kernel's private data sizes as the CM's messages leave room for
// them after rdma_cm's header (PS_TCP: 36 bytes of a REQ's 92).
constexpr uint8_t kReqPrivateData = 56;
constexpr uint8_t kRepPrivateData = 196;
constexpr int32_t kRejInvalidServiceId = 8;
constexpr int32_t kRejConsumerDefined = 28;
constexpr uint32_t kMaxBacklog = 1024;

template <typename T>
T As(const char* body) {
  T t;
  memcpy(&t, body, sizeof t);
  return t;
}

void* UserPtr(uint64_t p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

ino_t InodeOf(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

bool IsAny(const sockaddr_in& a) { return a.sin_addr.s_addr == htonl(INADDR_ANY); }

// A sockaddr_storage's address as IPv4, or false.
bool Ipv4(const void* storage, uint16_t size, sockaddr_in* out) {
  if (size != sizeof(sockaddr_in)) return false;
  memcpy(out, storage, sizeof *out);
  return out->sin_family == AF_INET;
}

}  // namespace

ibv_gid MappedGid(const std::string& ip) {
  ibv_gid g{};
  g.raw[10] = g.raw[11] = 0xff;
  inet_pton(AF_INET, ip.c_str(), g.raw + 12);
  return g;
}

int FakeCmHost::Open() { return fabric_->Open(this); }
ssize_t FakeCmHost::Write(int fd, const void* cmd, size_t n) { return fabric_->Write(fd, cmd, n); }
void FakeCmHost::Close(int fd) { fabric_->Close(fd); }
size_t FakeCmHost::ids() { return fabric_->Ids(this); }
size_t FakeCmHost::files() { return fabric_->Files(this); }

FakeCmHost* FakeCmFabric::AddHost(const std::string& ip, uint64_t node_guid) {
  in_addr a{};
  inet_pton(AF_INET, ip.c_str(), &a);
  std::lock_guard<std::mutex> l(mu_);
  hosts_.push_back(std::make_unique<FakeCmHost>(this, a.s_addr, node_guid));
  return hosts_.back().get();
}

void FakeCmFabric::SetFirstHandle(uint32_t first) {
  std::lock_guard<std::mutex> l(mu_);
  first_handle_ = first;
}

int FakeCmFabric::blocking_gets() {
  std::lock_guard<std::mutex> l(mu_);
  return blocking_gets_;
}

size_t FakeCmFabric::Ids(FakeCmHost* host) {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (auto& [h, c] : ctxs_) n += c.host == host;
  return n;
}

size_t FakeCmFabric::groups(FakeCmHost* host) {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (auto& [h, m] : mcs_) n += ctxs_.count(m.ctx) && ctxs_[m.ctx].host == host;
  return n;
}

size_t FakeCmFabric::Files(FakeCmHost* host) {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (auto& [ino, f] : files_) n += f.host == host;
  return n;
}

// A pipe: the caller's fd is its read end, blocking as open(2) of
// /dev/infiniband/rdma_cm is; the fake drains it through a description of
// its own (O_NONBLOCK there leaves the caller's flags alone).
int FakeCmFabric::Open(FakeCmHost* host) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  const std::string path = "/proc/self/fd/" + std::to_string(p[0]);
  const int drain = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (drain < 0) {
    close(p[0]);
    close(p[1]);
    return -1;
  }
  fcntl(p[1], F_SETFL, O_NONBLOCK);
  std::lock_guard<std::mutex> l(mu_);
  File& f = files_[InodeOf(p[0])];
  f.host = host;
  f.drain = drain;
  f.wr = p[1];
  return p[0];
}

// ucma_write(): the header, then the command's handler; the whole length
// on success.
ssize_t FakeCmFabric::Write(int fd, const void* cmd, size_t n) {
  Hdr hdr;
  if (n < sizeof hdr) return errno = EINVAL, -1;
  memcpy(&hdr, cmd, sizeof hdr);
  if (hdr.in + sizeof hdr > n) return errno = EINVAL, -1;
  // The kernel copies sizeof(its struct) whatever `in` says; the rest of
  // a short command reads as zeros here.
  char body[1024] = {};
  memcpy(body, static_cast<const char*>(cmd) + sizeof hdr,
         hdr.in < sizeof body ? hdr.in : sizeof body);
  std::lock_guard<std::mutex> l(mu_);
  const ino_t ino = InodeOf(fd);
  if (files_.count(ino) == 0) return errno = EBADF, -1;
  const int rc = Dispatch(ino, fd, hdr, body);
  if (rc < 0) return errno = -rc, -1;
  return static_cast<ssize_t>(n);
}

ssize_t FakeCmFabric::Dispatch(ino_t file, int fd, const Hdr& hdr, const char* body) {
  switch (hdr.cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID:
      return CreateId(file, hdr, body);
    case RDMA_USER_CM_CMD_DESTROY_ID:
      return DestroyId(file, hdr, body);
    case RDMA_USER_CM_CMD_MIGRATE_ID:
      return MigrateId(file, hdr, body);
    case RDMA_USER_CM_CMD_BIND:
      return Bind(file, body);
    case RDMA_USER_CM_CMD_LISTEN:
      return Listen(file, body);
    case RDMA_USER_CM_CMD_RESOLVE_ADDR:
      return ResolveAddr(file, body);
    case RDMA_USER_CM_CMD_RESOLVE_ROUTE:
      return ResolveRoute(file, body);
    case RDMA_USER_CM_CMD_CONNECT:
      return Connect(file, body);
    case RDMA_USER_CM_CMD_ACCEPT:
      return Accept(file, body);
    case RDMA_USER_CM_CMD_DISCONNECT:
      return Disconnect(file, body);
    case RDMA_USER_CM_CMD_QUERY:
      return Query(file, hdr, body);
    case RDMA_USER_CM_CMD_QUERY_ROUTE:
      return QueryRoute(file, hdr, body);
    case RDMA_USER_CM_CMD_GET_EVENT:
      return GetEvent(file, fd, hdr, body);
    case RDMA_USER_CM_CMD_JOIN_MCAST:
      return Join(file, hdr, body);
    case RDMA_USER_CM_CMD_LEAVE_MCAST:
      return Leave(file, hdr, body);
    default:
      return -ENOSYS;  // not modelled (fake_cm.h)
  }
}

FakeCmFabric::Ctx* FakeCmFabric::Find(ino_t file, uint32_t handle, int* err) {
  auto it = ctxs_.find(handle);
  if (it == ctxs_.end()) return *err = -ENOENT, nullptr;
  if (it->second.file != file) return *err = -EINVAL, nullptr;
  return &it->second;
}

int FakeCmFabric::CreateId(ino_t file, const Hdr& hdr, const char* body) {
  auto c = As<rdma_ucm_create_id>(body);
  if (hdr.out < sizeof(rdma_ucm_create_id_resp)) return -ENOSPC;
  if (c.ps != RDMA_PS_TCP && c.ps != RDMA_PS_UDP && c.ps != RDMA_PS_IPOIB && c.ps != RDMA_PS_IB)
    return -EINVAL;
  // xa_alloc(): the lowest free index.
  uint32_t h = first_handle_;
  while (ctxs_.count(h)) ++h;
  Ctx& ctx = ctxs_[h];
  ctx.handle = h;
  ctx.uid = c.uid;
  ctx.ps = c.ps;
  ctx.file = file;
  ctx.host = files_[file].host;
  rdma_ucm_create_id_resp resp{h};
  memcpy(UserPtr(c.response), &resp, sizeof resp);
  return 0;
}

void FakeCmFabric::DropEvents(File* f, uint32_t ctx) {
  std::deque<Event> keep;
  std::vector<uint32_t> requests;
  for (Event& e : f->events) {
    if (e.ctx != ctx) {
      keep.push_back(e);
      continue;
    }
    char byte;
    if (read(f->drain, &byte, 1) != 1) {
      // One byte per event: the pipe holds it.
    }
    if (e.resp.event == kCmConnectRequest) requests.push_back(e.resp.id);
  }
  f->events.swap(keep);
  // A listener's requests not yet given out die with it.
  for (uint32_t child : requests) DestroyCtx(child);
}

void FakeCmFabric::SendDreq(Ctx* c) {
  auto it = ctxs_.find(c->peer);
  c->peer = 0;
  if (it == ctxs_.end()) return;
  Ctx& p = it->second;
  p.peer = 0;
  if (p.state != St::kEstablished && p.state != St::kResponded && p.state != St::kAccepted) return;
  p.state = St::kDisconnected;
  QueueEvent(&p, kCmDisconnected, 0, nullptr);
}

void FakeCmFabric::DestroyCtx(uint32_t handle) {
  auto it = ctxs_.find(handle);
  if (it == ctxs_.end()) return;
  Ctx* c = &it->second;
  if (c->state == St::kEstablished || c->state == St::kResponded || c->state == St::kAccepted)
    SendDreq(c);
  auto f = files_.find(c->file);
  if (f != files_.end()) DropEvents(&f->second, handle);
  for (auto m = mcs_.begin(); m != mcs_.end();)
    m = m->second.ctx == handle ? mcs_.erase(m) : std::next(m);
  ctxs_.erase(handle);
}

int FakeCmFabric::DestroyId(ino_t file, const Hdr& hdr, const char* body) {
  auto c = As<rdma_ucm_destroy_id>(body);
  if (hdr.out < sizeof(rdma_ucm_destroy_id_resp)) return -ENOSPC;
  int err = 0;
  Ctx* ctx = Find(file, c.id, &err);
  if (ctx == nullptr) return err;
  rdma_ucm_destroy_id_resp resp{ctx->events_reported};
  DestroyCtx(c.id);
  memcpy(UserPtr(c.response), &resp, sizeof resp);
  return 0;
}

// Written to the new file, naming the old one's fd: the id and its
// pending events move.
int FakeCmFabric::MigrateId(ino_t file, const Hdr& hdr, const char* body) {
  auto c = As<rdma_ucm_migrate_id>(body);
  const ino_t old_ino = InodeOf(static_cast<int>(c.fd));
  auto old = files_.find(old_ino);
  if (old == files_.end()) return -EINVAL;
  int err = 0;
  Ctx* ctx = Find(old_ino, c.id, &err);
  if (ctx == nullptr) return err;
  if (old_ino != file) {
    File& to = files_[file];
    std::deque<Event> keep;
    for (Event& e : old->second.events) {
      if (e.ctx != c.id) {
        keep.push_back(e);
        continue;
      }
      char byte;
      if (read(old->second.drain, &byte, 1) != 1 || write(to.wr, &byte, 1) != 1) {
        // One byte per event: both pipes have room.
      }
      to.events.push_back(e);
    }
    old->second.events.swap(keep);
    ctx->file = file;
    ctx->host = to.host;
  }
  rdma_ucm_migrate_resp resp{ctx->events_reported};
  memcpy(UserPtr(c.response), &resp, hdr.out < sizeof resp ? hdr.out : sizeof resp);
  return 0;
}

bool FakeCmFabric::PortTaken(FakeCmHost* host, uint16_t ps, uint16_t port) {
  for (auto& [h, c] : ctxs_)
    if (c.host == host && c.bound && c.ps == ps && c.src.sin_port == port) return true;
  return false;
}

// rdma_bind_addr(): an address of the id's host (or any), port 0 an
// ephemeral one.
int FakeCmFabric::BindTo(Ctx* c, sockaddr_in addr) {
  if (!IsAny(addr) && addr.sin_addr.s_addr != c->host->ip()) return -EADDRNOTAVAIL;
  if (addr.sin_port == 0) {
    do {
      addr.sin_port = htons(next_port_++);
      if (next_port_ == 61000) next_port_ = 40000;
    } while (PortTaken(c->host, c->ps, addr.sin_port));
  } else if (PortTaken(c->host, c->ps, addr.sin_port)) {
    return -EADDRINUSE;
  }
  c->src = addr;
  c->bound = true;
  c->state = St::kBound;
  return 0;
}

int FakeCmFabric::Bind(ino_t file, const char* body) {
  auto b = As<rdma_ucm_bind>(body);
  sockaddr_in a;
  if (b.reserved || !Ipv4(&b.addr, b.addr_size, &a)) return -EINVAL;
  int err = 0;
  Ctx* c = Find(file, b.id, &err);
  if (c == nullptr) return err;
  if (c->state != St::kIdle) return -EINVAL;
  return BindTo(c, a);
}

int FakeCmFabric::Listen(ino_t file, const char* body) {
  auto li = As<rdma_ucm_listen>(body);
  int err = 0;
  Ctx* c = Find(file, li.id, &err);
  if (c == nullptr) return err;
  if (c->state == St::kIdle) {
    sockaddr_in any{};
    any.sin_family = AF_INET;
    if (int rc = BindTo(c, any); rc < 0) return rc;
  }
  if (c->state != St::kBound) return -EINVAL;
  c->backlog = li.backlog > 0 && li.backlog < kMaxBacklog ? li.backlog : kMaxBacklog;
  c->state = St::kListen;
  return 0;
}

FakeCmHost* FakeCmFabric::HostOf(uint32_t ip) {
  for (auto& h : hosts_)
    if (h->ip() == ip) return h.get();
  return nullptr;
}

int FakeCmFabric::ResolveAddr(ino_t file, const char* body) {
  auto r = As<rdma_ucm_resolve_addr>(body);
  sockaddr_in src{}, dst;
  if (r.reserved || (r.src_size && !Ipv4(&r.src_addr, r.src_size, &src)) ||
      !Ipv4(&r.dst_addr, r.dst_size, &dst))
    return -EINVAL;
  int err = 0;
  Ctx* c = Find(file, r.id, &err);
  if (c == nullptr) return err;
  if (c->state == St::kIdle) {
    src.sin_family = AF_INET;
    if (int rc = BindTo(c, src); rc < 0) return rc;
  }
  if (c->state != St::kBound) return -EINVAL;
  const bool group = IN_MULTICAST(ntohl(dst.sin_addr.s_addr));
  if (!group && HostOf(dst.sin_addr.s_addr) == nullptr) {
    QueueEvent(c, kCmAddrError, -EHOSTUNREACH, nullptr);
    return 0;
  }
  c->src.sin_addr.s_addr = c->host->ip();
  c->dst = dst;
  c->state = St::kAddrResolved;
  QueueEvent(c, kCmAddrResolved, 0, nullptr);
  return 0;
}

int FakeCmFabric::ResolveRoute(ino_t file, const char* body) {
  auto r = As<rdma_ucm_resolve_route>(body);
  int err = 0;
  Ctx* c = Find(file, r.id, &err);
  if (c == nullptr) return err;
  if (c->state != St::kAddrResolved) return -EINVAL;
  c->state = St::kRouteResolved;
  QueueEvent(c, kCmRouteResolved, 0, nullptr);
  return 0;
}

FakeCmFabric::Ctx* FakeCmFabric::ListenerAt(FakeCmHost* host, uint16_t ps, uint16_t port) {
  for (auto& [h, c] : ctxs_)
    if (c.host == host && c.state == St::kListen && c.ps == ps && c.src.sin_port == port) return &c;
  return nullptr;
}

// The REQ: a new id on the listener's file, under no uid yet.
int FakeCmFabric::Connect(ino_t file, const char* body) {
  auto cn = As<rdma_ucm_connect>(body);
  if (!cn.conn_param.valid) return -EINVAL;
  int err = 0;
  Ctx* c = Find(file, cn.id, &err);
  if (c == nullptr) return err;
  if (c->state != St::kRouteResolved) return -EINVAL;
  if (cn.conn_param.private_data_len > kReqPrivateData) return -EINVAL;
  c->state = St::kConnect;
  c->qp_num = cn.conn_param.qp_num;
  Ctx* l = ListenerAt(HostOf(c->dst.sin_addr.s_addr), c->ps, c->dst.sin_port);
  if (l == nullptr || l->backlog == 0) {
    c->state = St::kDisconnected;
    QueueEvent(c, kCmRejected, l == nullptr ? kRejInvalidServiceId : kRejConsumerDefined, nullptr);
    return 0;
  }
  --l->backlog;
  uint32_t h = first_handle_;
  while (ctxs_.count(h)) ++h;
  Ctx& child = ctxs_[h];
  child.handle = h;
  child.ps = c->ps;
  child.file = l->file;
  child.host = l->host;
  child.state = St::kRequested;
  child.src = c->dst;
  child.dst = c->src;
  child.peer = c->handle;
  child.listener = l->handle;
  c->peer = h;
  rdma_ucm_conn_param p = cn.conn_param;
  p.private_data_len = kReqPrivateData;
  p.responder_resources = cn.conn_param.initiator_depth;
  p.initiator_depth = cn.conn_param.responder_resources;
  QueueEvent(&child, kCmConnectRequest, 0, &p, l->handle);
  return 0;
}

// The passive side's ACCEPT sends the REP (and sets the uid); the active
// side's, without conn_param, the RTU.
int FakeCmFabric::Accept(ino_t file, const char* body) {
  auto a = As<rdma_ucm_accept>(body);
  int err = 0;
  Ctx* c = Find(file, a.id, &err);
  if (c == nullptr) return err;
  auto pit = ctxs_.find(c->peer);
  if (pit == ctxs_.end()) return -EINVAL;
  Ctx& peer = pit->second;
  if (c->state == St::kRequested && a.conn_param.valid && c->ps == RDMA_PS_UDP) {
    // A UD id's SIDR REP: the active side's id resolved (its ESTABLISHED
    // carries the QPN and QKEY), no connection kept on either side.
    c->uid = a.uid;
    c->qp_num = a.conn_param.qp_num;
    c->state = St::kEstablished;
    peer.state = St::kEstablished;
    QueueEvent(&peer, kCmEstablished, 0, nullptr);
    return 0;
  }
  if (c->state == St::kRequested && a.conn_param.valid) {
    c->uid = a.uid;
    c->qp_num = a.conn_param.qp_num;
    c->state = St::kAccepted;
    peer.state = St::kResponded;
    rdma_ucm_conn_param p = a.conn_param;
    p.private_data_len = kRepPrivateData;
    p.responder_resources = a.conn_param.initiator_depth;
    p.initiator_depth = a.conn_param.responder_resources;
    if (rep_delay_ms_ == 0) {
      QueueEvent(&peer, kCmConnectResponse, 0, &p);
      return 0;
    }
    late_reps_.emplace_back([this, to = peer.handle, p, ms = rep_delay_ms_] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      std::lock_guard<std::mutex> l(mu_);
      auto it = ctxs_.find(to);
      if (it != ctxs_.end()) QueueEvent(&it->second, kCmConnectResponse, 0, &p);
    });
    return 0;
  }
  if (c->state == St::kResponded && !a.conn_param.valid && peer.state == St::kAccepted) {
    c->state = St::kEstablished;
    peer.state = St::kEstablished;
    QueueEvent(&peer, kCmEstablished, 0, nullptr);
    return 0;
  }
  return -EINVAL;
}

// A DREQ: the peer gets DISCONNECTED, and the caller too when the DREP
// comes. On an id the peer disconnected, the DREP only (no event).
int FakeCmFabric::Disconnect(ino_t file, const char* body) {
  auto d = As<rdma_ucm_disconnect>(body);
  int err = 0;
  Ctx* c = Find(file, d.id, &err);
  if (c == nullptr) return err;
  switch (c->state) {
    case St::kEstablished:
    case St::kResponded:
    case St::kAccepted:
      SendDreq(c);
      c->state = St::kDisconnected;
      QueueEvent(c, kCmDisconnected, 0, nullptr);
      return 0;
    case St::kConnect:
    case St::kRequested:
    case St::kDisconnected:
      return 0;
    default:
      return -EINVAL;
  }
}

int FakeCmFabric::Query(ino_t file, const Hdr& hdr, const char* body) {
  auto q = As<rdma_ucm_query>(body);
  int err = 0;
  Ctx* c = Find(file, q.id, &err);
  if (c == nullptr) return err;
  if (q.option != RDMA_USER_CM_QUERY_ADDR) return -ENOSYS;  // not modelled
  if (hdr.out < sizeof(rdma_ucm_query_addr_resp)) return -ENOSPC;
  rdma_ucm_query_addr_resp r{};
  const bool device = c->bound || c->state == St::kRequested || c->state >= St::kAccepted;
  if (device && !IsAny(c->src)) {
    r.node_guid = c->host->node_guid();
    r.ibdev_index = c->host->device_index();
    r.port_num = 1;
  }
  r.pkey = 0xffff;
  r.src_size = r.dst_size = sizeof(sockaddr_in);
  memcpy(&r.src_addr, &c->src, sizeof c->src);
  memcpy(&r.dst_addr, &c->dst, sizeof c->dst);
  memcpy(UserPtr(q.response), &r, sizeof r);
  return 0;
}

int FakeCmFabric::QueryRoute(ino_t file, const Hdr& hdr, const char* body) {
  auto q = As<rdma_ucm_query>(body);
  int err = 0;
  Ctx* c = Find(file, q.id, &err);
  if (c == nullptr) return err;
  if (hdr.out < sizeof(rdma_ucm_query_route_resp)) return -ENOSPC;
  rdma_ucm_query_route_resp r{};
  if (!IsAny(c->src)) {
    r.node_guid = c->host->node_guid();
    r.ibdev_index = c->host->device_index();
    r.port_num = 1;
  }
  memcpy(&r.src_addr, &c->src, sizeof c->src);
  memcpy(&r.dst_addr, &c->dst, sizeof c->dst);
  r.num_paths = c->state >= St::kRouteResolved && c->state != St::kListen ? 1 : 0;
  memcpy(UserPtr(q.response), &r, sizeof r);
  return 0;
}

void FakeCmFabric::QueueEvent(Ctx* c, uint32_t event, int32_t status, const rdma_ucm_conn_param* p,
                              uint32_t counted_for) {
  if (event != kCmConnectRequest && c->uid == 0) return;  // ucma_event_handler()
  File& f = files_[c->file];
  Event e;
  e.ctx = event == kCmConnectRequest ? counted_for : c->handle;
  e.resp.uid = event == kCmConnectRequest ? ctxs_[counted_for].uid : c->uid;
  e.resp.id = c->handle;
  e.resp.event = event;
  e.resp.status = static_cast<uint32_t>(status);
  if (p != nullptr) e.resp.param.conn = *p;
  f.events.push_back(e);
  const char byte = 1;
  if (write(f.wr, &byte, 1) != 1) {
    // A pipe holds 64 KiB of events.
  }
}

// JOIN_MCAST on a bound or resolved id: the group made, its
// MULTICAST_JOIN queued (its handle and uid; the group's GID and QPN).
int FakeCmFabric::Join(ino_t file, const Hdr& hdr, const char* body) {
  auto j = As<rdma_ucm_join_mcast>(body);
  if (hdr.out < sizeof(rdma_ucm_create_id_resp)) return -ENOSPC;
  sockaddr_in group;
  if (!Ipv4(&j.addr, j.addr_size, &group) || !IN_MULTICAST(ntohl(group.sin_addr.s_addr)))
    return -EINVAL;
  int err = 0;
  Ctx* c = Find(file, j.id, &err);
  if (c == nullptr) return err;
  if (c->state != St::kBound && c->state != St::kAddrResolved) return -EINVAL;
  uint32_t h = first_handle_;
  while (mcs_.count(h)) ++h;
  mcs_[h] = Mc{c->handle, j.uid, 0};
  File& f = files_[c->file];
  Event e;
  e.ctx = c->handle;
  e.mc = h + 1;
  e.resp.uid = j.uid;
  e.resp.id = h;
  e.resp.event = kCmMulticastJoin;
  e.resp.param.ud.qp_num = 0xffffff;
  e.resp.param.ud.qkey = 0x01234567;
  e.resp.param.ud.ah_attr.grh.dgid[10] = e.resp.param.ud.ah_attr.grh.dgid[11] = 0xff;
  memcpy(e.resp.param.ud.ah_attr.grh.dgid + 12, &group.sin_addr, 4);
  f.events.push_back(e);
  const char byte = 1;
  if (write(f.wr, &byte, 1) != 1) {
    // A pipe holds 64 KiB of events.
  }
  rdma_ucm_create_id_resp resp{h};
  memcpy(UserPtr(j.response), &resp, sizeof resp);
  return 0;
}

// LEAVE_MCAST, naming the group: its pending events dropped, its count
// answered.
int FakeCmFabric::Leave(ino_t file, const Hdr& hdr, const char* body) {
  auto d = As<rdma_ucm_destroy_id>(body);
  if (hdr.out < sizeof(rdma_ucm_destroy_id_resp)) return -ENOSPC;
  auto m = mcs_.find(d.id);
  if (m == mcs_.end()) return -ENOENT;
  auto c = ctxs_.find(m->second.ctx);
  if (c == ctxs_.end() || c->second.file != file) return -EINVAL;
  File& f = files_[file];
  std::deque<Event> keep;
  for (Event& e : f.events) {
    if (e.mc != d.id + 1) {
      keep.push_back(e);
      continue;
    }
    char byte;
    if (read(f.drain, &byte, 1) != 1) {
      // One byte per event: the pipe holds it.
    }
  }
  f.events.swap(keep);
  rdma_ucm_destroy_id_resp resp{m->second.events_reported};
  mcs_.erase(m);
  memcpy(UserPtr(d.response), &resp, sizeof resp);
  return 0;
}

// Never blocks (fake_cm.h): EAGAIN when nothing waits.
void FakeCmFabric::set_rep_delay_ms(int ms) {
  std::lock_guard<std::mutex> l(mu_);
  rep_delay_ms_ = ms;
}

FakeCmFabric::~FakeCmFabric() {
  for (std::thread& t : late_reps_) t.join();
}

int FakeCmFabric::GetEvent(ino_t file, int fd, const Hdr& hdr, const char* body) {
  auto g = As<rdma_ucm_get_event>(body);
  if (hdr.out < sizeof(rdma_ucm_event_resp) - sizeof(uint32_t) - sizeof(rdma_ucm_ece))
    return -ENOSPC;
  File& f = files_[file];
  if (f.events.empty()) {
    if (!(fcntl(fd, F_GETFL) & O_NONBLOCK)) ++blocking_gets_;
    return -EAGAIN;
  }
  Event e = f.events.front();
  f.events.pop_front();
  char byte;
  if (read(f.drain, &byte, 1) != 1) {
    // One byte per event: the pipe holds it.
  }
  auto it = ctxs_.find(e.ctx);
  if (it != ctxs_.end()) {
    ++it->second.events_reported;
    if (e.resp.event == kCmConnectRequest) ++it->second.backlog;
  }
  auto mc = e.mc != 0 ? mcs_.find(e.mc - 1) : mcs_.end();
  if (mc != mcs_.end()) ++mc->second.events_reported;
  memcpy(UserPtr(g.response), &e.resp, hdr.out < sizeof e.resp ? hdr.out : sizeof e.resp);
  return 0;
}

// ucma_close(): every id of the file destroyed (DREQs sent), its events
// with it.
void FakeCmFabric::Close(int fd) {
  std::lock_guard<std::mutex> l(mu_);
  const ino_t ino = InodeOf(fd);
  auto it = files_.find(ino);
  if (it != files_.end()) {
    std::vector<uint32_t> mine;
    for (auto& [h, c] : ctxs_)
      if (c.file == ino) mine.push_back(h);
    for (uint32_t h : mine) DestroyCtx(h);
    close(it->second.drain);
    close(it->second.wr);
    files_.erase(it);
  }
  close(fd);
}

}  // namespace rdmavirt::shim::testing
