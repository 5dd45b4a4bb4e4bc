// The CM layer's part of a move (cm.h): the moving process's check,
// release, restore and rendezvous; its peers' marking and reconnection.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "shim/cm/cm.h"
#include "shim/core/log.h"

namespace rdmavirt::shim {

namespace {

// The private data of a rendezvous REQ: which moved connection it is.
struct RendezvousKey {
  uint32_t magic;
  uint32_t moved_qpn;  // the moved QP's virtual QPN
  uint32_t peer_qpn;   // the peer QP's virtual QPN
  uint32_t reserved;
};
constexpr uint32_t kRendezvousMagic = 0x72766d31;  // "rvm1"
constexpr int kStepMs = 5000;                      // one CM exchange's bound
// A connect's bound: the kernel's CM sends a REQ again only when no REP
// came within about 4.8 s on RoCE (twice the packet lifetime, 2^16 *
// 4.096 us, plus the CM response timeout, 2^20 * 4.096 us), so a REQ or a
// REP the fabric lost once takes more than kStepMs. Two losses fit.
constexpr int kConnectMs = 15000;
constexpr int kRendezvousMs = 20000;  // a resume's wait for all (its RPC allows 30 s)

int64_t NowMs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

const char* EventName(uint32_t e) {
  switch (e) {
    case kCmAddrResolved:
      return "ADDR_RESOLVED";
    case kCmRouteResolved:
      return "ROUTE_RESOLVED";
    case kCmConnectResponse:
      return "CONNECT_RESPONSE";
    case kCmMulticastJoin:
      return "MULTICAST_JOIN";
    case kCmAddrError:
      return "ADDR_ERROR";
    case kCmRouteError:
      return "ROUTE_ERROR";
    case kCmConnectError:
      return "CONNECT_ERROR";
    case kCmUnreachable:
      return "UNREACHABLE";
    case kCmRejected:
      return "REJECTED";
    case kCmDisconnected:
      return "DISCONNECTED";
    case kCmDeviceRemoval:
      return "DEVICE_REMOVAL";
    case kCmMulticastError:
      return "MULTICAST_ERROR";
    default:
      return "an unexpected event";
  }
}

// The address a mapping's physical GID stands for, at `port`.
void GidAddress(const ibv_gid& gid, uint16_t port, sockaddr_storage* out, uint16_t* len) {
  memset(out, 0, sizeof *out);
  static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (memcmp(gid.raw, kMapped, 12) == 0) {
    auto* in = reinterpret_cast<sockaddr_in*>(out);
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    memcpy(&in->sin_addr, gid.raw + 12, 4);
    *len = sizeof *in;
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(out);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    memcpy(&in6->sin6_addr, gid.raw, 16);
    *len = sizeof *in6;
  }
}

// Makes `a` (an IPv4 or IPv6 address) its family's any-address, its port
// kept; false (unchanged) if it was one already or is of another family.
bool AnyAddress(sockaddr_storage* a) {
  if (a->ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(a);
    if (in->sin_addr.s_addr == htonl(INADDR_ANY)) return false;
    in->sin_addr.s_addr = htonl(INADDR_ANY);
    return true;
  }
  if (a->ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(a);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) return false;
    in6->sin6_addr = in6addr_any;
    return true;
  }
  return false;
}

// A SET_OPTION kept for an id (level, name, length, value), for kernel id
// `kid`.
rdma_ucm_set_option OptionCommand(const std::string& o, uint32_t kid) {
  rdma_ucm_set_option s{};
  memcpy(&s.level, o.data(), 4);
  memcpy(&s.optname, o.data() + 4, 4);
  memcpy(&s.optlen, o.data() + 8, 4);
  s.optval = reinterpret_cast<uintptr_t>(o.data() + 12);
  s.id = kid;
  return s;
}

// A BIND of kernel id `kid` to `addr` (`len` bytes).
rdma_ucm_bind BindCommand(const sockaddr_storage& addr, uint16_t len, uint32_t kid) {
  rdma_ucm_bind b{};
  b.id = kid;
  b.addr_size = len;
  memcpy(&b.addr, &addr, len);
  return b;
}

const QpView* FindQp(const std::vector<QpView>& qps, uint32_t vqpn) {
  for (const QpView& q : qps)
    if (q.virtual_qpn == vqpn) return &q;
  return nullptr;
}

}  // namespace

