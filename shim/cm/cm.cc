// The CM layer's channels, ids and commands (cm.h); the moves are in
// cm_move.cc.
#include "shim/cm/cm.h"

#include <dlfcn.h>
#include <endian.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "shim/abi/libc_dl.h"
#include "shim/cm/channels.h"
#include "shim/core/log.h"
#include "shim/datapath/thread_probe.h"

// libc's own write, under the name glibc exports beside "write" (the
// shim's write() would bring the command back here).
extern "C" ssize_t __write(int fd, const void* buf, size_t n);

namespace rdmavirt::shim {

namespace {

class LibcCmKernel : public CmKernel {
 public:
  int Open() override { return open("/dev/infiniband/rdma_cm", O_RDWR | O_CLOEXEC); }
  ssize_t Write(int fd, const void* cmd, size_t n) override { return __write(fd, cmd, n); }
  void Close(int fd) override { close(fd); }
  CmDevice LibraryDevice(CmDevice physical) override;
};

// The device's node GUID as sysfs shows it now ("0002:c903:0031:7a01"),
// in network order; 0 if it cannot be read.
uint64_t SysfsGuid(const char* device) {
  char path[128];
  std::snprintf(path, sizeof path, "/sys/class/infiniband/%s/node_guid", device);
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[40] = {};
  const ssize_t n = read(fd, text, sizeof text - 1);
  close(fd);
  unsigned a, b, c, d;
  if (n <= 0 || std::sscanf(text, "%x:%x:%x:%x", &a, &b, &c, &d) != 4) return 0;
  return htobe64((uint64_t{a} << 48) | (uint64_t{b} << 32) | (uint64_t{c} << 16) | d);
}

CmDevice LibcCmKernel::LibraryDevice(CmDevice physical) {
  // libibverbs' own functions (the shim's ibv_get_device_list is the
  // next object's through RTLD_NEXT); they read the list as librdmacm
  // will when it looks the device up.
  using List = ibv_device** (*)(int*);
  using Free = void (*)(ibv_device**);
  using Name = const char* (*)(ibv_device*);
  using Guid = __be64 (*)(ibv_device*);
  using Index = int (*)(ibv_device*);
  const LibcDl& dl = Libc();
  if (dl.dlsym == nullptr) return physical;
  auto list = reinterpret_cast<List>(dl.dlsym(RTLD_NEXT, "ibv_get_device_list"));
  auto release = reinterpret_cast<Free>(dl.dlsym(RTLD_NEXT, "ibv_free_device_list"));
  auto name = reinterpret_cast<Name>(dl.dlsym(RTLD_NEXT, "ibv_get_device_name"));
  auto guid = reinterpret_cast<Guid>(dl.dlsym(RTLD_NEXT, "ibv_get_device_guid"));
  auto index = reinterpret_cast<Index>(dl.dlsym(RTLD_NEXT, "ibv_get_device_index"));
  if (list == nullptr || release == nullptr || name == nullptr || guid == nullptr ||
      index == nullptr)
    return physical;
  int n = 0;
  ibv_device** devices = list(&n);
  if (devices == nullptr) return physical;
  CmDevice known = physical;
  for (int i = 0; i < n; ++i) {
    if (SysfsGuid(name(devices[i])) != physical.guid) continue;
    known.guid = guid(devices[i]);
    const int at = index(devices[i]);
    if (physical.index != kNoDeviceIndex && at >= 0) known.index = static_cast<uint32_t>(at);
  }
  release(devices);
  return known;
}

// Reads a command's body as T: librdmacm may send a shorter one (an
// older ABI); the rest stays zero.
template <typename T>
T As(const char* body, size_t in) {
  T t{};
  memcpy(&t, body, in < sizeof t ? in : sizeof t);
  return t;
}

template <typename T>
void Put(char* body, size_t in, const T& t) {
  memcpy(body, &t, in < sizeof t ? in : sizeof t);
}

void* UserPtr(uint64_t p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

ssize_t Fail(int err) {
  errno = err;
  return -1;
}

}  // namespace

CmKernel* RealCmKernel() {
  static LibcCmKernel k;
  return &k;
}

const char* CmStateName(CmState s) {
  switch (s) {
    case CmState::kIdle:
      return "idle";
    case CmState::kBound:
      return "bound";
    case CmState::kResolvingAddr:
      return "resolving an address";
    case CmState::kAddrResolved:
      return "address resolved, route not yet";
    case CmState::kResolvingRoute:
      return "resolving a route";
    case CmState::kRouteResolved:
      return "route resolved, not yet connected";
    case CmState::kConnecting:
      return "connect request sent, not yet answered";
    case CmState::kResponded:
      return "connect response received, not yet established";
    case CmState::kListening:
      return "listening";
    case CmState::kRequested:
      return "connect request received, not yet accepted";
    case CmState::kAccepting:
      return "accepted, not yet established";
    case CmState::kEstablished:
      return "established";
    case CmState::kDisconnected:
      return "disconnected";
    case CmState::kRendezvous:
      return "reconnecting after a move";
  }
  return "unknown";
}

bool CmAdopt(int fd) { return Cm::Process()->Adopt(fd); }
void CmForget(int fd) { Cm::Process()->Forget(fd); }
bool CmIsChannel(int fd) { return Cm::Process()->IsChannel(fd); }
ssize_t CmWrite(int fd, const void* buf, size_t n) { return Cm::Process()->Write(fd, buf, n); }

Cm* Cm::Process() {
  static Cm* cm = [] {
    IdentityMode mode;
    const char* m = getenv("RDMAVIRT_ID_MODE");
    mode.offset = m != nullptr && strcmp(m, "offset") == 0;  // as Shim::Process()
    return new Cm(RealCmKernel(), mode);
  }();
  return cm;
}

Cm::Cm(CmKernel* kernel, IdentityMode mode) : kernel_(kernel), mode_(mode) {}

Cm::~Cm() {
  {
    MutexLock l(&mu_);
    rv_stop_ = true;
  }
  if (rv_thread_.joinable()) rv_thread_.join();
}

bool Cm::Adopt(int fd) {
  const int real = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (real < 0) return false;
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  const int queue = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
  epoll_event ev{};
  ev.events = EPOLLIN;
  bool ok = ep >= 0 && queue >= 0;
  ok = ok && fcntl(real, F_SETFL, fcntl(real, F_GETFL) | O_NONBLOCK) == 0;
  ok = ok && epoll_ctl(ep, EPOLL_CTL_ADD, real, &ev) == 0;
  ok = ok && epoll_ctl(ep, EPOLL_CTL_ADD, queue, &ev) == 0;
  // The application's number now names the epoll fd; the kernel's file
  // lives on at `real`. O_CLOEXEC as librdmacm opened it.
  ok = ok && dup3(ep, fd, O_CLOEXEC) == fd;
  const int err = errno;
  if (ep >= 0) close(ep);
  if (!ok) {
    if (queue >= 0) close(queue);
    close(real);
    errno = err;
    return false;
  }
  auto ch = std::make_unique<Channel>();
  ch->fd = fd;
  ch->real = real;
  ch->queue_fd = queue;
  MutexLock l(&mu_);
  ch->serial = ++serials_;
  channels_[fd] = std::move(ch);
  return true;
}

void Cm::Forget(int fd) {
  MutexLock l(&mu_);
  auto it = channels_.find(fd);
  if (it == channels_.end()) return;
  if (it->second->real >= 0) {
    relays_.erase(it->second->real);
    kernel_->Close(it->second->real);
  }
  close(it->second->queue_fd);
  for (auto i = ids_.begin(); i != ids_.end();) {
    if (i->second.channel != fd) {
      ++i;
      continue;
    }
    for (auto g = groups_.begin(); g != groups_.end();)
      g = g->second.vid == i->first ? groups_.erase(g) : std::next(g);
    i = ids_.erase(i);
  }
  channels_.erase(it);
}

bool Cm::IsChannel(int fd) {
  MutexLock l(&mu_);
  return channels_.count(fd) != 0;
}

size_t Cm::ids() {
  MutexLock l(&mu_);
  return ids_.size();
}

size_t Cm::channels() {
  MutexLock l(&mu_);
  return channels_.size();
}

Cm::Id* Cm::ById(uint32_t vid) {
  auto it = ids_.find(vid);
  return it == ids_.end() ? nullptr : &it->second;
}

namespace {

// The first value of `m` that `pred` takes, or nullptr.
template <typename Map, typename Pred>
typename Map::mapped_type* FindIf(Map& m, Pred pred) {
  for (auto& [key, value] : m)
    if (pred(value)) return &value;
  return nullptr;
}

}  // namespace

Cm::Id* Cm::ByKernel(uint32_t kid) {
  if (kid == kNoKid) return nullptr;
  return FindIf(ids_, [kid](const Id& id) { return id.kid == kid; });
}

Cm::Id* Cm::ByUid(uint64_t uid) {
  if (uid == 0) return nullptr;
  return FindIf(ids_, [uid](const Id& id) { return id.uid == uid; });
}

Cm::Id* Cm::NewId(int channel) {
  while (next_vid_ == 0 || ids_.count(next_vid_)) ++next_vid_;
  Id& id = ids_[next_vid_];
  id.vid = next_vid_++;
  id.channel = channel;
  return &id;
}

CmDevice Cm::VirtualDevice(CmDevice physical) {
  if (physical.guid == 0) return physical;
  auto it = device_map_.find(physical);
  if (it != device_map_.end()) return it->second;
  // A device first seen after a move stands for the device librdmacm
  // chose before it, when there was one: librdmacm would otherwise open
  // the new device beside the one the application's PDs and QPs were made
  // on. (It looks a device up by GUID and index together, and a host's
  // index grows each time a device is made again: a listener moved to
  // such a host rejected its clients.) Before any, the verbs library's
  // name for it: librdmacm looks it up in the device list libibverbs
  // gives it, which on another host may still carry the old host's GUID
  // for a device of the same name and index (its clients were rejected:
  // librdmacm found no device and destroyed each new id).
  CmDevice virt = physical;
  if (moved_ && seen_devices_.size() == 1) {
    virt = seen_devices_[0];
  } else if (moved_) {
    virt = kernel_->LibraryDevice(physical);
  }
  if (!moved_) seen_devices_.push_back(physical);
  device_map_[physical] = virt;
  return virt;
}

size_t FrameCommand(uint32_t cmd, const void* body, size_t in, size_t out, char* buf) {
  if (in > kMaxCommand - sizeof(rdma_ucm_cmd_hdr)) return 0;
  rdma_ucm_cmd_hdr hdr{cmd, static_cast<uint16_t>(in), static_cast<uint16_t>(out)};
  memcpy(buf, &hdr, sizeof hdr);
  memcpy(buf + sizeof hdr, body, in);
  return sizeof hdr + in;
}

void Cm::CountDown(Channel* ch) {
  uint64_t one;
  if (read(ch->queue_fd, &one, sizeof one) < 0) {
    // The count and the queue change together, under mu_.
  }
}

ssize_t Cm::Kernel(int fd, uint32_t cmd, const void* body, size_t in, size_t out) {
  char buf[kMaxCommand];
  const size_t n = FrameCommand(cmd, body, in, out, buf);
  if (n == 0) return Fail(EINVAL);
  ssize_t rc = kernel_->Write(fd, buf, n);
  if (rc < 0 && errno == EACCES) {
    auto relay = relays_.find(fd);
    if (relay != relays_.end()) rc = relay->second->Write(buf, n);
  }
  return rc < 0 ? rc : static_cast<ssize_t>(in);
}

// Asked before each GET_EVENT of the kernel's: every GET_EVENT of the
// process is the shim's, under mu_, so an event seen here is still there
// for it. A relayed GET_EVENT that found none would not fail with EAGAIN:
// io_uring would wait for the fd to become writable, which it never does.
bool KernelHasEvent(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

int Cm::OpenKernelChannel() {
  const int fd = kernel_->Open();
  if (fd < 0) return -1;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::string why;
  std::unique_ptr<WriteRelay> relay = WriteRelay::Create(fd, &why);
  if (relay != nullptr) {
    relays_[fd] = std::move(relay);
  } else if (moved_) {
    LogOnce("an RDMA CM channel has no write relay: only its opening thread can use it");
  }
  return fd;
}

ssize_t Cm::Write(int fd, const void* buf, size_t n) {
  rdma_ucm_cmd_hdr hdr;
  if (n < sizeof hdr) return Fail(EINVAL);
  memcpy(&hdr, buf, sizeof hdr);
  if (n != sizeof hdr + hdr.in || hdr.in > 512) return Fail(EINVAL);
  char body[512];
  memcpy(body, static_cast<const char*>(buf) + sizeof hdr, hdr.in);
  if (hdr.cmd == RDMA_USER_CM_CMD_GET_EVENT) {
    const ssize_t rc = GetEvent(fd, hdr, body, hdr.in);
    return rc < 0 ? rc : static_cast<ssize_t>(n);
  }
  MutexLock l(&mu_);
  auto it = channels_.find(fd);
  if (it == channels_.end()) return Fail(EINVAL);
  const ssize_t rc = Command(it->second.get(), hdr, body, hdr.in);
  return rc < 0 ? rc : static_cast<ssize_t>(n);
}

namespace {

// Where a command's id handle is: its first u32 but where a response
// pointer (and for some a uid or an address) precedes it.
size_t IdOffset(uint32_t cmd) {
  switch (cmd) {
    case RDMA_USER_CM_CMD_BIND_IP:
      return offsetof(rdma_ucm_bind_ip, id);
    case RDMA_USER_CM_CMD_RESOLVE_IP:
      return offsetof(rdma_ucm_resolve_ip, id);
    case RDMA_USER_CM_CMD_QUERY_ROUTE:
    case RDMA_USER_CM_CMD_QUERY:
      return offsetof(rdma_ucm_query, id);
    case RDMA_USER_CM_CMD_INIT_QP_ATTR:
      return offsetof(rdma_ucm_init_qp_attr, id);
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST:
      return offsetof(rdma_ucm_join_ip_mcast, id);
    case RDMA_USER_CM_CMD_JOIN_MCAST:
      return offsetof(rdma_ucm_join_mcast, id);
    case RDMA_USER_CM_CMD_SET_OPTION:
      return offsetof(rdma_ucm_set_option, id);
    case RDMA_USER_CM_CMD_CONNECT:
      return offsetof(rdma_ucm_connect, id);
    case RDMA_USER_CM_CMD_ACCEPT:
      return offsetof(rdma_ucm_accept, id);
    default:
      return 0;  // RESOLVE_ADDR, RESOLVE_ROUTE, BIND, LISTEN, REJECT, DISCONNECT, NOTIFY
  }
}

// A QUERY_ROUTE or an address QUERY: answers that name a device.
bool NamesADevice(const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  return hdr.cmd == RDMA_USER_CM_CMD_QUERY_ROUTE ||
         (hdr.cmd == RDMA_USER_CM_CMD_QUERY &&
          As<rdma_ucm_query>(body, in).option == RDMA_USER_CM_QUERY_ADDR);
}

}  // namespace

// The id a command names (at IdOffset), on channel `ch`; nullptr with
// errno (ENOENT: none; EINVAL: too short, or another channel's).
Cm::Id* Cm::CommandId(Channel* ch, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  const size_t id_at = IdOffset(hdr.cmd);
  uint32_t vid;
  if (in < id_at + sizeof vid) return Fail(EINVAL), nullptr;
  memcpy(&vid, body + id_at, sizeof vid);
  Id* id = ById(vid);
  if (id == nullptr) return Fail(ENOENT), nullptr;
  if (id->channel != ch->fd) return Fail(EINVAL), nullptr;
  return id;
}

// Every command but GET_EVENT: the id's handle made the kernel's, the
// kernel's answer made the application's, and what a move needs kept.
ssize_t Cm::Command(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in) {
  switch (hdr.cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID:
      return CreateId(ch, hdr, body, in);
    case RDMA_USER_CM_CMD_DESTROY_ID:
    case RDMA_USER_CM_CMD_MIGRATE_ID:
      return DestroyOrMigrate(ch, hdr, body, in);
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST:
    case RDMA_USER_CM_CMD_JOIN_MCAST:
      return JoinGroup(ch, hdr, body, in);
    case RDMA_USER_CM_CMD_LEAVE_MCAST:
      return LeaveGroup(ch, hdr, body, in);
    default:
      break;
  }
  const size_t id_at = IdOffset(hdr.cmd);
  Id* id = CommandId(ch, hdr, body, in);
  if (id == nullptr) return -1;
  Keep(id, hdr, body, in);
  if (id->kid == kNoKid) {
    if (LogMoves()) {
      char line[160];
      std::snprintf(line, sizeof line, "RDMA CM command %u on id %u, which has no kernel id (%s)",
                    hdr.cmd, id->vid, CmStateName(id->state));
      Log(line);
    }
    return AnswerWithoutKernel(id, hdr, body, in);
  }
  if (id->rebound && NamesADevice(hdr, body, in)) return AnswerWithoutKernel(id, hdr, body, in);
  if (ch->real < 0) return Fail(EAGAIN);
  memcpy(body + id_at, &id->kid, 4);
  const ssize_t rc = NamesADevice(hdr, body, in) ? Query(ch, id, hdr, body, in)
                                                 : Kernel(ch->real, hdr.cmd, body, in, hdr.out);
  if (rc < 0) return -1;
  if (hdr.cmd == RDMA_USER_CM_CMD_INIT_QP_ATTR) VirtualizeQpAttr(hdr, body, in);
  Advance(id, hdr, body, in);
  return 0;
}

// INIT_QP_ATTR's answer, which librdmacm hands to ibv_modify_qp: the
// peer's GID the kernel's route names is physical; the program's verbs
// take virtual ones (offset mode: the marker set), as every GID they
// give it is. Before, a connection made through the CM left the QP with
// the physical GID as the peer's virtual one, and a move of the peer,
// known by its virtual GID, did not find it.
void Cm::VirtualizeQpAttr(const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  if (!mode_.offset || hdr.out < sizeof(ib_uverbs_qp_attr)) return;
  auto* attr =
      static_cast<ib_uverbs_qp_attr*>(UserPtr(As<rdma_ucm_init_qp_attr>(body, in).response));
  for (ib_uverbs_ah_attr* ah : {&attr->ah_attr, &attr->alt_ah_attr}) {
    ibv_gid g;
    memcpy(g.raw, ah->grh.dgid, 16);
    g = mode_.VirtualGid(g);
    memcpy(ah->grh.dgid, g.raw, 16);
  }
}

ssize_t Cm::CreateId(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in) {
  auto c = As<rdma_ucm_create_id>(body, in);
  rdma_ucm_create_id_resp resp{};
  const uint64_t app_resp = c.response;
  c.response = reinterpret_cast<uintptr_t>(&resp);
  if (ch->real < 0) return Fail(EAGAIN);
  if (Kernel(ch->real, hdr.cmd, &c, in, sizeof resp) < 0) return -1;
  Id* id = NewId(ch->fd);
  id->kid = resp.id;
  id->uid = c.uid;
  id->ps = c.ps;
  id->qp_type = c.qp_type;
  resp.id = id->vid;
  memcpy(UserPtr(app_resp), &resp, hdr.out < sizeof resp ? hdr.out : sizeof resp);
  return 0;
}

// DESTROY_ID (whose layout is MIGRATE_ID's without the fd) and MIGRATE_ID,
// written to the new channel and naming the old one's fd: both answer the
// events the shim gave out for the id.
ssize_t Cm::DestroyOrMigrate(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in) {
  auto c = As<rdma_ucm_migrate_id>(body, in);
  Id* id = ById(c.id);
  if (id == nullptr) return Fail(ENOENT);
  const bool destroy = hdr.cmd == RDMA_USER_CM_CMD_DESTROY_ID;
  if (destroy && id->channel != ch->fd) return Fail(EINVAL);
  const uint32_t vid = id->vid;
  Channel* from = ch;
  if (!destroy) {
    auto it = channels_.find(static_cast<int>(c.fd));
    if (it == channels_.end() || it->second->fd != id->channel) return Fail(EINVAL);
    from = it->second.get();
    c.fd = static_cast<uint32_t>(from->real);
  }
  rdma_ucm_migrate_resp resp{};
  const uint64_t app_resp = c.response;
  if (id->kid != kNoKid && ch->real >= 0) {
    c.id = id->kid;
    c.response = reinterpret_cast<uintptr_t>(&resp);
    if (Kernel(ch->real, hdr.cmd, &c, in, sizeof resp) < 0) return -1;
  }
  resp.events_reported = id->events;
  // The events the shim holds for the id go with it, as the kernel's do.
  std::deque<std::string> held =
      TakeQueued(from, [vid](const rdma_ucm_event_resp& ev) { return ev.id == vid; });
  if (destroy) {
    // The kernel leaves its groups with it.
    for (auto g = groups_.begin(); g != groups_.end();)
      g = g->second.vid == vid ? groups_.erase(g) : std::next(g);
    ids_.erase(vid);
  } else {
    for (std::string& e : held) Queue(ch, std::move(e));
    id->channel = ch->fd;
  }
  memcpy(UserPtr(app_resp), &resp, hdr.out < sizeof resp ? hdr.out : sizeof resp);
  return 0;
}

// What makes the id again after a move.
void Cm::Keep(Id* id, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  switch (hdr.cmd) {
    case RDMA_USER_CM_CMD_RESOLVE_ADDR:
    case RDMA_USER_CM_CMD_RESOLVE_IP:
      id->resolve_cmd = hdr.cmd;
      id->resolve.assign(body, in);
      break;
    case RDMA_USER_CM_CMD_BIND: {
      auto c = As<rdma_ucm_bind>(body, in);
      id->bound_len = c.addr_size < sizeof id->bound ? c.addr_size : sizeof id->bound;
      memcpy(&id->bound, &c.addr, id->bound_len);
      break;
    }
    case RDMA_USER_CM_CMD_BIND_IP: {
      auto c = As<rdma_ucm_bind_ip>(body, in);
      id->bound_len = sizeof c.addr;
      memcpy(&id->bound, &c.addr, sizeof c.addr);
      break;
    }
    case RDMA_USER_CM_CMD_SET_OPTION: {
      auto c = As<rdma_ucm_set_option>(body, in);
      std::string o(12, '\0');
      memcpy(o.data(), &c.level, 4);
      memcpy(o.data() + 4, &c.optname, 4);
      memcpy(o.data() + 8, &c.optlen, 4);
      if (c.optlen <= 256) o.append(static_cast<const char*>(UserPtr(c.optval)), c.optlen);
      id->options.push_back(std::move(o));
      break;
    }
    case RDMA_USER_CM_CMD_CONNECT:
      id->qpn = As<rdma_ucm_connect>(body, in).conn_param.qp_num;
      break;
    case RDMA_USER_CM_CMD_ACCEPT: {
      auto c = As<rdma_ucm_accept>(body, in);
      if (c.conn_param.valid) id->qpn = c.conn_param.qp_num;
      break;
    }
    default:
      break;
  }
}

// An id a move left without a kernel id: what can be answered here is.
ssize_t Cm::AnswerWithoutKernel(Id* id, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  if (NamesADevice(hdr, body, in)) {
    const std::string& kept =
        hdr.cmd == RDMA_USER_CM_CMD_QUERY_ROUTE ? id->query_route : id->query_addr;
    if (kept.empty()) return Fail(EINVAL);
    memcpy(UserPtr(As<rdma_ucm_query>(body, in).response), kept.data(),
           hdr.out < kept.size() ? hdr.out : kept.size());
    return 0;
  }
  if (hdr.cmd == RDMA_USER_CM_CMD_NOTIFY || hdr.cmd == RDMA_USER_CM_CMD_SET_OPTION) return 0;
  return Fail(id->state == CmState::kRendezvous ? EAGAIN : EINVAL);
}

// A query whose answer names a device: its GUID and index those
// librdmacm first saw, and the answer kept for the id's life after a move.
ssize_t Cm::Query(Channel* ch, Id* id, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in) {
  char kept[sizeof(rdma_ucm_query_addr_resp) > sizeof(rdma_ucm_query_route_resp)
                ? sizeof(rdma_ucm_query_addr_resp)
                : sizeof(rdma_ucm_query_route_resp)] = {};
  const uint64_t app_resp = As<rdma_ucm_query>(body, in).response;
  const uint64_t mine = reinterpret_cast<uintptr_t>(kept);
  memcpy(body, &mine, 8);
  const uint16_t out = hdr.out > sizeof kept ? sizeof kept : hdr.out;
  if (Kernel(ch->real, hdr.cmd, body, in, out) < 0) return -1;
  // node_guid leads both answers; an older ABI's shorter answer has no
  // device index.
  const size_t index_at = hdr.cmd == RDMA_USER_CM_CMD_QUERY_ROUTE
                              ? offsetof(rdma_ucm_query_route_resp, ibdev_index)
                              : offsetof(rdma_ucm_query_addr_resp, ibdev_index);
  const bool indexed = out >= index_at + sizeof(uint32_t);
  CmDevice dev{0, kNoDeviceIndex};
  memcpy(&dev.guid, kept, 8);
  if (indexed) memcpy(&dev.index, kept + index_at, sizeof dev.index);
  dev = VirtualDevice(dev);
  memcpy(kept, &dev.guid, 8);
  if (indexed) memcpy(kept + index_at, &dev.index, sizeof dev.index);
  memcpy(UserPtr(app_resp), kept, out);
  (hdr.cmd == RDMA_USER_CM_CMD_QUERY_ROUTE ? id->query_route : id->query_addr).assign(kept, out);
  return 0;
}

// The id's state after a command the kernel carried out.
void Cm::Advance(Id* id, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  switch (hdr.cmd) {
    case RDMA_USER_CM_CMD_BIND:
    case RDMA_USER_CM_CMD_BIND_IP:
      id->state = CmState::kBound;
      break;
    case RDMA_USER_CM_CMD_RESOLVE_ADDR:
    case RDMA_USER_CM_CMD_RESOLVE_IP:
      id->state = CmState::kResolvingAddr;
      break;
    case RDMA_USER_CM_CMD_RESOLVE_ROUTE:
      id->state = CmState::kResolvingRoute;
      break;
    case RDMA_USER_CM_CMD_CONNECT:
      id->state = CmState::kConnecting;
      break;
    case RDMA_USER_CM_CMD_LISTEN:
      id->backlog = As<rdma_ucm_listen>(body, in).backlog;
      id->state = CmState::kListening;
      break;
    case RDMA_USER_CM_CMD_ACCEPT: {
      auto c = As<rdma_ucm_accept>(body, in);
      if (c.uid != 0) id->uid = c.uid;
      // The active side's ACCEPT sends the RTU: established for librdmacm;
      // a UD id's, the SIDR REP, leaves nothing to wait for.
      const bool done = id->state == CmState::kResponded || id->qp_type == IBV_QPT_UD;
      id->state = done ? CmState::kEstablished : CmState::kAccepting;
      break;
    }
    case RDMA_USER_CM_CMD_REJECT:
    case RDMA_USER_CM_CMD_DISCONNECT:
      id->state = CmState::kDisconnected;
      break;
    default:
      break;
  }
}

Cm::Group* Cm::GroupByKernel(uint32_t kmc) {
  if (kmc == kNoKid) return nullptr;
  return FindIf(groups_, [kmc](const Group& g) { return g.kmc == kmc; });
}

Cm::Group* Cm::GroupByUid(uint64_t uid) {
  return FindIf(groups_, [uid](const Group& g) { return g.uid == uid; });
}

bool Cm::HasGroups(uint32_t vid) {
  return FindIf(groups_, [vid](const Group& g) { return g.vid == vid; }) != nullptr;
}

// JOIN_MCAST and JOIN_IP_MCAST (their response and uid lead both): the
// kernel's handle of the group kept, the shim's given out, and the
// command kept to join again after a move.
ssize_t Cm::JoinGroup(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in) {
  static_assert(
      offsetof(rdma_ucm_join_mcast, uid) == 8 && offsetof(rdma_ucm_join_ip_mcast, uid) == 8,
      "a join's response and uid lead it");
  const size_t id_at = IdOffset(hdr.cmd);
  Id* id = CommandId(ch, hdr, body, in);
  if (id == nullptr) return -1;
  const uint32_t vid = id->vid;
  if (id->kid == kNoKid) return Fail(EINVAL);
  if (ch->real < 0) return Fail(EAGAIN);
  Group g;
  g.vid = vid;
  g.cmd = hdr.cmd;
  g.body.assign(body, in);
  memcpy(&g.uid, body + 8, 8);
  uint64_t app_resp;
  memcpy(&app_resp, body, 8);
  rdma_ucm_create_id_resp resp{};
  const uint64_t mine = reinterpret_cast<uintptr_t>(&resp);
  memcpy(body, &mine, 8);
  memcpy(body + id_at, &id->kid, 4);
  if (Kernel(ch->real, hdr.cmd, body, in, sizeof resp) < 0) return -1;
  while (next_vmc_ == 0 || groups_.count(next_vmc_)) ++next_vmc_;
  g.vmc = next_vmc_++;
  g.kmc = resp.id;
  resp.id = g.vmc;
  groups_[g.vmc] = std::move(g);
  memcpy(UserPtr(app_resp), &resp, hdr.out < sizeof resp ? hdr.out : sizeof resp);
  return 0;
}

// LEAVE_MCAST (DESTROY_ID's layout, naming the group): what it answers,
// the events given out for the group, is the shim's count (a join made
// again after a move had events of its own, which the program never saw).
ssize_t Cm::LeaveGroup(Channel* ch, const rdma_ucm_cmd_hdr& hdr, char* body, size_t in) {
  auto c = As<rdma_ucm_destroy_id>(body, in);
  auto it = groups_.find(c.id);
  if (it == groups_.end()) return Fail(ENOENT);
  Group& g = it->second;
  const Id* id = ById(g.vid);
  if (id == nullptr || id->channel != ch->fd) return Fail(EINVAL);
  if (g.kmc != kNoKid) {
    if (ch->real < 0) return Fail(EAGAIN);
    rdma_ucm_destroy_id_resp resp{};
    rdma_ucm_destroy_id k{reinterpret_cast<uintptr_t>(&resp), g.kmc, 0};
    if (Kernel(ch->real, hdr.cmd, &k, sizeof k, sizeof resp) < 0) return -1;
  }
  // The events the shim holds for it go, as the kernel's do.
  const uint64_t uid = g.uid;
  TakeQueued(
      ch, [uid](const rdma_ucm_event_resp& ev) { return IsGroupEvent(ev.event) && ev.uid == uid; });
  rdma_ucm_destroy_id_resp resp{g.events};
  groups_.erase(it);
  memcpy(UserPtr(c.response), &resp, hdr.out < sizeof resp ? hdr.out : sizeof resp);
  return 0;
}

std::deque<std::string> Cm::TakeQueued(Channel* ch,
                                       const std::function<bool(const rdma_ucm_event_resp&)>& its) {
  std::deque<std::string> keep, taken;
  for (std::string& e : ch->queued) {
    rdma_ucm_event_resp ev{};
    memcpy(&ev, e.data(), e.size() < sizeof ev ? e.size() : sizeof ev);
    if (!its(ev)) {
      keep.push_back(std::move(e));
      continue;
    }
    CountDown(ch);
    taken.push_back(std::move(e));
  }
  ch->queued.swap(keep);
  return taken;
}

void Cm::Queue(Channel* ch, std::string ev) {
  ch->queued.push_back(std::move(ev));
  const uint64_t one = 1;
  if (::write(ch->queue_fd, &one, sizeof one) < 0) {
    // An eventfd's counter cannot overflow from this many events.
  }
}

bool Cm::Translate(rdma_ucm_event_resp* ev) {
  if (IsGroupEvent(ev->event)) {
    // The kernel names the group by its handle; librdmacm reads only the
    // uid. The shim names the id joined through, whose events these are
    // too (DESTROY_ID counts them, and takes those the shim holds).
    Group* g = GroupByKernel(ev->id);
    if (g == nullptr) return false;  // a group left since
    g->state = ev->event == kCmMulticastJoin ? Join::kJoined : Join::kFailed;
    ev->id = g->vid;
    return true;
  }
  Id* id = ByKernel(ev->id);
  if (ev->event == kCmConnectRequest) {
    // The kernel's new id, under the listener the uid names.
    Id* listener = ByUid(ev->uid);
    if (listener == nullptr) return false;
    Id* child = NewId(listener->channel);
    child->kid = ev->id;
    child->ps = listener->ps;
    child->qp_type = listener->qp_type;
    child->listener = listener->vid;
    child->state = CmState::kRequested;
    ev->id = child->vid;
    return true;
  }
  if (id == nullptr) return false;  // an id destroyed since
  if (id->toward_moving && LogMoves()) {
    char line[160];
    std::snprintf(line, sizeof line, "RDMA CM event %u (status %d) on id %u, whose peer moves",
                  ev->event, static_cast<int>(ev->status), id->vid);
    Log(line);
  }
  // Its kernel id is the move's until the rendezvous replaces it: the
  // source's closing disconnects it (DISCONNECTED), and with a service
  // address that moved its CM then times out (UNREACHABLE, ETIMEDOUT).
  if (id->toward_moving) return false;
  switch (ev->event) {
    case kCmAddrResolved:
      id->state = CmState::kAddrResolved;
      break;
    case kCmAddrError:
      id->state = id->bound_len ? CmState::kBound : CmState::kIdle;
      break;
    case kCmRouteResolved:
      id->state = CmState::kRouteResolved;
      break;
    case kCmRouteError:
      id->state = CmState::kAddrResolved;
      break;
    case kCmConnectResponse:
      id->state = CmState::kResponded;
      break;
    case kCmEstablished:
      id->state = CmState::kEstablished;
      break;
    case kCmConnectError:
    case kCmUnreachable:
    case kCmRejected:
    case kCmDisconnected:
    case kCmTimewaitExit:
      id->state = CmState::kDisconnected;
      break;
    default:
      break;
  }
  ev->id = id->vid;
  return true;
}

// The kernel counts an event for the id it is reported on when it is
// given out (a CONNECT_REQUEST for its listener): what DESTROY_ID answers.
void Cm::Count(const rdma_ucm_event_resp& ev) {
  Id* id = ById(ev.id);
  if (id != nullptr && ev.event == kCmConnectRequest) id = ById(id->listener);
  if (id != nullptr) ++id->events;
  if (IsGroupEvent(ev.event)) {
    Group* g = GroupByUid(ev.uid);
    if (g != nullptr) ++g->events;
  }
}

int Cm::TakeEvent(Channel* ch, std::string* out) {
  if (!ch->queued.empty()) {
    CountDown(ch);
    *out = std::move(ch->queued.front());
    ch->queued.pop_front();
    rdma_ucm_event_resp ev{};
    memcpy(&ev, out->data(), out->size() < sizeof ev ? out->size() : sizeof ev);
    Count(ev);
    return 1;
  }
  while (ch->real >= 0 && KernelHasEvent(ch->real)) {
    rdma_ucm_event_resp ev{};
    rdma_ucm_get_event c{reinterpret_cast<uintptr_t>(&ev)};
    if (Kernel(ch->real, RDMA_USER_CM_CMD_GET_EVENT, &c, sizeof c, sizeof ev) < 0)
      return errno == EAGAIN ? 0 : -1;
    if (!Translate(&ev)) continue;
    Count(ev);
    out->assign(reinterpret_cast<const char*>(&ev), sizeof ev);
    return 1;
  }
  return 0;
}

// GET_EVENT: the kernel's channel is nonblocking, so a blocking one is
// waited for here, in poll(2) on the application's fd, which an event of
// the kernel's or one the shim holds makes readable. A signal ends the
// wait as it would have ended the kernel's (EndsTheRead).
ssize_t Cm::GetEvent(int fd, const rdma_ucm_cmd_hdr& hdr, const char* body, size_t in) {
  const uint64_t resp = As<rdma_ucm_get_event>(body, in).response;
  uint64_t waited = 0;  // the channel's serial, once found
  for (;;) {
    bool gone = false;
    {
      MutexLock l(&mu_);
      auto it = channels_.find(fd);
      if (it == channels_.end() || (waited != 0 && it->second->serial != waited)) {
        if (waited == 0) return Fail(EINVAL);
        gone = true;
      } else {
        waited = it->second->serial;
        std::string ev;
        const int got = TakeEvent(it->second.get(), &ev);
        if (got < 0) return -1;
        if (got > 0) {
          memcpy(UserPtr(resp), ev.data(), hdr.out < ev.size() ? hdr.out : ev.size());
          return 0;
        }
      }
    }
    const uint32_t probes = ThreadProbeTakenHere();
    if (gone) {
      // The program destroyed the channel while this thread waited on it
      // (rping's main thread does, its CM thread still waiting): the
      // kernel's wait holds the file and lasts, as no event comes, until
      // a signal ends it. Before, the wait ended with EINVAL, which rping
      // printed ("rdma_get_cm_event: Invalid argument") and exited with.
      if (poll(nullptr, 0, -1) < 0 && errno == EINTR && EndsTheRead(probes)) return Fail(EINTR);
      continue;
    }
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK)) return Fail(EAGAIN);
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, -1) < 0 && errno == EINTR && EndsTheRead(probes)) return Fail(EINTR);
  }
}

}  // namespace rdmavirt::shim
