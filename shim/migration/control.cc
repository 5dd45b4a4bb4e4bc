#include "shim/migration/control.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "shim/cm/cm.h"
#include "shim/core/log.h"
#include "shim/core/shim.h"
#include "shim/datapath/pause.h"
#include "shim/migration/wire.h"

namespace rdmavirt::shim {
namespace {

// Field numbers of control.proto.
namespace f {
constexpr uint32_t kRequestId = 1;
// ShimToMigrator
constexpr uint32_t kHello = 2, kReply = 3;
// Hello
constexpr uint32_t kVersion = 1, kPid = 2, kEndpointId = 3, kPhase = 4, kProgram = 5;
// Reply
constexpr uint32_t kCode = 1, kMessage = 2, kSummary = 3, kElapsedUs = 4, kDrained = 5,
                   kPagesMarked = 6, kPagesUnchanged = 7, kWritableRegistered = 8;
// EndpointSummary
constexpr uint32_t kSumEndpointId = 1, kSumPid = 2, kSumPhase = 3, kSumSuspended = 4,
                   kSumCounts = 5, kSumQps = 6, kSumMapping = 7, kSumDevice = 8, kSumUdPeers = 10;
// MigratorToShim
constexpr uint32_t kQuiesce = 2, kRelease = 3, kRestore = 4, kResume = 5, kPeerQuiesce = 6,
                   kPeerReconnect = 7, kDescribe = 8;
}  // namespace f

constexpr uint32_t kVersionV1 = 1;
constexpr uint32_t kPhaseRunning = 1, kPhaseReleased = 2;
constexpr uint32_t kDefaultDrainMs = 10000;

WireWriter EncodeMapping(const EndpointView& v) {
  WireWriter m;
  if (v.has_gid) {
    m.Bytes(1, v.virtual_gid.raw, 16);
    m.Bytes(2, v.physical_gid.raw, 16);
  }
  for (const auto& [virt, phys] : v.qpns) {
    WireWriter p;
    p.Varint(1, virt);
    p.Varint(2, phys);
    m.Message(3, p);
  }
  for (const auto& [virt, phys] : v.rkeys) {
    WireWriter p;
    p.Varint(1, virt);
    p.Varint(2, phys);
    m.Message(4, p);
  }
  for (const auto& [qpn, port] : v.cm_rendezvous) {
    WireWriter p;
    p.Varint(1, qpn);
    p.Varint(2, port);
    m.Message(5, p);
  }
  return m;
}

bool IsZero(const ibv_gid& g) {
  for (uint8_t b : g.raw)
    if (b != 0) return false;
  return true;
}

WireWriter EncodeSummary(const EndpointView& v, std::string_view endpoint_id, int pid) {
  WireWriter s;
  s.String(f::kSumEndpointId, endpoint_id);
  s.Int32(f::kSumPid, pid);
  s.Varint(f::kSumPhase, v.released ? kPhaseReleased : kPhaseRunning);
  s.Bool(f::kSumSuspended, v.paused);
  WireWriter c;
  c.Varint(1, v.devices);
  c.Varint(2, v.pds);
  c.Varint(3, v.mrs);
  c.Varint(4, v.cqs);
  c.Varint(5, v.srqs);
  c.Varint(6, v.qps);
  c.Varint(7, v.ahs);
  c.Varint(8, v.registered_bytes);
  c.Varint(9, v.pending_completions);
  s.Message(f::kSumCounts, c);
  for (const QpView& q : v.qp_list) {
    WireWriter w;
    w.Varint(1, q.virtual_qpn);
    w.Varint(2, q.physical_qpn);
    w.Varint(3, q.qp_type);
    w.Varint(4, q.state);
    if (q.connected && !IsZero(q.remote_virtual_gid)) {
      w.Bytes(5, q.remote_virtual_gid.raw, 16);
      w.Varint(6, q.remote_virtual_qpn);
      w.Bytes(7, q.remote_physical_gid.raw, 16);
    }
    w.Varint(8, q.outstanding_recvs);
    w.Varint(9, q.queued_sends);
    s.Message(f::kSumQps, w);
  }
  s.Message(f::kSumMapping, EncodeMapping(v));
  s.String(f::kSumDevice, v.device);
  for (const ibv_gid& g : v.ud_peer_physical_gids) s.Bytes(f::kSumUdPeers, g.raw, 16);
  return s;
}

bool DecodeGid(std::string_view b, ibv_gid* gid) {
  if (b.size() != 16) return false;
  memcpy(gid->raw, b.data(), 16);
  return true;
}

bool DecodePairs(std::string_view b, std::vector<std::pair<uint32_t, uint32_t>>* out) {
  WireReader r(b);
  uint32_t v = 0, p = 0;
  while (r.Next()) {
    if (r.field() == 1 && r.is_varint()) v = static_cast<uint32_t>(r.varint());
    if (r.field() == 2 && r.is_varint()) p = static_cast<uint32_t>(r.varint());
  }
  if (!r.ok()) return false;
  out->emplace_back(v, p);
  return true;
}

bool DecodeMapping(std::string_view b, RemoteMapping* m, std::string* why) {
  WireReader r(b);
  bool vgid = false, pgid = false;
  while (r.Next()) {
    if (!r.is_bytes()) continue;
    switch (r.field()) {
      case 1:
        vgid = DecodeGid(r.bytes(), &m->virtual_gid);
        if (!vgid) return *why = "a mapping's virtual_gid is not 16 bytes", false;
        break;
      case 2:
        pgid = DecodeGid(r.bytes(), &m->physical_gid);
        if (!pgid) return *why = "a mapping's physical_gid is not 16 bytes", false;
        break;
      case 3:
        if (!DecodePairs(r.bytes(), &m->qpns))
          return *why = "a mapping's qpns are malformed", false;
        break;
      case 4:
        if (!DecodePairs(r.bytes(), &m->rkeys))
          return *why = "a mapping's rkeys are malformed", false;
        break;
      case 5:
        if (!DecodePairs(r.bytes(), &m->cm_rendezvous) || m->cm_rendezvous.back().second > 65535)
          return *why = "a mapping's cm_rendezvous is malformed", false;
        break;
    }
  }
  if (!r.ok()) return *why = "a mapping is malformed", false;
  if (!vgid || !pgid) return *why = "a mapping without both GIDs", false;
  return true;
}

// False when `b` is malformed.
bool DrainTimeout(std::string_view b, uint32_t* ms) {
  WireReader r(b);
  *ms = 0;
  while (r.Next())
    if (r.is_varint() && r.field() == 1) *ms = static_cast<uint32_t>(r.varint());
  return r.ok();
}

uint64_t NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
}

}  // namespace