// A kernel channel of the CM layer's own (a rendezvous): its commands and
// its events, each waited for with a deadline.
class CmPrivateChannel {
 public:
  explicit CmPrivateChannel(CmKernel* k) : k_(k), fd_(k->Open()) {
    if (fd_ >= 0) fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
  }
  ~CmPrivateChannel() {
    if (fd_ >= 0) k_->Close(fd_);
  }
  int fd() const { return fd_; }

  bool Send(uint32_t cmd, const void* body, size_t in, size_t out) {
    char buf[kMaxCommand];
    const size_t n = FrameCommand(cmd, body, in, out, buf);
    return n != 0 && k_->Write(fd_, buf, n) >= 0;
  }
  // The next event, or false at `deadline_ms` (NowMs) or on an error.
  bool Next(rdma_ucm_event_resp* ev, int64_t deadline_ms) {
    for (;;) {
      rdma_ucm_get_event c{reinterpret_cast<uintptr_t>(ev)};
      if (Send(RDMA_USER_CM_CMD_GET_EVENT, &c, sizeof c, sizeof *ev)) return true;
      if (errno != EAGAIN) return false;
      const int64_t left = deadline_ms - NowMs();
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      poll(&p, 1, static_cast<int>(left < 200 ? left : 200));
    }
  }
  // Waits up to `ms` for event `want` on kernel id `kid`; an error event
  // fails it, with `why` naming what came instead.
  bool Await(uint32_t kid, uint32_t want, std::string* why, int ms = kStepMs) {
    const int64_t deadline = NowMs() + ms;
    rdma_ucm_event_resp ev{};
    while (Next(&ev, deadline)) {
      if (ev.id != kid) continue;
      if (ev.event == want) return true;
      *why = std::string(EventName(ev.event)) + " (status " + std::to_string(ev.status) + ")";
      return false;
    }
    *why = "no " + std::string(EventName(want)) + " within " + std::to_string(ms) + " ms";
    return false;
  }

 private:
  CmKernel* k_;
  int fd_;
};

Status Cm::CheckMovable() {
  MutexLock l(&mu_);
  for (auto& [vmc, g] : groups_) {
    if (g.state != Join::kJoining) continue;
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "an RDMA CM id of the process (id %u) is joining a multicast group, not yet "
                  "joined, which a move cannot carry yet; nothing was quiesced",
                  g.vid);
    return Error(Code::kFailedPrecondition, msg);
  }
  for (auto& [vid, id] : ids_) {
    const bool joined = HasGroups(vid);
    bool ok = false;
    switch (id.state) {
      case CmState::kIdle:
      case CmState::kBound:
      case CmState::kListening:
      case CmState::kDisconnected:
        ok = true;
        break;
      case CmState::kAddrResolved:
        // A multicast sender's or receiver's: its address is resolved
        // again on the destination, and its groups joined again.
        ok = joined && !id.resolve.empty();
        break;
      case CmState::kEstablished:
        // A UD id keeps no connection: its datagrams are the verbs layer's.
        ok = !joined && (id.qp_type == IBV_QPT_UD || (id.qpn != 0 && !id.toward_moving));
        break;
      default:
        break;
    }
    if (ok) continue;
    char msg[256];
    std::string what = id.toward_moving ? "its peer is moving" : CmStateName(id.state);
    if (joined) what += " and joined to a multicast group";
    std::snprintf(msg, sizeof msg,
                  "an RDMA CM id of the process (id %u, on channel fd %d) is %s, which a move "
                  "cannot carry yet; nothing was quiesced",
                  id.vid, id.channel, what.c_str());
    return Error(Code::kFailedPrecondition, msg);
  }
  return {};
}

void Cm::MarkToward(const ibv_gid& toward, const std::vector<QpView>& qps) {
  MutexLock l(&mu_);
  for (auto& [vid, id] : ids_) {
    if (id.state != CmState::kEstablished || id.kid == kNoKid) continue;
    const QpView* q = FindQp(qps, id.qpn);
    if (q == nullptr || !q->connected) continue;
    if (memcmp(q->remote_virtual_gid.raw, toward.raw, 16) != 0) continue;
    id.toward_moving = true;
    id.remote_qpn = q->remote_virtual_qpn;
  }
}