std::string EncodeHello(int pid, std::string_view endpoint_id, bool released,
                        std::string_view program) {
  WireWriter h;
  h.Varint(f::kVersion, kVersionV1);
  h.Int32(f::kPid, pid);
  h.String(f::kEndpointId, endpoint_id);
  h.Varint(f::kPhase, released ? kPhaseReleased : kPhaseRunning);
  h.String(f::kProgram, program);
  WireWriter m;
  m.Message(f::kHello, h);
  return m.data();
}

std::string EncodeReply(uint64_t id, const Status& status, const EndpointView& view,
                        std::string_view endpoint_id, int pid, uint64_t elapsed_us,
                        uint32_t drained_sends, const DirtyCount& pages,
                        const std::vector<std::pair<uintptr_t, uintptr_t>>& writable) {
  WireWriter r;
  r.Int32(f::kCode, static_cast<int32_t>(status.code));
  r.String(f::kMessage, status.message);
  r.Message(f::kSummary, EncodeSummary(view, endpoint_id, pid));
  r.Varint(f::kElapsedUs, elapsed_us);
  r.Varint(f::kDrained, drained_sends);
  r.Varint(f::kPagesMarked, pages.marked);
  r.Varint(f::kPagesUnchanged, pages.unchanged);
  for (const auto& [begin, end] : writable) {
    WireWriter range;
    range.Varint(1, begin);
    range.Varint(2, end);
    r.Message(f::kWritableRegistered, range);
  }
  WireWriter m;
  m.Varint(f::kRequestId, id);
  m.Message(f::kReply, r);
  return m.data();
}

namespace {

// A release's known pages and post-copy flag; false if malformed.
bool DecodeRelease(std::string_view body, ControlRequest* out) {
  WireReader b(body);
  std::string_view addrs, digests;
  while (b.Next()) {
    if (b.field() == 1 && b.is_bytes()) addrs = b.bytes();
    if (b.field() == 2 && b.is_bytes()) digests = b.bytes();
    if (b.field() == 3 && b.is_varint()) out->lock_registered = b.varint() != 0;
  }
  return b.ok() && out->known.Decode(addrs, digests);
}

// A restore's device and peers.
bool DecodeRestore(std::string_view body, ControlRequest* out, std::string* why) {
  WireReader b(body);
  while (b.Next()) {
    if (b.field() == 1 && b.is_bytes()) out->device = std::string(b.bytes());
    if (b.field() == 2 && b.is_bytes()) {
      RemoteMapping m;
      if (!DecodeMapping(b.bytes(), &m, why)) return false;
      out->peers.push_back(std::move(m));
    }
  }
  if (!b.ok()) return *why = "a malformed restore request", false;
  return true;
}

// A peer quiesce's drain timeout and the GID the drain is toward.
bool DecodePeerQuiesce(std::string_view body, ControlRequest* out, std::string* why) {
  WireReader b(body);
  while (b.Next()) {
    if (b.field() == 2 && b.is_varint()) out->drain_timeout_ms = static_cast<uint32_t>(b.varint());
    if (b.field() == 1 && b.is_bytes()) {
      if (b.bytes().size() != 16) return *why = "peer_quiesce: a GID is 16 bytes", false;
      memcpy(out->toward.raw, b.bytes().data(), 16);
      out->has_toward = true;
    }
  }
  if (!b.ok()) return *why = "a malformed peer_quiesce request", false;
  return true;
}

// A peer reconnect's mappings, the first one first, and keep_paused.
bool DecodePeerReconnect(std::string_view body, ControlRequest* out, std::string* why) {
  WireReader b(body);
  bool have = false;
  std::vector<RemoteMapping> more;
  while (b.Next()) {
    if ((b.field() == 1 || b.field() == 2) && b.is_bytes()) {
      if (b.field() == 1 && have)
        return *why = "a peer_reconnect request with two first mappings", false;
      RemoteMapping m;
      if (!DecodeMapping(b.bytes(), &m, why)) return false;
      (b.field() == 1 ? out->peers : more).push_back(std::move(m));
      have = have || b.field() == 1;
    }
    if (b.field() == 3 && b.is_varint()) out->keep_paused = b.varint() != 0;
  }
  for (RemoteMapping& m : more) out->peers.push_back(std::move(m));
  if (!b.ok() || !have) return *why = "a peer_reconnect request without a mapping", false;
  return true;
}

}  // namespace

bool DecodeRequest(std::string_view message, ControlRequest* out, std::string* why) {
  *out = ControlRequest{};
  WireReader r(message);
  using Kind = ControlRequest::Kind;
  while (r.Next()) {
    if (r.field() == f::kRequestId && r.is_varint()) {
      out->id = r.varint();
      continue;
    }
    if (!r.is_bytes()) continue;
    const std::string_view body = r.bytes();
    // One command, as protobuf writes a oneof: a second one (which protobuf
    // would merge into the first, or let replace it) is refused, not mixed
    // with what the first left behind (its peers, its drain timeout).
    if (r.field() >= f::kQuiesce && r.field() <= f::kDescribe && out->kind != Kind::kNone)
      return *why = "a request with more than one command", false;
    switch (r.field()) {
      case f::kQuiesce:
        out->kind = Kind::kQuiesce;
        if (!DrainTimeout(body, &out->drain_timeout_ms))
          return *why = "a malformed quiesce request", false;
        break;
      case f::kRelease:
        out->kind = Kind::kRelease;
        if (!DecodeRelease(body, out))
          return *why = "a malformed release request (its known pages)", false;
        break;
      case f::kRestore:
        out->kind = Kind::kRestore;
        if (!DecodeRestore(body, out, why)) return false;
        break;
      case f::kResume:
        out->kind = Kind::kResume;
        break;
      case f::kPeerQuiesce:
        out->kind = Kind::kPeerQuiesce;
        if (!DecodePeerQuiesce(body, out, why)) return false;
        break;
      case f::kPeerReconnect:
        out->kind = Kind::kPeerReconnect;
        if (!DecodePeerReconnect(body, out, why)) return false;
        break;
      case f::kDescribe:
        out->kind = Kind::kDescribe;
        break;
    }
  }
  if (!r.ok()) return *why = "a malformed request", false;
  if (out->id == 0) return *why = "a request without an id", false;
  if (out->kind == Kind::kNone) return *why = "a request without a known command", false;
  return true;
}