Status Cm::Release() {
  MutexLock l(&mu_);
  for (auto& [fd, ch] : channels_) {
    if (ch->real < 0) continue;
    // What the kernel holds for the application is the shim's from now.
    while (KernelHasEvent(ch->real)) {
      rdma_ucm_event_resp ev{};
      rdma_ucm_get_event c{reinterpret_cast<uintptr_t>(&ev)};
      if (Kernel(ch->real, RDMA_USER_CM_CMD_GET_EVENT, &c, sizeof c, sizeof ev) < 0) break;
      if (Translate(&ev)) Queue(ch.get(), std::string(reinterpret_cast<char*>(&ev), sizeof ev));
    }
    epoll_ctl(ch->fd, EPOLL_CTL_DEL, ch->real, nullptr);
    relays_.erase(ch->real);
    kernel_->Close(ch->real);  // ends every kernel id of the channel
    ch->real = -1;
  }
  for (auto& [vid, id] : ids_) id.kid = kNoKid;
  for (auto& [vmc, g] : groups_) g.kmc = kNoKid;
  return {};
}

Status Cm::RemakeId(Channel* ch, Id* id) {
  switch (id->state) {
    case CmState::kEstablished:
      // A UD id goes on without a kernel id: its SIDR exchange is done and
      // nothing of it is the kernel's but its address, which the queries
      // answer as before the move (AnswerWithoutKernel).
      if (id->qp_type != IBV_QPT_UD) id->state = CmState::kRendezvous;
      return {};
    case CmState::kDisconnected:
      return {};  // librdmacm destroys it; DESTROY_ID is answered here
    default:
      break;
  }
  if (HasGroups(id->vid)) return RemakeJoined(ch, id);
  char msg[200];
  rdma_ucm_create_id_resp resp{};
  rdma_ucm_create_id c{};
  c.uid = id->uid;
  c.response = reinterpret_cast<uintptr_t>(&resp);
  c.ps = id->ps;
  c.qp_type = id->qp_type;
  if (Kernel(ch->real, RDMA_USER_CM_CMD_CREATE_ID, &c, sizeof c, sizeof resp) < 0) {
    std::snprintf(msg, sizeof msg, "RDMA CM id %u cannot be made again: %s", id->vid,
                  strerror(errno));
    return Error(Code::kInternal, msg);
  }
  id->kid = resp.id;
  for (const std::string& o : id->options) {
    rdma_ucm_set_option s = OptionCommand(o, id->kid);
    Kernel(ch->real, RDMA_USER_CM_CMD_SET_OPTION, &s, sizeof s, 0);
  }
  if (id->bound_len != 0) {
    rdma_ucm_bind b = BindCommand(id->bound, id->bound_len, id->kid);
    bool bound = Kernel(ch->real, RDMA_USER_CM_CMD_BIND, &b, sizeof b, 0) >= 0;
    id->rebound = false;  // its own address again (a move back), or as below
    if (!bound && errno == EADDRNOTAVAIL &&
        AnyAddress(reinterpret_cast<sockaddr_storage*>(&b.addr))) {
      // An address of the source host's own (libfabric's verbs provider
      // binds its passive endpoint to the host's address, not to a
      // service address): the same port on every address here. Before,
      // the move was refused here and rolled back.
      bound = Kernel(ch->real, RDMA_USER_CM_CMD_BIND, &b, sizeof b, 0) >= 0;
      id->rebound = bound;
      if (bound && LogMoves()) {
        std::snprintf(msg, sizeof msg,
                      "RDMA CM id %u bound again to the any-address (its own is not here)",
                      id->vid);
        Log(msg);
      }
    }
    if (!bound) {
      std::snprintf(msg, sizeof msg,
                    "RDMA CM id %u cannot be bound again to its address here: %s (a listener "
                    "moves with its service address)",
                    id->vid, strerror(errno));
      return Error(Code::kFailedPrecondition, msg);
    }
  }
  if (id->state == CmState::kListening) {
    rdma_ucm_listen li{id->kid, id->backlog};
    if (Kernel(ch->real, RDMA_USER_CM_CMD_LISTEN, &li, sizeof li, 0) < 0) {
      std::snprintf(msg, sizeof msg, "RDMA CM listener %u cannot listen again: %s", id->vid,
                    strerror(errno));
      return Error(Code::kInternal, msg);
    }
  }
  return {};
}