std::string Execute(Shim* shim, const ControlRequest& req, std::string_view endpoint_id, int pid,
                    bool* released) {
  using Kind = ControlRequest::Kind;
  Cm* cm = Cm::Process();
  const uint64_t start = NowUs();
  const uint32_t drain = req.drain_timeout_ms ? req.drain_timeout_ms : kDefaultDrainMs;
  uint32_t drained = 0;
  DirtyCount pages;
  std::vector<std::pair<uintptr_t, uintptr_t>> writable;
  Status st;
  switch (req.kind) {
    case Kind::kQuiesce:
      st = cm->CheckMovable();
      if (st.ok()) st = shim->Quiesce(drain, &drained);
      if (st.ok()) writable = shim->WritableRegistered();
      break;
    case Kind::kPeerQuiesce:
      st = shim->Quiesce(drain, &drained, req.has_toward ? &req.toward : nullptr);
      if (st.ok() && req.has_toward) cm->MarkToward(req.toward, shim->Describe().qp_list);
      break;
    case Kind::kRelease:
      st = shim->Release(req.known, &pages, req.lock_registered);
      if (st.ok()) st = cm->Release();
      break;
    case Kind::kRestore:
      st = shim->Restore(req.device, req.peers);
      if (st.ok()) st = cm->Restore(shim->Describe().qp_list);
      break;
    case Kind::kResume:
      // The moved connections' peers have reconnected their QPs, and
      // connect to the rendezvous now if they have not yet.
      st = cm->Resume();
      if (st.ok()) st = shim->Resume();
      break;
    case Kind::kPeerReconnect:
      st = shim->PeerReconnect(req.peers, req.keep_paused);
      if (st.ok()) st = cm->PeerReconnect(req.peers, shim->Describe().qp_list);
      break;
    case Kind::kDescribe:
    case Kind::kNone:
      break;
  }
  EndpointView view = shim->Describe();
  for (const CmRendezvous& r : cm->Rendezvous())
    view.cm_rendezvous.emplace_back(r.virtual_qpn, r.port);
  view.cm_ids = static_cast<uint32_t>(cm->ids());
  *released = view.released;
  return EncodeReply(req.id, st, view, endpoint_id, pid, NowUs() - start, drained, pages, writable);
}

// ---------------------------------------------------------------- thread

namespace {

struct ControlThread {
  Shim* shim = nullptr;
  std::string socket_path;
  std::string resume_dir;
  std::string endpoint_id;
  std::atomic<int> fd{-1};
};

ControlThread* g_control = nullptr;

std::string SocketPath() {
  const char* p = getenv("RDMAVIRT_SOCKET");
  return p != nullptr && *p != '\0' ? p : kDefaultSocket;
}

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool SendFrame(int fd, const std::string& msg) {
  const uint32_t n = static_cast<uint32_t>(msg.size());
  const uint8_t len[4] = {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8),
                          static_cast<uint8_t>(n >> 16), static_cast<uint8_t>(n >> 24)};
  return WriteAll(fd, len, 4) && WriteAll(fd, msg.data(), msg.size());
}

bool ReadFrame(int fd, std::string* msg) {
  uint8_t len[4];
  if (!ReadAll(fd, len, 4)) return false;
  const uint32_t n = len[0] | len[1] << 8 | len[2] << 16 | uint32_t{len[3]} << 24;
  if (n > kMaxFrame) return false;
  msg->resize(n);
  return n == 0 || ReadAll(fd, msg->data(), n);
}

int Connect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    close(fd);
    return -1;
  }
  memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string Program() {
  char comm[64] = {};
  const int fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    const ssize_t n = read(fd, comm, sizeof(comm) - 1);
    close(fd);
    if (n > 0 && comm[n - 1] == '\n') comm[n - 1] = '\0';
  }
  return comm;
}

std::string RandomId() {
  uint8_t b[16];
  if (getrandom(b, sizeof(b), 0) != static_cast<ssize_t>(sizeof(b))) {
    const uint64_t t = NowUs() ^ static_cast<uint64_t>(getpid()) << 32;
    memcpy(b, &t, 8);
    memcpy(b + 8, &t, 8);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  for (uint8_t x : b) {
    s.push_back(kHex[x >> 4]);
    s.push_back(kHex[x & 15]);
  }
  return s;
}

// The name of this process's resume marker: its pid namespace's inode and
// its pid there ("4026531836-1234"), which the migrator reads from
// /proc/PID of its own view (ResumeMarkerName in shim_server.cc). A pid
// alone would not do: a process in a container of its own is pid 1 there,
// as is every other container's first process; and a container's restore
// makes a new namespace, so it is read again each time.
std::string ResumeMarkerName() {
  char link[64];
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  std::string inode;
  for (ssize_t i = 0; i < std::max<ssize_t>(n, 0); ++i)
    if (link[i] >= '0' && link[i] <= '9') inode.push_back(link[i]);
  return (inode.empty() ? std::string("0") : inode) + "-" + std::to_string(getpid());
}

// Released: no fd may stay open while CRIU dumps the process. Wait for the
// migrator's marker with readlink() and stat() only.
void WaitForResume(const ControlThread& c) {
  for (;;) {
    const std::string marker = c.resume_dir + "/" + ResumeMarkerName();
    struct stat st;
    if (stat(marker.c_str(), &st) == 0) return;
    usleep(10000);
  }
}

// CRIU restores a process that did not lead its session (a shell's child,
// a supervisor's, an MPI daemon's rank) into the session and process group
// of the restorer: the host's migrator. Its own session and group, as a
// daemon's, keep the migrator's signals and terminal away from it. A
// process that leads its own group cannot start a session (setsid: EPERM)
// and needs none: the migrator's group signals do not reach it. A process
// that held a terminal was restored in a session made for it, whose
// controlling terminal is its standard input (rdmavirt-terminal): it stays
// there, in that terminal's foreground group.
void LeaveTheRestorersSession() {
  if (getsid(0) == getpid() || getpgrp() == getpid()) return;
  pid_t terminal_session = 0;
  if (ioctl(0, TIOCGSID, &terminal_session) == 0 && terminal_session == getsid(0)) return;
  if (setsid() < 0)
    Log(("control: setsid after a restore: " + std::string(strerror(errno))).c_str());
}

void Serve(ControlThread* c, bool* released) {
  const int fd = c->fd.load();
  if (!SendFrame(fd, EncodeHello(getpid(), c->endpoint_id, *released, Program()))) return;
  std::string msg;
  while (ReadFrame(fd, &msg)) {
    ControlRequest req;
    std::string why;
    if (!DecodeRequest(msg, &req, &why)) {
      Log(("control: " + why + "; closing the connection").c_str());
      return;
    }
    const std::string reply = Execute(c->shim, req, c->endpoint_id, getpid(), released);
    if (req.kind == ControlRequest::Kind::kRestore && !*released) LeaveTheRestorersSession();
    if (!SendFrame(fd, reply)) return;
    if (req.kind == ControlRequest::Kind::kRelease && *released) return;
  }
}

void* Run(void* arg) {
  ControlThread* c = static_cast<ControlThread*>(arg);
  bool released = false;
  for (;;) {
    const int fd = Connect(c->socket_path);
    if (fd < 0) {
      sleep(1);
      continue;
    }
    c->fd.store(fd);
    Serve(c, &released);
    c->fd.store(-1);
    close(fd);
    if (released)
      WaitForResume(*c);
    else
      sleep(1);
  }
  return nullptr;
}

void InChild() {
  // The thread did not come along; its socket did.
  if (g_control != nullptr) {
    const int fd = g_control->fd.exchange(-1);
    if (fd >= 0) close(fd);
  }
}

}  // namespace

bool MigrationEnabled() {
  const char* m = getenv("RDMAVIRT_MIGRATE");
  if (m != nullptr && strcmp(m, "0") == 0) return false;
  // Whether a migrator runs now does not matter: the control thread
  // connects whenever one is there (at start, later, after a restart).
  // The pause needs the kernel's asymmetric fence (pause.h).
  if (!AsymmetricFenceAvailable()) {
    LogOnce("membarrier(2) private expedited is unavailable: this process cannot be migrated");
    return false;
  }
  return true;
}

void StartControl(Shim* shim) {
  static std::atomic<bool> started{false};
  if (started.exchange(true)) return;
  ControlThread* c = new (std::nothrow) ControlThread;
  if (c == nullptr) return;
  c->shim = shim;
  c->socket_path = SocketPath();
  const size_t slash = c->socket_path.rfind('/');
  c->resume_dir =
      (slash == std::string::npos ? std::string(".") : c->socket_path.substr(0, slash)) + "/resume";
  c->endpoint_id = RandomId();
  g_control = c;
  pthread_atfork(nullptr, nullptr, InChild);
  // Every signal blocked in the thread: the application's handlers run on
  // its own threads, as without the shim.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  if (pthread_create(&t, &attr, Run, c) != 0) LogOnce("cannot start the control thread");
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

}  // namespace rdmavirt::shim