// An id joined to multicast groups, made again on a channel of the CM
// layer's own: its address resolved again as librdmacm asked for it, each
// group joined again (the same uid: librdmacm's record of it), every event
// of it awaited there (the move's: the program had its own), then the id
// put under the program's channel, its groups with it. The QP's
// attachments are the verbs layer's, made again with the QP.
Status Cm::RemakeJoined(Channel* ch, Id* id) {
  char msg[256];
  CmPrivateChannel pc(kernel_);
  if (pc.fd() < 0) return Error(Code::kInternal, "an RDMA CM channel cannot be opened here");
  rdma_ucm_create_id_resp resp{};
  rdma_ucm_create_id c{id->uid, reinterpret_cast<uintptr_t>(&resp), id->ps, id->qp_type, {}};
  std::string why;
  bool ok = pc.Send(RDMA_USER_CM_CMD_CREATE_ID, &c, sizeof c, sizeof resp);
  const uint32_t kid = resp.id;
  for (const std::string& o : id->options) {
    rdma_ucm_set_option s = OptionCommand(o, kid);
    ok = ok && pc.Send(RDMA_USER_CM_CMD_SET_OPTION, &s, sizeof s, 0);
  }
  if (ok && id->bound_len != 0) {
    rdma_ucm_bind b = BindCommand(id->bound, id->bound_len, kid);
    ok = pc.Send(RDMA_USER_CM_CMD_BIND, &b, sizeof b, 0);
  }
  if (!ok) why = std::string("the kernel refused a command: ") + strerror(errno);
  if (ok && id->state == CmState::kAddrResolved) {
    std::string r = id->resolve;
    const size_t at = id->resolve_cmd == RDMA_USER_CM_CMD_RESOLVE_IP
                          ? offsetof(rdma_ucm_resolve_ip, id)
                          : offsetof(rdma_ucm_resolve_addr, id);
    ok = r.size() >= at + 4;
    if (ok) memcpy(r.data() + at, &kid, 4);
    ok = ok && pc.Send(id->resolve_cmd, r.data(), r.size(), 0);
    if (!ok) why = std::string("its address cannot be resolved again: ") + strerror(errno);
    ok = ok && pc.Await(kid, kCmAddrResolved, &why);
  }
  for (auto& [vmc, g] : groups_) {
    if (!ok) break;
    if (g.vid != id->vid || g.state != Join::kJoined) continue;
    std::string j = g.body;
    const size_t at = g.cmd == RDMA_USER_CM_CMD_JOIN_IP_MCAST ? offsetof(rdma_ucm_join_ip_mcast, id)
                                                              : offsetof(rdma_ucm_join_mcast, id);
    rdma_ucm_create_id_resp jresp{};
    const uint64_t r = reinterpret_cast<uintptr_t>(&jresp);
    ok = j.size() >= at + 4;
    if (ok) {
      memcpy(j.data(), &r, 8);
      memcpy(j.data() + at, &kid, 4);
    }
    ok = ok && pc.Send(g.cmd, j.data(), j.size(), sizeof jresp);
    if (!ok) {
      why = std::string("its multicast group cannot be joined again: ") + strerror(errno);
      break;
    }
    g.kmc = jresp.id;
    ok = pc.Await(g.kmc, kCmMulticastJoin, &why);
    if (!ok) why = "its multicast group was not joined again: " + why;
  }
  rdma_ucm_migrate_resp mresp{};
  rdma_ucm_migrate_id m{reinterpret_cast<uintptr_t>(&mresp), kid, static_cast<uint32_t>(pc.fd())};
  if (ok && Kernel(ch->real, RDMA_USER_CM_CMD_MIGRATE_ID, &m, sizeof m, sizeof mresp) < 0) {
    ok = false;
    why = std::string("it cannot be put under its channel: ") + strerror(errno);
  }
  if (!ok) {
    for (auto& [vmc, g] : groups_)
      if (g.vid == id->vid) g.kmc = kNoKid;  // closed with the private channel
    std::snprintf(msg, sizeof msg,
                  "RDMA CM id %u (joined to a multicast group) cannot be made "
                  "again here: %s",
                  id->vid, why.c_str());
    return Error(Code::kFailedPrecondition, msg);
  }
  id->kid = kid;
  return {};
}

Status Cm::OpenRendezvous() {
  rv_fd_ = kernel_->Open();
  if (rv_fd_ < 0) return Error(Code::kInternal, "the RDMA CM rendezvous cannot open a channel");
  fcntl(rv_fd_, F_SETFL, fcntl(rv_fd_, F_GETFL) | O_NONBLOCK);
  rdma_ucm_create_id_resp resp{};
  rdma_ucm_create_id c{};
  c.uid = 1;  // the kernel queues no event for an id without one
  c.response = reinterpret_cast<uintptr_t>(&resp);
  c.ps = RDMA_PS_TCP;
  c.qp_type = IBV_QPT_RC;
  rdma_ucm_bind b{};
  auto* any = reinterpret_cast<sockaddr_in*>(&b.addr);
  any->sin_family = AF_INET;
  b.addr_size = sizeof *any;
  rdma_ucm_listen li{0, 64};
  rdma_ucm_query_addr_resp addr{};
  rdma_ucm_query q{reinterpret_cast<uintptr_t>(&addr), 0, RDMA_USER_CM_QUERY_ADDR};
  bool ok = Kernel(rv_fd_, RDMA_USER_CM_CMD_CREATE_ID, &c, sizeof c, sizeof resp) >= 0;
  b.id = li.id = q.id = resp.id;
  ok = ok && Kernel(rv_fd_, RDMA_USER_CM_CMD_BIND, &b, sizeof b, 0) >= 0;
  ok = ok && Kernel(rv_fd_, RDMA_USER_CM_CMD_LISTEN, &li, sizeof li, 0) >= 0;
  ok = ok && Kernel(rv_fd_, RDMA_USER_CM_CMD_QUERY, &q, sizeof q, sizeof addr) >= 0;
  if (!ok) {
    const std::string why = strerror(errno);
    kernel_->Close(rv_fd_);
    rv_fd_ = -1;
    return Error(Code::kInternal, "the RDMA CM rendezvous cannot listen: " + why);
  }
  rv_listener_ = resp.id;
  rv_port_ = ntohs(reinterpret_cast<sockaddr_in*>(&addr.src_addr)->sin_port);
  rv_stop_ = false;
  return {};
}

Status Cm::Restore(const std::vector<QpView>& qps) {
  MutexLock l(&mu_);
  moved_ = true;
  for (auto& [fd, ch] : channels_) {
    if (ch->real >= 0) continue;
    ch->real = OpenKernelChannel();
    if (ch->real < 0)
      return Error(Code::kInternal,
                   std::string("/dev/infiniband/rdma_cm cannot be opened: ") + strerror(errno));
    epoll_event ev{};
    ev.events = EPOLLIN;
    epoll_ctl(ch->fd, EPOLL_CTL_ADD, ch->real, &ev);
  }
  bool rendezvous = false;
  for (auto& [vid, id] : ids_) {
    Status st = RemakeId(channels_[id.channel].get(), &id);
    if (!st.ok()) return st;
    if (id.state == CmState::kRendezvous) {
      rendezvous = true;
      const QpView* q = FindQp(qps, id.qpn);
      id.rendezvous_qpn = q != nullptr ? q->physical_qpn : id.qpn;
    }
  }
  if (!rendezvous) return {};
  Status st = OpenRendezvous();
  if (!st.ok()) return st;
  rv_thread_ = std::thread([this] { ServeRendezvous(); });
  return {};
}

std::vector<CmRendezvous> Cm::Rendezvous() {
  MutexLock l(&mu_);
  std::vector<CmRendezvous> out;
  for (auto& [vid, id] : ids_)
    if (id.state == CmState::kRendezvous && rv_port_ != 0) out.push_back({id.qpn, rv_port_});
  return out;
}

// The moved process's side of each rendezvous, on a thread of its own
// from the restore until every connected id has a kernel id again (or the
// resume gives up): accept the peer's REQ for the id it names, and when
// the RTU has come put the kernel id under the application's channel.
void Cm::ServeRendezvous() {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  int fd;
  {
    MutexLock l(&mu_);
    fd = rv_fd_;
  }
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 100);
    MutexLock l(&mu_);
    bool waiting = false;
    for (auto& [vid, id] : ids_) waiting = waiting || id.state == CmState::kRendezvous;
    if (rv_stop_ || !waiting) break;
    rdma_ucm_event_resp ev{};
    rdma_ucm_get_event g{reinterpret_cast<uintptr_t>(&ev)};
    if (Kernel(fd, RDMA_USER_CM_CMD_GET_EVENT, &g, sizeof g, sizeof ev) < 0) continue;
    if (ev.event == kCmConnectRequest) {
      RendezvousKey key{};
      memcpy(&key, ev.param.conn.private_data, sizeof key);
      Id* id = nullptr;
      for (auto& [vid, i] : ids_)
        if (i.state == CmState::kRendezvous && i.qpn == key.moved_qpn &&
            i.rendezvous_child == kNoKid)
          id = &i;
      if (key.magic != kRendezvousMagic || id == nullptr) {
        rdma_ucm_reject r{};
        r.id = ev.id;
        Kernel(fd, RDMA_USER_CM_CMD_REJECT, &r, sizeof r, 0);
        continue;
      }
      rdma_ucm_accept a{};
      a.uid = id->uid;
      a.id = ev.id;
      a.conn_param.qp_num = id->rendezvous_qpn;
      a.conn_param.valid = 1;
      a.conn_param.retry_count = 7;
      a.conn_param.rnr_retry_count = 7;
      if (Kernel(fd, RDMA_USER_CM_CMD_ACCEPT, &a, sizeof a, 0) >= 0) id->rendezvous_child = ev.id;
      continue;
    }
    if (ev.event != kCmEstablished) continue;
    for (auto& [vid, id] : ids_) {
      if (id.state != CmState::kRendezvous || id.rendezvous_child != ev.id) continue;
      Channel* ch = channels_[id.channel].get();
      rdma_ucm_migrate_resp resp{};
      rdma_ucm_migrate_id m{reinterpret_cast<uintptr_t>(&resp), ev.id, static_cast<uint32_t>(fd)};
      if (ch->real >= 0 &&
          Kernel(ch->real, RDMA_USER_CM_CMD_MIGRATE_ID, &m, sizeof m, sizeof resp) >= 0) {
        id.kid = ev.id;
        id.state = CmState::kEstablished;
        if (LogMoves()) {
          char line[160];
          std::snprintf(line, sizeof line,
                        "RDMA CM id %u reconnected after the move (kernel id %u, channel %d)",
                        id.vid, id.kid, ch->real);
          Log(line);
        }
      }
      id.rendezvous_child = kNoKid;
      changed_.NotifyAll();
    }
  }
  MutexLock l(&mu_);
  kernel_->Close(rv_fd_);  // the listener with it
  rv_fd_ = -1;
  rv_port_ = 0;
  changed_.NotifyAll();
}

Status Cm::Resume() {
  {
    MutexLock l(&mu_);
    const int64_t deadline = NowMs() + kRendezvousMs;
    auto waiting = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (auto& [vid, id] : ids_)
        if (id.state == CmState::kRendezvous) return true;
      return false;
    };
    // The predicate runs with mu_ held (inside the wait).
    auto settled = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !waiting() || rv_fd_ < 0; };
    while (!settled() && NowMs() < deadline)
      changed_.WaitFor(&mu_, std::chrono::milliseconds(100), settled);
    rv_stop_ = true;
  }
  if (rv_thread_.joinable()) rv_thread_.join();
  MutexLock l(&mu_);
  for (auto& [vid, id] : ids_) {
    if (id.state != CmState::kRendezvous) continue;
    // Its peer never came: the connection's data path is the verbs', and
    // goes on; the CM's part of it is gone (a disconnect is local only).
    id.state = CmState::kEstablished;
    Log("an RDMA CM connection was not reconnected after the move: its peer never came");
  }
  return {};
}

Status Cm::ConnectToRendezvous(uint32_t vid, const RemoteMapping& m, uint16_t port,
                               uint32_t physical_qpn) {
  uint64_t uid;
  uint16_t ps;
  uint8_t qp_type;
  RendezvousKey key{kRendezvousMagic, 0, 0, 0};
  {
    MutexLock l(&mu_);
    Id* id = ById(vid);
    if (id == nullptr) return {};
    uid = id->uid;
    ps = id->ps;
    qp_type = id->qp_type;
    key.moved_qpn = id->remote_qpn;
    key.peer_qpn = id->qpn;
  }
  char msg[256];
  CmPrivateChannel pc(kernel_);
  if (pc.fd() < 0) return Error(Code::kInternal, "the RDMA CM rendezvous cannot open a channel");
  rdma_ucm_create_id_resp resp{};
  rdma_ucm_create_id c{uid, reinterpret_cast<uintptr_t>(&resp), ps, qp_type, {}};
  rdma_ucm_resolve_addr ra{};
  sockaddr_storage dst;
  uint16_t dst_len;
  GidAddress(m.physical_gid, port, &dst, &dst_len);
  ra.timeout_ms = kStepMs;
  ra.dst_size = dst_len;
  memcpy(&ra.dst_addr, &dst, dst_len);
  std::string why = "the kernel refused a command: ";
  bool ok = pc.Send(RDMA_USER_CM_CMD_CREATE_ID, &c, sizeof c, sizeof resp);
  const uint32_t kid = resp.id;
  ra.id = kid;
  ok = ok && pc.Send(RDMA_USER_CM_CMD_RESOLVE_ADDR, &ra, sizeof ra, 0);
  if (!ok) why += strerror(errno);
  ok = ok && pc.Await(kid, kCmAddrResolved, &why);
  rdma_ucm_resolve_route rr{kid, kStepMs};
  ok = ok && pc.Send(RDMA_USER_CM_CMD_RESOLVE_ROUTE, &rr, sizeof rr, 0);
  ok = ok && pc.Await(kid, kCmRouteResolved, &why);
  rdma_ucm_connect cn{};
  cn.id = kid;
  cn.conn_param.qp_num = physical_qpn;
  memcpy(cn.conn_param.private_data, &key, sizeof key);
  cn.conn_param.private_data_len = sizeof key;
  cn.conn_param.retry_count = 7;
  cn.conn_param.rnr_retry_count = 7;
  cn.conn_param.valid = 1;
  ok = ok && pc.Send(RDMA_USER_CM_CMD_CONNECT, &cn, sizeof cn, 0);
  ok = ok && pc.Await(kid, kCmConnectResponse, &why, kConnectMs);
  rdma_ucm_accept rtu{};
  rtu.id = kid;
  ok = ok && pc.Send(RDMA_USER_CM_CMD_ACCEPT, &rtu, sizeof rtu, 0);
  if (!ok) {
    std::snprintf(msg, sizeof msg, "RDMA CM id %u cannot reconnect to its moved peer (port %u): %s",
                  vid, port, why.c_str());
    return Error(Code::kUnavailable, msg);
  }
  MutexLock l(&mu_);
  Id* id = ById(vid);
  if (id == nullptr) return {};
  Channel* ch = channels_[id->channel].get();
  if (ch->real < 0) return Error(Code::kInternal, "an RDMA CM channel is released");
  rdma_ucm_migrate_resp mresp{};
  rdma_ucm_migrate_id mi{reinterpret_cast<uintptr_t>(&mresp), kid, static_cast<uint32_t>(pc.fd())};
  if (Kernel(ch->real, RDMA_USER_CM_CMD_MIGRATE_ID, &mi, sizeof mi, sizeof mresp) < 0) {
    std::snprintf(msg, sizeof msg, "RDMA CM id %u cannot take its new kernel id: %s", vid,
                  strerror(errno));
    return Error(Code::kInternal, msg);
  }
  if (id->kid != kNoKid) {
    // The old kernel id, which the source's DREQ disconnected.
    rdma_ucm_destroy_id_resp dresp{};
    rdma_ucm_destroy_id d{reinterpret_cast<uintptr_t>(&dresp), id->kid, 0};
    Kernel(ch->real, RDMA_USER_CM_CMD_DESTROY_ID, &d, sizeof d, sizeof dresp);
  }
  id->kid = kid;
  id->toward_moving = false;
  id->state = CmState::kEstablished;
  return {};
}

Status Cm::PeerReconnect(const std::vector<RemoteMapping>& mappings,
                         const std::vector<QpView>& qps) {
  struct Todo {
    uint32_t vid;
    const RemoteMapping* m;
    uint16_t port;
    uint32_t physical_qpn;
  };
  std::vector<Todo> todo;
  {
    MutexLock l(&mu_);
    for (auto& [vid, id] : ids_) {
      if (!id.toward_moving) continue;
      const QpView* q = FindQp(qps, id.qpn);
      for (const RemoteMapping& m : mappings) {
        if (q == nullptr || memcmp(q->remote_virtual_gid.raw, m.virtual_gid.raw, 16) != 0) continue;
        for (const auto& [vqpn, port] : m.cm_rendezvous)
          if (vqpn == id.remote_qpn)
            todo.push_back({vid, &m, static_cast<uint16_t>(port), q->physical_qpn});
      }
    }
  }
  Status first;
  for (const Todo& t : todo) {
    Status st = ConnectToRendezvous(t.vid, *t.m, t.port, t.physical_qpn);
    if (!st.ok() && first.ok()) first = st;
  }
  return first;
}

}  // namespace rdmavirt::shim
