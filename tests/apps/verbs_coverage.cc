// verbs_coverage: a plain libibverbs program that walks a fixed scenario
// between two hosts and prints a transcript free of physical identities.
//
// Why it exists: the rdmavirt shim must be invisible to applications. Running
// this program once natively and once with the shim preloaded must give the
// same transcript byte for byte, so the transcript shows relations ("src_qp ==
// peer qp_num: yes"), status names, opcodes, lengths, chosen immediates and
// checksums of deterministic payloads, never QP numbers, keys, GIDs, addresses
// or PSNs.
//
// Usage: verbs_coverage [--port P] [--dev rxe0] [--gid-idx 1] [SERVER_HOST]
// Without SERVER_HOST it is the server (listens on TCP P), with it the client.
// Both sides exchange QPNs, PSNs, GIDs, addresses and rkeys over that TCP
// socket (like ibv_rc_pingpong) and use small TCP messages as barriers, so
// the whole run is lockstep and deterministic. Exit status 0 means every check
// passed; the first failed check is reported on stderr and exits 1.
//
// The client is the requester in every phase and the server the responder,
// with one reply per phase in the other direction: fixed roles keep the order
// of completions on every CQ deterministic.
//
// Depends only on libibverbs and POSIX sockets, single-threaded.

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

// ---------------------------------------------------------------------------
// Constants of the scenario.

constexpr int kDefaultTcpPort = 18700;
constexpr uint8_t kIbPort = 1;
constexpr int kCqDepth = 64;
constexpr auto kCqDeadline = std::chrono::seconds(20);
constexpr int kEventTimeoutMs = 20000;
// Longer than kCqDeadline: a peer stuck polling a CQ fails on its own first.
constexpr int kTcpTimeoutS = 30;
constexpr int kConnectRetryS = 30;
constexpr uint32_t kQkey = 0x11111111;
// An lkey/rkey no MR has: rxe keys are (index << 8 | key) with index below
// max_mr, and a shim's virtual keys are dense, so this is invalid for both.
constexpr uint32_t kBadKey = 0xdead0badu;
constexpr uint32_t kScenarioVersion = 1;

// Layout of the per-phase buffer (offsets multiple of 8 for atomics).
constexpr size_t kBufSize = 8192;
constexpr size_t kSlot = 512;     // receive slots [0, 8 * kSlot)
constexpr size_t kSrcOff = 4096;  // local source of sends and writes
constexpr size_t kSrcLen = 1024;
constexpr size_t kRdmaOff = 5120;       // target of the peer's RDMA writes
constexpr size_t kReadSrcOff = 6144;    // read by the peer's RDMA reads
constexpr size_t kReadDstOff = 6656;    // local destination of RDMA reads
constexpr size_t kAtomicOff = 7168;     // the peer's atomics hit this word
constexpr size_t kAtomicResOff = 7424;  // three local result words
static_assert(kAtomicOff % 8 == 0 && kAtomicResOff % 8 == 0);
static_assert(kSrcOff + kSrcLen <= kRdmaOff && kAtomicResOff + 24 <= kBufSize);

// UD receive slots hold the 40-byte GRH area before the payload.
constexpr size_t kGrhLen = 40;
constexpr size_t kUdSlot = 1024;

constexpr uint64_t kAtomicInit = 0x1000000000000005ull;
constexpr uint64_t kAtomicAdd = 0x11;
constexpr uint64_t kAtomicSwap = 0x00abcdef00abcdefull;

constexpr int kRcAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

// ---------------------------------------------------------------------------
// Failure reporting and the transcript.

int g_checks = 0;
bool g_destroy_failed = false;

std::string Format(const char* fmt, va_list ap) {
  va_list copy;
  va_copy(copy, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? n : 0, '\0');
  std::vsnprintf(out.data(), out.size() + 1, fmt, ap);
  return out;
}

std::string Sprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Sprintf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = Format(fmt, ap);
  va_end(ap);
  return s;
}

// A test program, not a library: on the first failed check it exits, and the
// kernel releases every verbs resource with the process.
[[noreturn]] void Die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void Die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const std::string msg = Format(fmt, ap);
  va_end(ap);
  std::fflush(stdout);
  std::fprintf(stderr, "verbs_coverage: FAIL: %s\n", msg.c_str());
  std::exit(1);
}

// One transcript line per checked thing.
void Line(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Line(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const std::string msg = Format(fmt, ap);
  va_end(ap);
  std::printf("%s\n", msg.c_str());
  ++g_checks;
}

// Checks `ok`, then records `what` in the transcript.
void Check(bool ok, const std::string& what) {
  if (!ok) Die("%s", what.c_str());
  Line("%s", what.c_str());
}

const char* YesNo(bool b) { return b ? "yes" : "no"; }

std::string ErrnoName(int err) {
  switch (err) {
    case 0:
      return "0";
    case EINVAL:
      return "EINVAL";
    case EOPNOTSUPP:
      return "EOPNOTSUPP";
    case ENOSYS:
      return "ENOSYS";
    case ENOMEM:
      return "ENOMEM";
    case EPERM:
      return "EPERM";
    case EACCES:
      return "EACCES";
    case ENOENT:
      return "ENOENT";
    case EAGAIN:
      return "EAGAIN";
    case EBUSY:
      return "EBUSY";
    case EFAULT:
      return "EFAULT";
    case ENOSPC:
      return "ENOSPC";
    default:
      return Sprintf("errno%d", err);
  }
}

// ---------------------------------------------------------------------------
// RAII owners for verbs objects. A destroy failure means a leak or a wrong
// teardown order: it is reported and fails the run at exit.

void ReportDestroyFailure(const char* what, int rc) {
  std::fprintf(stderr, "verbs_coverage: FAIL: %s returned %d (errno %s)\n", what, rc,
               ErrnoName(errno).c_str());
  g_destroy_failed = true;
}

template <auto kDestroy>
struct Destroyer {
  template <typename T>
  void operator()(T* p) const {
    if (const int rc = kDestroy(p); rc != 0) ReportDestroyFailure("destroy", rc);
  }
};

struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};
struct CqExDeleter {
  void operator()(ibv_cq_ex* cq) const {
    if (const int rc = ibv_destroy_cq(ibv_cq_ex_to_cq(cq)); rc != 0) {
      ReportDestroyFailure("ibv_destroy_cq(cq_ex)", rc);
    }
  }
};

using DeviceList = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using Context = std::unique_ptr<ibv_context, Destroyer<&ibv_close_device>>;
using Pd = std::unique_ptr<ibv_pd, Destroyer<&ibv_dealloc_pd>>;
using Mr = std::unique_ptr<ibv_mr, Destroyer<&ibv_dereg_mr>>;
using Cq = std::unique_ptr<ibv_cq, Destroyer<&ibv_destroy_cq>>;
using CqEx = std::unique_ptr<ibv_cq_ex, CqExDeleter>;
using Qp = std::unique_ptr<ibv_qp, Destroyer<&ibv_destroy_qp>>;
using Srq = std::unique_ptr<ibv_srq, Destroyer<&ibv_destroy_srq>>;
using Ah = std::unique_ptr<ibv_ah, Destroyer<&ibv_destroy_ah>>;
using CompChannel = std::unique_ptr<ibv_comp_channel, Destroyer<&ibv_destroy_comp_channel>>;

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }
  int get() const { return fd_; }

 private:
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
};

// ---------------------------------------------------------------------------
// Out-of-band channel: one TCP connection, blocking with timeouts.

// What one side tells the other about a QP and its buffer. Both ends run this
// same binary on the same architecture, so host byte order is shared.
struct WireEndpoint {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint32_t rkey = 0;
  uint32_t version = kScenarioVersion;
  uint64_t addr = 0;
  uint8_t gid[16] = {};
};
static_assert(std::is_trivially_copyable_v<WireEndpoint>);
static_assert(sizeof(WireEndpoint) == 40);

class Oob {
 public:
  static Oob Listen(int port) {
    UniqueFd ls(socket(AF_INET, SOCK_STREAM, 0));
    if (ls.get() < 0) Die("socket: %s", std::strerror(errno));
    const int one = 1;
    setsockopt(ls.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (bind(ls.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      Die("bind TCP port %d: %s", port, std::strerror(errno));
    }
    if (listen(ls.get(), 1) != 0) Die("listen: %s", std::strerror(errno));
    pollfd pfd{ls.get(), POLLIN, 0};
    const int ready = poll(&pfd, 1, 2 * kConnectRetryS * 1000);
    if (ready <= 0) Die("no client connected within %d s", 2 * kConnectRetryS);
    UniqueFd fd(accept(ls.get(), nullptr, nullptr));
    if (fd.get() < 0) Die("accept: %s", std::strerror(errno));
    return Oob(std::move(fd));
  }

  // The server may start after the client: retry until kConnectRetryS.
  static Oob Connect(const std::string& host, int port) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kConnectRetryS);
    const std::string service = std::to_string(port);
    std::string last_error = "no address";
    while (std::chrono::steady_clock::now() < deadline) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      const int gai = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
      if (gai != 0) {
        last_error = gai_strerror(gai);
      } else {
        for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
          UniqueFd fd(socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
          if (fd.get() < 0) continue;
          if (connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) {
            freeaddrinfo(res);
            return Oob(std::move(fd));
          }
          last_error = std::strerror(errno);
        }
        freeaddrinfo(res);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    Die("cannot connect to %s:%d: %s", host.c_str(), port, last_error.c_str());
  }

  void SendAll(const void* data, size_t len) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (len > 0) {
      const ssize_t n = send(fd_.get(), p, len, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) Die("TCP send to peer: %s", std::strerror(errno));
      p += n;
      len -= static_cast<size_t>(n);
    }
  }

  void RecvAll(void* data, size_t len) {
    auto* p = static_cast<uint8_t*>(data);
    while (len > 0) {
      const ssize_t n = recv(fd_.get(), p, len, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) Die("peer closed the TCP connection (did it fail?)");
      if (n < 0) Die("TCP receive from peer: %s", std::strerror(errno));
      p += n;
      len -= static_cast<size_t>(n);
    }
  }

  // Both sides send first, then receive: the messages are far smaller than
  // the socket buffers, so this cannot deadlock.
  template <typename T>
  T Exchange(const T& mine) {
    static_assert(std::is_trivially_copyable_v<T>);
    SendAll(&mine, sizeof(T));
    T theirs;
    RecvAll(&theirs, sizeof(T));
    return theirs;
  }

  // Lockstep point between phases; the tag catches a desynchronized peer.
  void Barrier(std::string_view tag) {
    char mine[32] = {};
    std::memcpy(mine, tag.data(), std::min(tag.size(), sizeof(mine) - 1));
    char theirs[32];
    SendAll(mine, sizeof(mine));
    RecvAll(theirs, sizeof(theirs));
    if (std::memcmp(mine, theirs, sizeof(mine)) != 0) {
      theirs[sizeof(theirs) - 1] = '\0';
      Die("barrier mismatch: here '%s', peer '%s'", mine, theirs);
    }
  }

 private:
  explicit Oob(UniqueFd fd) : fd_(std::move(fd)) {
    timeval tv{};
    tv.tv_sec = kTcpTimeoutS;
    setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd_.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    const int one = 1;
    setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  UniqueFd fd_;
};

// ---------------------------------------------------------------------------
// Deterministic payloads.

uint8_t PatternByte(uint32_t seed, size_t i) {
  uint32_t x = seed * 2654435761u + static_cast<uint32_t>(i) * 40503u;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<uint8_t>(x);
}

void Fill(uint8_t* p, size_t len, uint32_t seed) {
  for (size_t i = 0; i < len; ++i) p[i] = PatternByte(seed, i);
}

struct Slice {
  size_t off;
  uint32_t len;
};

// The bytes a gather of `slices` out of a buffer filled with `seed` yields.
std::vector<uint8_t> Expected(uint32_t seed, std::initializer_list<Slice> slices) {
  std::vector<uint8_t> out;
  for (const Slice& s : slices) {
    for (size_t i = 0; i < s.len; ++i) out.push_back(PatternByte(seed, s.off + i));
  }
  return out;
}

uint32_t Fnv1a(const uint8_t* p, size_t len) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < len; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

void CheckBytes(const std::string& label, const uint8_t* actual,
                const std::vector<uint8_t>& expected) {
  for (size_t i = 0; i < expected.size(); ++i) {
    if (actual[i] != expected[i]) {
      Die("%s: byte %zu is 0x%02x, expected 0x%02x", label.c_str(), i, actual[i], expected[i]);
    }
  }
  Line("%s: %zu bytes match, fnv1a=0x%08x", label.c_str(), expected.size(),
       Fnv1a(actual, expected.size()));
}

void CheckU64(const std::string& label, uint64_t actual, uint64_t expected) {
  if (actual != expected) {
    Die("%s: 0x%016llx, expected 0x%016llx", label.c_str(), static_cast<unsigned long long>(actual),
        static_cast<unsigned long long>(expected));
  }
  Line("%s: 0x%016llx", label.c_str(), static_cast<unsigned long long>(actual));
}

// ---------------------------------------------------------------------------
// Names for the transcript.

const char* WcOpcodeName(ibv_wc_opcode op) {
  switch (op) {
    case IBV_WC_SEND:
      return "SEND";
    case IBV_WC_RDMA_WRITE:
      return "RDMA_WRITE";
    case IBV_WC_RDMA_READ:
      return "RDMA_READ";
    case IBV_WC_COMP_SWAP:
      return "COMP_SWAP";
    case IBV_WC_FETCH_ADD:
      return "FETCH_ADD";
    case IBV_WC_BIND_MW:
      return "BIND_MW";
    case IBV_WC_LOCAL_INV:
      return "LOCAL_INV";
    case IBV_WC_TSO:
      return "TSO";
    case IBV_WC_RECV:
      return "RECV";
    case IBV_WC_RECV_RDMA_WITH_IMM:
      return "RECV_RDMA_WITH_IMM";
    default:
      return "OTHER";
  }
}

std::string WcFlagsName(unsigned flags) {
  static constexpr struct {
    unsigned bit;
    const char* name;
  } kNames[] = {{IBV_WC_GRH, "GRH"},
                {IBV_WC_WITH_IMM, "WITH_IMM"},
                {IBV_WC_IP_CSUM_OK, "IP_CSUM_OK"},
                {IBV_WC_WITH_INV, "WITH_INV"},
                {IBV_WC_TM_SYNC_REQ, "TM_SYNC_REQ"},
                {IBV_WC_TM_MATCH, "TM_MATCH"},
                {IBV_WC_TM_DATA_VALID, "TM_DATA_VALID"}};
  std::string out;
  for (const auto& n : kNames) {
    if (flags & n.bit) {
      out += out.empty() ? "" : "|";
      out += n.name;
      flags &= ~n.bit;
    }
  }
  if (flags != 0) out += Sprintf("%s0x%x", out.empty() ? "" : "|", flags);
  return out.empty() ? "none" : out;
}

const char* QpStateName(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET:
      return "RESET";
    case IBV_QPS_INIT:
      return "INIT";
    case IBV_QPS_RTR:
      return "RTR";
    case IBV_QPS_RTS:
      return "RTS";
    case IBV_QPS_SQD:
      return "SQD";
    case IBV_QPS_SQE:
      return "SQE";
    case IBV_QPS_ERR:
      return "ERR";
    default:
      return "UNKNOWN";
  }
}

const char* ReregResultName(int rc) {
  switch (rc) {
    case 0:
      return "ok";
    case IBV_REREG_MR_ERR_INPUT:
      return "IBV_REREG_MR_ERR_INPUT";
    case IBV_REREG_MR_ERR_DONT_FORK_NEW:
      return "IBV_REREG_MR_ERR_DONT_FORK_NEW";
    case IBV_REREG_MR_ERR_DO_FORK_OLD:
      return "IBV_REREG_MR_ERR_DO_FORK_OLD";
    case IBV_REREG_MR_ERR_CMD:
      return "IBV_REREG_MR_ERR_CMD";
    case IBV_REREG_MR_ERR_CMD_AND_DO_FORK_NEW:
      return "IBV_REREG_MR_ERR_CMD_AND_DO_FORK_NEW";
    default:
      return "unknown";
  }
}

const char* GidTypeName(uint32_t t) {
  switch (t) {
    case IBV_GID_TYPE_IB:
      return "IB";
    case IBV_GID_TYPE_ROCE_V1:
      return "ROCE_V1";
    case IBV_GID_TYPE_ROCE_V2:
      return "ROCE_V2";
    default:
      return "UNKNOWN";
  }
}

// How a number the peer can see relates to the ones exchanged out of band.
const char* Relation(uint32_t value, uint32_t own, uint32_t peer) {
  if (value == peer) return "peer";
  if (value == own) return "own";
  if (value == 0) return "zero";
  return "other";
}

bool SameGid(const ibv_gid& a, const uint8_t (&b)[16]) { return std::memcmp(a.raw, b, 16) == 0; }
bool SameGid(const ibv_gid& a, const ibv_gid& b) { return std::memcmp(a.raw, b.raw, 16) == 0; }

// ---------------------------------------------------------------------------
// Verbs environment and helpers.

struct Options {
  int tcp_port = kDefaultTcpPort;
  std::string dev = "rxe0";
  int gid_idx = 1;
  std::string server_host;  // empty: this is the server
};

// Per-process verbs state shared by all phases. Member order is destruction
// order in reverse: the PD goes before the context.
struct Env {
  Options opt;
  bool server = false;
  Context ctx;
  Pd pd;
  ibv_port_attr port{};
  ibv_gid gid{};
  std::mt19937 rng;
};

class Buffer {
 public:
  Buffer(ibv_pd* pd, size_t size, int access)
      : size_(size), mem_(static_cast<uint8_t*>(std::aligned_alloc(4096, size))) {
    if (!mem_) Die("aligned_alloc(%zu) failed", size);
    std::memset(mem_.get(), 0, size);
    mr_.reset(ibv_reg_mr(pd, mem_.get(), size, access));
    if (!mr_) Die("ibv_reg_mr: %s", std::strerror(errno));
  }
  uint8_t* at(size_t off) { return mem_.get() + off; }
  uint64_t addr(size_t off) const { return reinterpret_cast<uintptr_t>(mem_.get()) + off; }
  ibv_mr* mr() const { return mr_.get(); }
  ibv_sge Sge(size_t off, uint32_t len) const {
    ibv_sge sge{};
    sge.addr = addr(off);
    sge.length = len;
    sge.lkey = mr_->lkey;
    return sge;
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  size_t size_;
  std::unique_ptr<uint8_t, Free> mem_;
  Mr mr_;  // after mem_: deregistered before the memory is freed
};

uint32_t NewPsn(Env& env) { return env.rng() & 0xffffff; }

Cq CreateCq(Env& env, ibv_comp_channel* channel = nullptr, void* cq_context = nullptr) {
  Cq cq(ibv_create_cq(env.ctx.get(), kCqDepth, cq_context, channel, 0));
  if (!cq) Die("ibv_create_cq: %s", std::strerror(errno));
  return cq;
}

ibv_qp_init_attr RcInitAttr(ibv_cq* scq, ibv_cq* rcq, ibv_srq* srq) {
  ibv_qp_init_attr attr{};
  attr.send_cq = scq;
  attr.recv_cq = rcq;
  attr.srq = srq;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 0;
  attr.cap.max_send_wr = 16;
  attr.cap.max_recv_wr = srq ? 0 : 16;
  attr.cap.max_send_sge = 4;
  attr.cap.max_recv_sge = srq ? 0 : 4;
  attr.cap.max_inline_data = 128;
  return attr;
}

void ModifyQp(ibv_qp* qp, ibv_qp_attr& attr, int mask, const char* step) {
  if (const int rc = ibv_modify_qp(qp, &attr, mask); rc != 0) {
    Die("ibv_modify_qp(%s): %s", step, std::strerror(rc));
  }
}

// RESET -> INIT: receives may be posted from INIT on, not in RESET.
void InitRc(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = kIbPort;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  ModifyQp(qp, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
}

// An RC QP in INIT.
Qp CreateRcQp(Env& env, ibv_cq* scq, ibv_cq* rcq, ibv_srq* srq = nullptr) {
  ibv_qp_init_attr attr = RcInitAttr(scq, rcq, srq);
  Qp qp(ibv_create_qp(env.pd.get(), &attr));
  if (!qp) Die("ibv_create_qp(RC): %s", std::strerror(errno));
  InitRc(qp.get());
  return qp;
}

ibv_mtu PathMtu(const Env& env) {
  return env.port.active_mtu < IBV_MTU_1024 ? env.port.active_mtu : IBV_MTU_1024;
}

// INIT -> RTR -> RTS against the peer's advertised endpoint.
void ConnectRc(Env& env, ibv_qp* qp, uint32_t my_psn, const WireEndpoint& peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = PathMtu(env);
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = 4;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
  a.ah_attr.grh.sgid_index = static_cast<uint8_t>(env.opt.gid_idx);
  a.ah_attr.grh.hop_limit = 64;
  a.ah_attr.port_num = kIbPort;
  ModifyQp(qp, a,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
           "RTR");

  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = my_psn;
  a.max_rd_atomic = 4;
  ModifyQp(qp, a,
           IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
               IBV_QP_MAX_QP_RD_ATOMIC,
           "RTS");
}

WireEndpoint Describe(const Env& env, const ibv_qp* qp, uint32_t psn, const Buffer* buf) {
  WireEndpoint w;
  w.qpn = qp ? qp->qp_num : 0;
  w.psn = psn;
  if (buf != nullptr) {
    w.addr = buf->addr(0);
    w.rkey = buf->mr()->rkey;
  }
  std::memcpy(w.gid, env.gid.raw, 16);
  return w;
}

// Exchanges endpoints, connects, and waits until both QPs are in RTS.
WireEndpoint ExchangeAndConnect(Env& env, Oob& oob, ibv_qp* qp, uint32_t psn, const Buffer* buf,
                                std::string_view tag) {
  const WireEndpoint peer = oob.Exchange(Describe(env, qp, psn, buf));
  if (peer.version != kScenarioVersion) Die("peer runs another scenario");
  ConnectRc(env, qp, psn, peer);
  oob.Barrier(tag);
  return peer;
}

void PostSendChain(ibv_qp* qp, std::vector<ibv_send_wr>& wrs, const char* what) {
  for (size_t i = 0; i + 1 < wrs.size(); ++i) wrs[i].next = &wrs[i + 1];
  wrs.back().next = nullptr;
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(qp, wrs.data(), &bad); rc != 0) {
    Die("ibv_post_send(%s): %s", what, std::strerror(rc));
  }
}

void PostRecv(ibv_qp* qp, uint64_t wr_id, std::vector<ibv_sge> sges) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  ibv_recv_wr* bad = nullptr;
  if (const int rc = ibv_post_recv(qp, &wr, &bad); rc != 0) {
    Die("ibv_post_recv(0x%llx): %s", static_cast<unsigned long long>(wr_id), std::strerror(rc));
  }
}

ibv_send_wr SendWr(uint64_t wr_id, ibv_wr_opcode op, ibv_sge* sge, int nsge,
                   unsigned flags = IBV_SEND_SIGNALED) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sge;
  wr.num_sge = nsge;
  wr.send_flags = flags;
  return wr;
}

// Polls exactly `n` completions, failing after kCqDeadline.
std::vector<ibv_wc> PollCq(ibv_cq* cq, int n, const char* what) {
  std::vector<ibv_wc> wcs(n);
  int got = 0;
  const auto deadline = std::chrono::steady_clock::now() + kCqDeadline;
  while (got < n) {
    const int rc = ibv_poll_cq(cq, n - got, wcs.data() + got);
    if (rc < 0) Die("ibv_poll_cq(%s) returned %d", what, rc);
    got += rc;
    if (got < n && std::chrono::steady_clock::now() > deadline) {
      Die("%s: %d of %d completions after %lld s", what, got, n,
          static_cast<long long>(kCqDeadline.count()));
    }
  }
  return wcs;
}

void CheckCqEmpty(ibv_cq* cq, const std::string& label) {
  ibv_wc wc{};
  const int rc = ibv_poll_cq(cq, 1, &wc);
  Check(rc == 0, Sprintf("%s: no further completion: %s", label.c_str(), YesNo(rc == 0)));
}

// What a completion must look like.
struct Expect {
  uint64_t wr_id = 0;
  ibv_wc_opcode opcode = IBV_WC_SEND;
  uint32_t byte_len = 0;
  bool recv = false;            // receive completion
  std::optional<uint32_t> imm;  // receive: immediate (host order)
  // receive: GRH flag required (UD). Unset: only recorded, since RoCE
  // providers may flag the network header on RC receives too (rxe does).
  std::optional<bool> grh;
  bool src_qp_is_peer = false;  // receive: src_qp must be the peer's qpn
  // nullopt: any error status, recorded in the transcript.
  std::optional<ibv_wc_status> status = IBV_WC_SUCCESS;
};

Expect SendDone(uint64_t wr_id, ibv_wc_opcode op, uint32_t len) {
  Expect e;
  e.wr_id = wr_id;
  e.opcode = op;
  e.byte_len = len;
  return e;
}

Expect RecvDone(uint64_t wr_id, ibv_wc_opcode op, uint32_t len,
                std::optional<uint32_t> imm = std::nullopt) {
  Expect e;
  e.wr_id = wr_id;
  e.opcode = op;
  e.byte_len = len;
  e.recv = true;
  e.imm = imm;
  return e;
}

Expect ErrorDone(uint64_t wr_id, std::optional<ibv_wc_status> status) {
  Expect e;
  e.wr_id = wr_id;
  e.status = status;
  return e;
}

// Checks every field of a completion and writes one transcript line.
void CheckWc(const std::string& label, const ibv_wc& wc, const Expect& e, uint32_t own_qpn,
             uint32_t peer_qpn) {
  const auto fail = [&](const std::string& why) {
    Die("%s: %s (status=%s opcode=%s byte_len=%u wr_id=0x%llx flags=%s)", label.c_str(),
        why.c_str(), ibv_wc_status_str(wc.status), WcOpcodeName(wc.opcode), wc.byte_len,
        static_cast<unsigned long long>(wc.wr_id), WcFlagsName(wc.wc_flags).c_str());
  };
  if (wc.wr_id != e.wr_id) {
    fail(Sprintf("wr_id, expected 0x%llx", static_cast<unsigned long long>(e.wr_id)));
  }
  if (wc.qp_num != own_qpn) fail("qp_num is not this QP's qp_num");
  const char* qp_rel = "own";
  if (e.status != IBV_WC_SUCCESS) {
    if (e.status ? wc.status != *e.status : wc.status == IBV_WC_SUCCESS) {
      fail(Sprintf("status, expected %s", e.status ? ibv_wc_status_str(*e.status) : "an error"));
    }
    // Only wr_id, status, qp_num and vendor_err are defined on errors.
    Line("%s: status=%s wr_id=0x%llx qp_num=%s", label.c_str(), ibv_wc_status_str(wc.status),
         static_cast<unsigned long long>(wc.wr_id), qp_rel);
    return;
  }
  if (wc.status != IBV_WC_SUCCESS) fail("status, expected success");
  if (wc.opcode != e.opcode) {
    fail(Sprintf("opcode, expected %s", WcOpcodeName(e.opcode)));
  }
  if (wc.byte_len != e.byte_len) {
    fail(Sprintf("byte_len, expected %u", e.byte_len));
  }
  std::string tail;
  if (e.recv) {
    const bool has_imm = wc.wc_flags & IBV_WC_WITH_IMM;
    if (has_imm != e.imm.has_value()) fail("WITH_IMM flag");
    if (has_imm) {
      const uint32_t imm = ntohl(wc.imm_data);
      if (imm != *e.imm) fail(Sprintf("imm 0x%08x, expected 0x%08x", imm, *e.imm));
      tail += Sprintf(" imm=0x%08x", imm);
    }
    if (e.grh && static_cast<bool>(wc.wc_flags & IBV_WC_GRH) != *e.grh) {
      fail("GRH flag");
    }
    if (e.src_qp_is_peer && wc.src_qp != peer_qpn) {
      fail("src_qp is not the peer's qp_num");
    }
    tail += Sprintf(" src_qp=%s", Relation(wc.src_qp, own_qpn, peer_qpn));
  }
  Line("%s: status=%s opcode=%s byte_len=%u wr_id=0x%llx flags=%s qp_num=%s%s", label.c_str(),
       ibv_wc_status_str(wc.status), WcOpcodeName(wc.opcode), wc.byte_len,
       static_cast<unsigned long long>(wc.wr_id), WcFlagsName(wc.wc_flags).c_str(), qp_rel,
       tail.c_str());
}

void CheckWcs(const std::string& label, const std::vector<ibv_wc>& wcs,
              const std::vector<Expect>& expects, uint32_t own_qpn, uint32_t peer_qpn) {
  for (size_t i = 0; i < wcs.size(); ++i) {
    CheckWc(Sprintf("%s[%zu]", label.c_str(), i), wcs[i], expects[i], own_qpn, peer_qpn);
  }
}

ibv_qp_state QueryQpState(ibv_qp* qp) {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (const int rc = ibv_query_qp(qp, &attr, IBV_QP_STATE, &init); rc != 0) {
    Die("ibv_query_qp: %s", std::strerror(rc));
  }
  return attr.qp_state;
}

// The responder's state after it NAKed: it may still be finishing the move
// to ERR when the requester's barrier arrives, so give it up to 2 s.
ibv_qp_state SettledQpState(ibv_qp* qp) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  ibv_qp_state st = QueryQpState(qp);
  while (st != IBV_QPS_ERR && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    st = QueryQpState(qp);
  }
  return st;
}

// Waits for one async event of the context, failing after kEventTimeoutMs.
ibv_async_event WaitAsyncEvent(Env& env, const char* what) {
  pollfd pfd{env.ctx->async_fd, POLLIN, 0};
  const int ready = poll(&pfd, 1, kEventTimeoutMs);
  if (ready <= 0) Die("%s: no async event within %d ms", what, kEventTimeoutMs);
  ibv_async_event ev{};
  if (ibv_get_async_event(env.ctx.get(), &ev) != 0) {
    Die("%s: ibv_get_async_event: %s", what, std::strerror(errno));
  }
  return ev;
}

void SetNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    Die("fcntl(O_NONBLOCK): %s", std::strerror(errno));
  }
}

// ---------------------------------------------------------------------------
// Queries of the device, port, GID table and P_Key table.

void RunDeviceQueries(Env& env) {
  ibv_device_attr dev{};
  if (const int rc = ibv_query_device(env.ctx.get(), &dev); rc != 0) {
    Die("ibv_query_device: %s", std::strerror(rc));
  }
  Check(dev.phys_port_cnt >= 1,
        Sprintf("query.device: phys_port_cnt >= 1: %s", YesNo(dev.phys_port_cnt >= 1)));
  Check(dev.max_sge >= 4, Sprintf("query.device: max_sge >= 4: %s", YesNo(dev.max_sge >= 4)));
  Check(dev.max_qp_rd_atom >= 4,
        Sprintf("query.device: max_qp_rd_atom >= 4: %s", YesNo(dev.max_qp_rd_atom >= 4)));
  Check(dev.max_srq >= 1, Sprintf("query.device: max_srq >= 1: %s", YesNo(dev.max_srq >= 1)));
  Check(dev.atomic_cap != IBV_ATOMIC_NONE, Sprintf("query.device: atomic_cap supported: %s",
                                                   YesNo(dev.atomic_cap != IBV_ATOMIC_NONE)));

  if (const int rc = ibv_query_port(env.ctx.get(), kIbPort, &env.port); rc != 0) {
    Die("ibv_query_port: %s", std::strerror(rc));
  }
  Check(env.port.state == IBV_PORT_ACTIVE,
        Sprintf("query.port: state ACTIVE: %s", YesNo(env.port.state == IBV_PORT_ACTIVE)));
  Check(env.port.link_layer == IBV_LINK_LAYER_ETHERNET,
        Sprintf("query.port: link_layer ETHERNET: %s",
                YesNo(env.port.link_layer == IBV_LINK_LAYER_ETHERNET)));
  Check(env.port.active_mtu >= IBV_MTU_1024,
        Sprintf("query.port: active_mtu >= 1024: %s", YesNo(env.port.active_mtu >= IBV_MTU_1024)));
  Check(env.port.gid_tbl_len > env.opt.gid_idx,
        Sprintf("query.port: gid_tbl_len > gid-idx: %s",
                YesNo(env.port.gid_tbl_len > env.opt.gid_idx)));

  if (ibv_query_gid(env.ctx.get(), kIbPort, env.opt.gid_idx, &env.gid) != 0) {
    Die("ibv_query_gid: %s", std::strerror(errno));
  }
  const ibv_gid zero{};
  Check(!SameGid(env.gid, zero),
        Sprintf("query.gid: gid-idx entry is set: %s", YesNo(!SameGid(env.gid, zero))));

  ibv_gid_entry entry{};
  if (const int rc = ibv_query_gid_ex(env.ctx.get(), kIbPort, env.opt.gid_idx, &entry, 0);
      rc != 0) {
    Die("ibv_query_gid_ex: %s", std::strerror(rc));
  }
  Check(SameGid(entry.gid, env.gid),
        Sprintf("query.gid_ex: same gid as ibv_query_gid: %s", YesNo(SameGid(entry.gid, env.gid))));
  Check(entry.gid_index == static_cast<uint32_t>(env.opt.gid_idx) && entry.port_num == kIbPort,
        "query.gid_ex: gid_index and port_num as asked: yes");
  Line("query.gid_ex: gid_type=%s", GidTypeName(entry.gid_type));

  std::vector<ibv_gid_entry> table(env.port.gid_tbl_len);
  const ssize_t n = ibv_query_gid_table(env.ctx.get(), table.data(), table.size(), 0);
  if (n < 0) Die("ibv_query_gid_table: %s", std::strerror(static_cast<int>(-n)));
  bool found = false;
  for (ssize_t i = 0; i < n; ++i) {
    if (table[i].port_num == kIbPort &&
        table[i].gid_index == static_cast<uint32_t>(env.opt.gid_idx)) {
      found = SameGid(table[i].gid, env.gid) && table[i].gid_type == entry.gid_type;
    }
  }
  Check(found, Sprintf("query.gid_table: has gid-idx with same gid and type: %s", YesNo(found)));

  uint16_t pkey = 0;
  if (ibv_query_pkey(env.ctx.get(), kIbPort, 0, &pkey) != 0) {
    Die("ibv_query_pkey: %s", std::strerror(errno));
  }
  Line("query.pkey: index 0 = 0x%04x", ntohs(pkey));
}

// ibv_query_qp right after connecting: what was set must read back.
void CheckQueryQp(Env& env, ibv_qp* qp, uint32_t my_psn, const WireEndpoint& peer) {
  ibv_qp_attr a{};
  ibv_qp_init_attr init{};
  const int mask = IBV_QP_STATE | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                   IBV_QP_SQ_PSN | IBV_QP_AV | IBV_QP_ACCESS_FLAGS | IBV_QP_MAX_QP_RD_ATOMIC |
                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_CAP;
  if (const int rc = ibv_query_qp(qp, &a, mask, &init); rc != 0) {
    Die("ibv_query_qp: %s", std::strerror(rc));
  }
  Check(a.qp_state == IBV_QPS_RTS, Sprintf("query.qp: state=%s", QpStateName(a.qp_state)));
  Check(a.dest_qp_num == peer.qpn,
        Sprintf("query.qp: dest_qp_num == peer qp_num: %s", YesNo(a.dest_qp_num == peer.qpn)));
  Check(a.sq_psn == my_psn, Sprintf("query.qp: sq_psn == own psn: %s", YesNo(a.sq_psn == my_psn)));
  Check(a.rq_psn == peer.psn,
        Sprintf("query.qp: rq_psn == peer psn: %s", YesNo(a.rq_psn == peer.psn)));
  Check(a.path_mtu == PathMtu(env),
        Sprintf("query.qp: path_mtu as set: %s", YesNo(a.path_mtu == PathMtu(env))));
  Check(SameGid(a.ah_attr.grh.dgid, peer.gid),
        Sprintf("query.qp: ah dgid == peer gid: %s", YesNo(SameGid(a.ah_attr.grh.dgid, peer.gid))));
  Check(a.ah_attr.grh.sgid_index == env.opt.gid_idx,
        Sprintf("query.qp: ah sgid_index == gid-idx: %s",
                YesNo(a.ah_attr.grh.sgid_index == env.opt.gid_idx)));
  const int want_access =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  Check(a.qp_access_flags == static_cast<unsigned>(want_access),
        Sprintf("query.qp: access flags as set: %s",
                YesNo(a.qp_access_flags == static_cast<unsigned>(want_access))));
  Check(a.max_rd_atomic == 4 && a.max_dest_rd_atomic == 4,
        Sprintf("query.qp: rd_atomic depths as set: %s",
                YesNo(a.max_rd_atomic == 4 && a.max_dest_rd_atomic == 4)));
  Check(a.cap.max_inline_data >= 64 && init.cap.max_send_sge >= 4,
        Sprintf("query.qp: max_inline_data >= 64 and max_send_sge >= 4: %s",
                YesNo(a.cap.max_inline_data >= 64 && init.cap.max_send_sge >= 4)));
}

// ---------------------------------------------------------------------------
// Phase 1: RC operations through ibv_post_send, plus ibv_query_qp and
// ibv_rereg_mr on the same connection.

constexpr uint32_t kSeedRcSrc = 0x1001;
constexpr uint32_t kSeedRcReadSrc = 0x1002;
constexpr uint32_t kSeedRcReply = 0x1003;
constexpr uint32_t kSeedRcRereg = 0x1004;
constexpr uint32_t kImmSend = 0x11223344;
constexpr uint32_t kImmWrite = 0x55667788;
constexpr uint32_t kImmReply = 0x5eed0001;
constexpr uint32_t kInlineLen = 64;
constexpr size_t kInlineOff = 900;

struct RcSide {
  explicit RcSide(Env& env)
      : buf(env.pd.get(), kBufSize, kRcAccess),
        scq(CreateCq(env)),
        rcq(CreateCq(env)),
        qp(CreateRcQp(env, scq.get(), rcq.get())),
        psn(NewPsn(env)) {}
  Buffer buf;
  Cq scq;
  Cq rcq;
  Qp qp;  // declared last: destroyed before its CQs
  uint32_t psn;
  WireEndpoint peer;
};

void RcClientTraffic(RcSide& s) {
  Buffer& b = s.buf;
  const WireEndpoint& p = s.peer;
  // Chain A: SEND, SEND_WITH_IMM, RDMA_WRITE, RDMA_WRITE_WITH_IMM, RDMA_READ.
  ibv_sge a[5] = {b.Sge(kSrcOff + 0, 256), b.Sge(kSrcOff + 256, 128), b.Sge(kSrcOff + 384, 512),
                  b.Sge(kSrcOff + 640, 256), b.Sge(kReadDstOff, 384)};
  std::vector<ibv_send_wr> chain_a = {SendWr(0x101, IBV_WR_SEND, &a[0], 1),
                                      SendWr(0x102, IBV_WR_SEND_WITH_IMM, &a[1], 1),
                                      SendWr(0x103, IBV_WR_RDMA_WRITE, &a[2], 1),
                                      SendWr(0x104, IBV_WR_RDMA_WRITE_WITH_IMM, &a[3], 1),
                                      SendWr(0x105, IBV_WR_RDMA_READ, &a[4], 1)};
  chain_a[1].imm_data = htonl(kImmSend);
  chain_a[2].wr.rdma = {p.addr + kRdmaOff, p.rkey};
  chain_a[3].wr.rdma = {p.addr + kRdmaOff + 512, p.rkey};
  chain_a[3].imm_data = htonl(kImmWrite);
  chain_a[4].wr.rdma = {p.addr + kReadSrcOff, p.rkey};
  PostSendChain(s.qp.get(), chain_a, "rc chain A");
  CheckWcs("rc.send_a", PollCq(s.scq.get(), 5, "rc chain A"),
           {SendDone(0x101, IBV_WC_SEND, 256), SendDone(0x102, IBV_WC_SEND, 128),
            SendDone(0x103, IBV_WC_RDMA_WRITE, 512), SendDone(0x104, IBV_WC_RDMA_WRITE, 256),
            SendDone(0x105, IBV_WC_RDMA_READ, 384)},
           s.qp->qp_num, p.qpn);
  CheckBytes("rc.read: local copy of peer bytes", b.at(kReadDstOff),
             Expected(kSeedRcReadSrc, {{0, 384}}));

  // Chain B: atomics, an inline SEND and multi-SGE SENDs.
  ibv_sge atom[3] = {b.Sge(kAtomicResOff, 8), b.Sge(kAtomicResOff + 8, 8),
                     b.Sge(kAtomicResOff + 16, 8)};
  ibv_sge inl = b.Sge(kSrcOff + kInlineOff, kInlineLen);
  ibv_sge gather3[3] = {b.Sge(kSrcOff + 10, 100), b.Sge(kSrcOff + 300, 28),
                        b.Sge(kSrcOff + 500, 200)};
  ibv_sge gather2[2] = {b.Sge(kSrcOff + 20, 100), b.Sge(kSrcOff + 700, 200)};
  std::vector<ibv_send_wr> chain_b = {
      SendWr(0x106, IBV_WR_ATOMIC_FETCH_AND_ADD, &atom[0], 1),
      SendWr(0x107, IBV_WR_ATOMIC_CMP_AND_SWP, &atom[1], 1),
      SendWr(0x108, IBV_WR_ATOMIC_CMP_AND_SWP, &atom[2], 1),
      SendWr(0x109, IBV_WR_SEND, &inl, 1, IBV_SEND_SIGNALED | IBV_SEND_INLINE),
      SendWr(0x10a, IBV_WR_SEND, gather3, 3),
      SendWr(0x10b, IBV_WR_SEND, gather2, 2)};
  const uint64_t target = p.addr + kAtomicOff;
  chain_b[0].wr.atomic = {target, kAtomicAdd, 0, p.rkey};
  chain_b[1].wr.atomic = {target, kAtomicInit + kAtomicAdd, kAtomicSwap, p.rkey};
  // Stale compare value: must fail and return the current value.
  chain_b[2].wr.atomic = {target, kAtomicInit, 0, p.rkey};
  PostSendChain(s.qp.get(), chain_b, "rc chain B");
  // Inline data is copied at post time: scribbling now must not show up.
  std::memset(b.at(kSrcOff + kInlineOff), 0xee, kInlineLen);
  CheckWcs("rc.send_b", PollCq(s.scq.get(), 6, "rc chain B"),
           {SendDone(0x106, IBV_WC_FETCH_ADD, 8), SendDone(0x107, IBV_WC_COMP_SWAP, 8),
            SendDone(0x108, IBV_WC_COMP_SWAP, 8), SendDone(0x109, IBV_WC_SEND, kInlineLen),
            SendDone(0x10a, IBV_WC_SEND, 328), SendDone(0x10b, IBV_WC_SEND, 300)},
           s.qp->qp_num, p.qpn);
  // rxe (like the IB spec) stores atomic results in host byte order.
  uint64_t res[3];
  std::memcpy(res, b.at(kAtomicResOff), sizeof(res));
  CheckU64("rc.fetch_add: returned old value", res[0], kAtomicInit);
  CheckU64("rc.cmp_swp: returned old value (swap taken)", res[1], kAtomicInit + kAtomicAdd);
  CheckU64("rc.cmp_swp: returned old value (swap refused)", res[2], kAtomicSwap);
}

void RcServerChecks(RcSide& s) {
  Buffer& b = s.buf;
  CheckWcs("rc.recv", PollCq(s.rcq.get(), 6, "rc receives"),
           {RecvDone(0x201, IBV_WC_RECV, 256), RecvDone(0x202, IBV_WC_RECV, 128, kImmSend),
            RecvDone(0x203, IBV_WC_RECV_RDMA_WITH_IMM, 256, kImmWrite),
            RecvDone(0x204, IBV_WC_RECV, kInlineLen), RecvDone(0x205, IBV_WC_RECV, 328),
            RecvDone(0x206, IBV_WC_RECV, 300)},
           s.qp->qp_num, s.peer.qpn);
  CheckBytes("rc.recv[0] send", b.at(0 * kSlot), Expected(kSeedRcSrc, {{0, 256}}));
  CheckBytes("rc.recv[1] send_imm", b.at(1 * kSlot), Expected(kSeedRcSrc, {{256, 128}}));
  CheckBytes("rc.recv[3] inline send", b.at(3 * kSlot),
             Expected(kSeedRcSrc, {{kInlineOff, kInlineLen}}));
  CheckBytes("rc.recv[4] 3-sge gather", b.at(4 * kSlot),
             Expected(kSeedRcSrc, {{10, 100}, {300, 28}, {500, 200}}));
  // 300 bytes gathered from 2 SGEs, scattered into 128 + 172 of 2 SGEs.
  const std::vector<uint8_t> want = Expected(kSeedRcSrc, {{20, 100}, {700, 200}});
  CheckBytes("rc.recv[5] scatter part 1", b.at(5 * kSlot),
             std::vector<uint8_t>(want.begin(), want.begin() + 128));
  CheckBytes("rc.recv[5] scatter part 2", b.at(6 * kSlot),
             std::vector<uint8_t>(want.begin() + 128, want.end()));
  CheckBytes("rc.write: target bytes", b.at(kRdmaOff), Expected(kSeedRcSrc, {{384, 512}}));
  CheckBytes("rc.write_imm: target bytes", b.at(kRdmaOff + 512),
             Expected(kSeedRcSrc, {{640, 256}}));
  uint64_t word;
  std::memcpy(&word, b.at(kAtomicOff), sizeof(word));
  CheckU64("rc.atomic: final target value", word, kAtomicSwap);
}

// ibv_rereg_mr changing access (drop REMOTE_ATOMIC), then the peer writes
// and reads the MR again with whatever rkey it has after the call.
void RcRereg(Env& env, Oob& oob, RcSide& s) {
  if (env.server) {
    errno = 0;
    const int rc =
        ibv_rereg_mr(s.buf.mr(), IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    const int err = rc != 0 ? errno : 0;
    // rdma-core 44's rxe has no rereg_mr: the call fails before reaching the
    // kernel and the MR stays as it was. Either way the peer uses it next.
    Line("rereg.change_access: %s errno=%s", ReregResultName(rc), ErrnoName(err).c_str());
    Fill(s.buf.at(kReadSrcOff), 128, kSeedRcRereg);
  }
  const uint32_t peer_rkey = oob.Exchange(s.buf.mr()->rkey);
  oob.Barrier("rereg.ready");
  if (!env.server) {
    Buffer& b = s.buf;
    Fill(b.at(kSrcOff), 128, kSeedRcRereg + 1);
    ibv_sge sge[2] = {b.Sge(kSrcOff, 128), b.Sge(kReadDstOff, 128)};
    std::vector<ibv_send_wr> wrs = {SendWr(0x1a1, IBV_WR_RDMA_WRITE, &sge[0], 1),
                                    SendWr(0x1a2, IBV_WR_RDMA_READ, &sge[1], 1)};
    wrs[0].wr.rdma = {s.peer.addr + kRdmaOff + 768, peer_rkey};
    wrs[1].wr.rdma = {s.peer.addr + kReadSrcOff, peer_rkey};
    PostSendChain(s.qp.get(), wrs, "rereg");
    CheckWcs("rereg.use", PollCq(s.scq.get(), 2, "rereg"),
             {SendDone(0x1a1, IBV_WC_RDMA_WRITE, 128), SendDone(0x1a2, IBV_WC_RDMA_READ, 128)},
             s.qp->qp_num, s.peer.qpn);
    CheckBytes("rereg.read: bytes", b.at(kReadDstOff), Expected(kSeedRcRereg, {{0, 128}}));
  }
  oob.Barrier("rereg.done");
  if (env.server) {
    CheckBytes("rereg.write: target bytes", s.buf.at(kRdmaOff + 768),
               Expected(kSeedRcRereg + 1, {{0, 128}}));
  }
}

void RunRcPhase(Env& env, Oob& oob) {
  RcSide s(env);
  Buffer& b = s.buf;
  if (env.server) {
    Fill(b.at(kReadSrcOff), 384, kSeedRcReadSrc);
    Fill(b.at(kSrcOff), kSrcLen, kSeedRcReply);
    const uint64_t init = kAtomicInit;
    std::memcpy(b.at(kAtomicOff), &init, sizeof(init));
    for (int i = 0; i < 5; ++i) {
      PostRecv(s.qp.get(), 0x201 + i, {b.Sge(i * kSlot, kSlot)});
    }
    PostRecv(s.qp.get(), 0x206, {b.Sge(5 * kSlot, 128), b.Sge(6 * kSlot, 256)});
  } else {
    Fill(b.at(kSrcOff), kSrcLen, kSeedRcSrc);
    PostRecv(s.qp.get(), 0x301, {b.Sge(0, kSlot)});
  }
  s.peer = ExchangeAndConnect(env, oob, s.qp.get(), s.psn, &b, "rc.connected");
  CheckQueryQp(env, s.qp.get(), s.psn, s.peer);

  if (!env.server) RcClientTraffic(s);
  oob.Barrier("rc.sent");
  if (env.server) {
    RcServerChecks(s);
    ibv_sge sge = b.Sge(kSrcOff, 200);
    std::vector<ibv_send_wr> wr = {SendWr(0x2a1, IBV_WR_SEND_WITH_IMM, &sge, 1)};
    wr[0].imm_data = htonl(kImmReply);
    PostSendChain(s.qp.get(), wr, "rc reply");
    CheckWc("rc.reply_send", PollCq(s.scq.get(), 1, "rc reply")[0],
            SendDone(0x2a1, IBV_WC_SEND, 200), s.qp->qp_num, s.peer.qpn);
  } else {
    CheckWc("rc.reply_recv", PollCq(s.rcq.get(), 1, "rc reply")[0],
            RecvDone(0x301, IBV_WC_RECV, 200, kImmReply), s.qp->qp_num, s.peer.qpn);
    CheckBytes("rc.reply_recv: bytes", b.at(0), Expected(kSeedRcReply, {{0, 200}}));
  }
  oob.Barrier("rc.replied");
  RcRereg(env, oob, s);
  CheckCqEmpty(s.scq.get(), "rc.send_cq");
  CheckCqEmpty(s.rcq.get(), "rc.recv_cq");
  oob.Barrier("rc.done");
}

// ---------------------------------------------------------------------------
// Phase 2: the same RC operations through ibv_create_qp_ex / ibv_wr_* and
// completions through ibv_create_cq_ex / ibv_start_poll.

constexpr uint32_t kSeedExSrc = 0x2001;
constexpr uint32_t kSeedExReadSrc = 0x2002;
constexpr uint32_t kSeedExReply = 0x2003;
constexpr uint32_t kImmExSend = 0xe0000002;
constexpr uint32_t kImmExWrite = 0xe0000004;
constexpr uint32_t kImmExReply = 0x5eed0002;

constexpr uint64_t kExWcFlags =
    IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SRC_QP;

CqEx CreateCqEx(Env& env, uint64_t wc_flags) {
  ibv_cq_init_attr_ex attr{};
  attr.cqe = kCqDepth;
  attr.wc_flags = wc_flags;
  return CqEx(ibv_create_cq_ex(env.ctx.get(), &attr));
}

// Reads the completion under the poll cursor into an ibv_wc.
ibv_wc ReadCqEx(ibv_cq_ex* cq) {
  ibv_wc wc{};
  wc.wr_id = cq->wr_id;
  wc.status = cq->status;
  wc.vendor_err = ibv_wc_read_vendor_err(cq);
  wc.qp_num = ibv_wc_read_qp_num(cq);
  if (wc.status != IBV_WC_SUCCESS) return wc;
  wc.opcode = ibv_wc_read_opcode(cq);
  wc.byte_len = ibv_wc_read_byte_len(cq);
  wc.wc_flags = ibv_wc_read_wc_flags(cq);
  if (wc.wc_flags & IBV_WC_WITH_IMM) wc.imm_data = ibv_wc_read_imm_data(cq);
  wc.src_qp = ibv_wc_read_src_qp(cq);
  return wc;
}

// One completion per start/end pair, waiting up to kCqDeadline for each.
std::vector<ibv_wc> PollCqExEach(ibv_cq_ex* cq, int n, const char* what) {
  std::vector<ibv_wc> wcs;
  const auto deadline = std::chrono::steady_clock::now() + kCqDeadline;
  while (static_cast<int>(wcs.size()) < n) {
    ibv_poll_cq_attr attr{};
    const int rc = ibv_start_poll(cq, &attr);
    if (rc == ENOENT) {  // empty: start_poll took no lock, no end_poll
      if (std::chrono::steady_clock::now() > deadline) {
        Die("%s: %zu of %d completions after %lld s", what, wcs.size(), n,
            static_cast<long long>(kCqDeadline.count()));
      }
      continue;
    }
    if (rc != 0) Die("ibv_start_poll(%s): %s", what, std::strerror(rc));
    wcs.push_back(ReadCqEx(cq));
    ibv_end_poll(cq);
  }
  return wcs;
}

// All `n` completions in one start/next.../end sequence, for completions the
// peer's progress already guarantees are queued. ibv_next_poll is never
// driven to ENOENT on purpose: rxe in rdma-core 44 then advances the consumer
// index past the producer in ibv_end_poll (fixed upstream in b78b414e0).
std::vector<ibv_wc> PollCqExBatch(ibv_cq_ex* cq, int n, const char* what) {
  std::vector<ibv_wc> wcs;
  ibv_poll_cq_attr attr{};
  const auto deadline = std::chrono::steady_clock::now() + kCqDeadline;
  int rc;
  while ((rc = ibv_start_poll(cq, &attr)) == ENOENT) {
    if (std::chrono::steady_clock::now() > deadline) {
      Die("%s: no completion after %lld s", what, static_cast<long long>(kCqDeadline.count()));
    }
  }
  if (rc != 0) Die("ibv_start_poll(%s): %s", what, std::strerror(rc));
  wcs.push_back(ReadCqEx(cq));
  for (int i = 1; i < n; ++i) {
    rc = ibv_next_poll(cq);
    if (rc != 0) {
      ibv_end_poll(cq);
      Die("ibv_next_poll(%s) for completion %d of %d: %s", what, i + 1, n, std::strerror(rc));
    }
    wcs.push_back(ReadCqEx(cq));
  }
  ibv_end_poll(cq);
  return wcs;
}

void CheckCqExEmpty(ibv_cq_ex* cq, const std::string& label) {
  ibv_poll_cq_attr attr{};
  const int rc = ibv_start_poll(cq, &attr);
  if (rc == 0) ibv_end_poll(cq);
  Check(rc == ENOENT, Sprintf("%s: no further completion: %s", label.c_str(), YesNo(rc == ENOENT)));
}

struct ExSide {
  explicit ExSide(Env& env)
      : buf(env.pd.get(), kBufSize, kRcAccess),
        scq(CreateCqEx(env, kExWcFlags)),
        rcq(CreateCqEx(env, kExWcFlags)),
        psn(NewPsn(env)) {
    if (!scq || !rcq) Die("ibv_create_cq_ex: %s", std::strerror(errno));
    ibv_qp_init_attr_ex attr{};
    const ibv_qp_init_attr base =
        RcInitAttr(ibv_cq_ex_to_cq(scq.get()), ibv_cq_ex_to_cq(rcq.get()), nullptr);
    attr.send_cq = base.send_cq;
    attr.recv_cq = base.recv_cq;
    attr.cap = base.cap;
    attr.qp_type = IBV_QPT_RC;
    attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    attr.pd = env.pd.get();
    attr.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                          IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                          IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
                          IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP;
    qp.reset(ibv_create_qp_ex(env.ctx.get(), &attr));
    if (!qp) Die("ibv_create_qp_ex: %s", std::strerror(errno));
    InitRc(qp.get());
    qpx = ibv_qp_to_qp_ex(qp.get());
    if (qpx == nullptr) Die("ibv_qp_to_qp_ex returned null");
  }
  Buffer buf;
  CqEx scq;
  CqEx rcq;
  Qp qp;
  ibv_qp_ex* qpx = nullptr;  // view of qp, not owned
  uint32_t psn;
  WireEndpoint peer;
};

void CompleteWr(ibv_qp_ex* qpx, const char* what) {
  if (const int rc = ibv_wr_complete(qpx); rc != 0) {
    Die("ibv_wr_complete(%s): %s", what, std::strerror(rc));
  }
}

// Starts a work request under the current ibv_wr_start batch.
void NextWr(ibv_qp_ex* qpx, uint64_t wr_id, unsigned flags = IBV_SEND_SIGNALED) {
  qpx->wr_id = wr_id;
  qpx->wr_flags = flags;
}

void ExClientTraffic(ExSide& s) {
  Buffer& b = s.buf;
  const WireEndpoint& p = s.peer;
  ibv_qp_ex* q = s.qpx;
  const uint32_t lkey = b.mr()->lkey;

  // An aborted batch posts nothing: its wr_id must never complete.
  ibv_wr_start(q);
  NextWr(q, 0xabab);
  ibv_wr_send(q);
  ibv_wr_set_sge(q, lkey, b.addr(kSrcOff), 16);
  ibv_wr_abort(q);

  ibv_wr_start(q);
  NextWr(q, 0x401);
  ibv_wr_send(q);
  ibv_wr_set_sge(q, lkey, b.addr(kSrcOff), 256);
  NextWr(q, 0x402);
  ibv_wr_send_imm(q, htonl(kImmExSend));
  ibv_wr_set_sge(q, lkey, b.addr(kSrcOff + 256), 128);
  NextWr(q, 0x403);
  ibv_wr_rdma_write(q, p.rkey, p.addr + kRdmaOff);
  ibv_wr_set_sge(q, lkey, b.addr(kSrcOff + 384), 512);
  NextWr(q, 0x404);
  ibv_wr_rdma_write_imm(q, p.rkey, p.addr + kRdmaOff + 512, htonl(kImmExWrite));
  ibv_wr_set_sge(q, lkey, b.addr(kSrcOff + 640), 256);
  NextWr(q, 0x405);
  ibv_wr_rdma_read(q, p.rkey, p.addr + kReadSrcOff);
  ibv_wr_set_sge(q, lkey, b.addr(kReadDstOff), 384);
  CompleteWr(q, "ex batch A");
  CheckWcs("ex.send_a", PollCqExEach(s.scq.get(), 5, "ex batch A"),
           {SendDone(0x401, IBV_WC_SEND, 256), SendDone(0x402, IBV_WC_SEND, 128),
            SendDone(0x403, IBV_WC_RDMA_WRITE, 512), SendDone(0x404, IBV_WC_RDMA_WRITE, 256),
            SendDone(0x405, IBV_WC_RDMA_READ, 384)},
           s.qp->qp_num, p.qpn);
  CheckBytes("ex.read: local copy of peer bytes", b.at(kReadDstOff),
             Expected(kSeedExReadSrc, {{0, 384}}));

  ibv_wr_start(q);
  NextWr(q, 0x406);
  ibv_wr_atomic_fetch_add(q, p.rkey, p.addr + kAtomicOff, kAtomicAdd);
  ibv_wr_set_sge(q, lkey, b.addr(kAtomicResOff), 8);
  NextWr(q, 0x407);
  ibv_wr_atomic_cmp_swp(q, p.rkey, p.addr + kAtomicOff, kAtomicInit + kAtomicAdd, kAtomicSwap);
  ibv_wr_set_sge(q, lkey, b.addr(kAtomicResOff + 8), 8);
  // rxe's kernel side copies inline payload only for WRs flagged INLINE, and
  // ibv_wr_set_inline_data in rdma-core 44 does not set the flag itself.
  NextWr(q, 0x408, IBV_SEND_SIGNALED | IBV_SEND_INLINE);
  ibv_wr_send(q);
  ibv_wr_set_inline_data(q, b.at(kSrcOff + kInlineOff), kInlineLen);
  // Equal SGE lengths: rdma-core 44's rxe wr_set_sge_list sums the first
  // SGE's length num_sge times (fixed upstream in 406cd2ad0).
  const ibv_sge list[3] = {b.Sge(kSrcOff + 10, 100), b.Sge(kSrcOff + 300, 100),
                           b.Sge(kSrcOff + 500, 100)};
  NextWr(q, 0x409);
  ibv_wr_send(q);
  ibv_wr_set_sge_list(q, 3, list);
  CompleteWr(q, "ex batch B");
  std::memset(b.at(kSrcOff + kInlineOff), 0xee, kInlineLen);
  CheckWcs("ex.send_b", PollCqExEach(s.scq.get(), 4, "ex batch B"),
           {SendDone(0x406, IBV_WC_FETCH_ADD, 8), SendDone(0x407, IBV_WC_COMP_SWAP, 8),
            SendDone(0x408, IBV_WC_SEND, kInlineLen), SendDone(0x409, IBV_WC_SEND, 300)},
           s.qp->qp_num, p.qpn);
  uint64_t res[2];
  std::memcpy(res, b.at(kAtomicResOff), sizeof(res));
  CheckU64("ex.fetch_add: returned old value", res[0], kAtomicInit);
  CheckU64("ex.cmp_swp: returned old value", res[1], kAtomicInit + kAtomicAdd);
  // Every completion so far had the wr_id of a completed batch.
  Line("ex.wr_abort: aborted wr_id never completed: yes");
}

void ExServerChecks(ExSide& s) {
  Buffer& b = s.buf;
  CheckWcs("ex.recv", PollCqExBatch(s.rcq.get(), 5, "ex receives"),
           {RecvDone(0x501, IBV_WC_RECV, 256), RecvDone(0x502, IBV_WC_RECV, 128, kImmExSend),
            RecvDone(0x503, IBV_WC_RECV_RDMA_WITH_IMM, 256, kImmExWrite),
            RecvDone(0x504, IBV_WC_RECV, kInlineLen), RecvDone(0x505, IBV_WC_RECV, 300)},
           s.qp->qp_num, s.peer.qpn);
  CheckBytes("ex.recv[0] send", b.at(0), Expected(kSeedExSrc, {{0, 256}}));
  CheckBytes("ex.recv[1] send_imm", b.at(kSlot), Expected(kSeedExSrc, {{256, 128}}));
  CheckBytes("ex.recv[3] inline send", b.at(3 * kSlot),
             Expected(kSeedExSrc, {{kInlineOff, kInlineLen}}));
  CheckBytes("ex.recv[4] sge list", b.at(4 * kSlot),
             Expected(kSeedExSrc, {{10, 100}, {300, 100}, {500, 100}}));
  CheckBytes("ex.write: target bytes", b.at(kRdmaOff), Expected(kSeedExSrc, {{384, 512}}));
  CheckBytes("ex.write_imm: target bytes", b.at(kRdmaOff + 512),
             Expected(kSeedExSrc, {{640, 256}}));
  uint64_t word;
  std::memcpy(&word, b.at(kAtomicOff), sizeof(word));
  CheckU64("ex.atomic: final target value", word, kAtomicSwap);
}

void ExReply(ExSide& s) {
  const ibv_sge list[2] = {s.buf.Sge(kSrcOff, 100), s.buf.Sge(kSrcOff + 200, 100)};
  ibv_wr_start(s.qpx);
  NextWr(s.qpx, 0x5a1);
  ibv_wr_send_imm(s.qpx, htonl(kImmExReply));
  ibv_wr_set_sge_list(s.qpx, 2, list);
  CompleteWr(s.qpx, "ex reply");
  CheckWc("ex.reply_send", PollCqExEach(s.scq.get(), 1, "ex reply")[0],
          SendDone(0x5a1, IBV_WC_SEND, 200), s.qp->qp_num, s.peer.qpn);
}

void RunExPhase(Env& env, Oob& oob) {
  // What the provider refuses is part of the contract a shim must keep.
  {
    CqEx ts = CreateCqEx(env, kExWcFlags | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP);
    Line("ex.create_cq_ex with COMPLETION_TIMESTAMP: %s",
         ts ? "created" : ("refused, errno " + ErrnoName(errno)).c_str());
  }
  ExSide s(env);
  Line("ex.create_qp_ex with send_ops_flags and ibv_qp_to_qp_ex: ok");
  Buffer& b = s.buf;
  if (env.server) {
    Fill(b.at(kReadSrcOff), 384, kSeedExReadSrc);
    Fill(b.at(kSrcOff), kSrcLen, kSeedExReply);
    const uint64_t init = kAtomicInit;
    std::memcpy(b.at(kAtomicOff), &init, sizeof(init));
    for (int i = 0; i < 5; ++i) {
      PostRecv(s.qp.get(), 0x501 + i, {b.Sge(i * kSlot, kSlot)});
    }
  } else {
    Fill(b.at(kSrcOff), kSrcLen, kSeedExSrc);
    PostRecv(s.qp.get(), 0x601, {b.Sge(0, kSlot)});
  }
  s.peer = ExchangeAndConnect(env, oob, s.qp.get(), s.psn, &b, "ex.connected");
  if (!env.server) ExClientTraffic(s);
  oob.Barrier("ex.sent");
  if (env.server) {
    ExServerChecks(s);
    ExReply(s);
  } else {
    CheckWc("ex.reply_recv", PollCqExEach(s.rcq.get(), 1, "ex reply")[0],
            RecvDone(0x601, IBV_WC_RECV, 200, kImmExReply), s.qp->qp_num, s.peer.qpn);
    CheckBytes("ex.reply_recv: bytes", b.at(0), Expected(kSeedExReply, {{0, 100}, {200, 100}}));
  }
  CheckCqExEmpty(s.scq.get(), "ex.send_cq");
  CheckCqExEmpty(s.rcq.get(), "ex.recv_cq");
  oob.Barrier("ex.done");
}

// ---------------------------------------------------------------------------
// Phase 3: receives from an SRQ, its limit event, query and modify.

constexpr uint32_t kSeedSrq = 0x3001;
constexpr uint32_t kImmSrq = 0x5a5a0005;
constexpr int kSrqPosted = 6;
constexpr uint32_t kSrqLimit = 3;

void SrqServerSetup(Env& env, ibv_srq* srq, Buffer& b) {
  std::vector<ibv_sge> sges(kSrqPosted);
  std::vector<ibv_recv_wr> wrs(kSrqPosted);
  for (int i = 0; i < kSrqPosted; ++i) {
    sges[i] = b.Sge(i * kSlot, kSlot);
    wrs[i].wr_id = 0x701 + i;
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
    wrs[i].next = i + 1 < kSrqPosted ? &wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  if (const int rc = ibv_post_srq_recv(srq, wrs.data(), &bad); rc != 0) {
    Die("ibv_post_srq_recv: %s", std::strerror(rc));
  }
  ibv_srq_attr attr{};
  attr.srq_limit = kSrqLimit;
  if (const int rc = ibv_modify_srq(srq, &attr, IBV_SRQ_LIMIT); rc != 0) {
    Die("ibv_modify_srq(IBV_SRQ_LIMIT): %s", std::strerror(rc));
  }
  attr = {};
  if (const int rc = ibv_query_srq(srq, &attr); rc != 0) {
    Die("ibv_query_srq: %s", std::strerror(rc));
  }
  Check(attr.max_wr >= 16, Sprintf("srq.query: max_wr >= requested: %s", YesNo(attr.max_wr >= 16)));
  Check(attr.srq_limit == kSrqLimit,
        Sprintf("srq.query: srq_limit=%u after modify", attr.srq_limit));
  SetNonBlocking(env.ctx->async_fd);
}

void SrqServerChecks(Env& env, ibv_srq* srq, ibv_cq* rcq, ibv_qp* qp, uint32_t peer_qpn,
                     Buffer& b) {
  CheckWcs("srq.recv", PollCq(rcq, 5, "srq receives"),
           {RecvDone(0x701, IBV_WC_RECV, 64), RecvDone(0x702, IBV_WC_RECV, 128),
            RecvDone(0x703, IBV_WC_RECV, 200), RecvDone(0x704, IBV_WC_RECV, 32),
            RecvDone(0x705, IBV_WC_RECV, 16, kImmSrq)},
           qp->qp_num, peer_qpn);
  const size_t offs[5] = {0, 64, 192, 392, 424};
  const uint32_t lens[5] = {64, 128, 200, 32, 16};
  for (int i = 0; i < 5; ++i) {
    CheckBytes(Sprintf("srq.recv[%d] bytes", i), b.at(i * kSlot),
               Expected(kSeedSrq, {{offs[i], lens[i]}}));
  }
  // 6 posted, limit 3: the 4th receive leaves 2 and arms the event.
  ibv_async_event ev = WaitAsyncEvent(env, "srq limit");
  const bool is_limit = ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED;
  const bool same_srq = is_limit && ev.element.srq == srq;
  ibv_ack_async_event(&ev);
  Check(is_limit, Sprintf("srq.async_event: SRQ_LIMIT_REACHED: %s", YesNo(is_limit)));
  Check(same_srq, Sprintf("srq.async_event: element.srq is ours: %s", YesNo(same_srq)));
  ibv_srq_attr attr{};
  if (const int rc = ibv_query_srq(srq, &attr); rc != 0) {
    Die("ibv_query_srq: %s", std::strerror(rc));
  }
  Line("srq.query: srq_limit=%u after the event", attr.srq_limit);
}

void RunSrqPhase(Env& env, Oob& oob) {
  Buffer b(env.pd.get(), kBufSize, kRcAccess);
  Cq scq = CreateCq(env);
  Cq rcq = CreateCq(env);
  Srq srq;
  if (env.server) {
    ibv_srq_init_attr init{};
    init.attr.max_wr = 16;
    init.attr.max_sge = 1;
    srq.reset(ibv_create_srq(env.pd.get(), &init));
    if (!srq) Die("ibv_create_srq: %s", std::strerror(errno));
    SrqServerSetup(env, srq.get(), b);
  }
  Qp qp = CreateRcQp(env, scq.get(), rcq.get(), srq.get());
  const uint32_t psn = NewPsn(env);
  const WireEndpoint peer = ExchangeAndConnect(env, oob, qp.get(), psn, &b, "srq.connected");
  if (!env.server) {
    Fill(b.at(kSrcOff), kSrcLen, kSeedSrq);
    ibv_sge sge[5] = {b.Sge(kSrcOff + 0, 64), b.Sge(kSrcOff + 64, 128), b.Sge(kSrcOff + 192, 200),
                      b.Sge(kSrcOff + 392, 32), b.Sge(kSrcOff + 424, 16)};
    std::vector<ibv_send_wr> wrs;
    for (int i = 0; i < 5; ++i) {
      wrs.push_back(SendWr(0x711 + i, i < 4 ? IBV_WR_SEND : IBV_WR_SEND_WITH_IMM, &sge[i], 1));
    }
    wrs[4].imm_data = htonl(kImmSrq);
    PostSendChain(qp.get(), wrs, "srq sends");
    CheckWcs("srq.send", PollCq(scq.get(), 5, "srq sends"),
             {SendDone(0x711, IBV_WC_SEND, 64), SendDone(0x712, IBV_WC_SEND, 128),
              SendDone(0x713, IBV_WC_SEND, 200), SendDone(0x714, IBV_WC_SEND, 32),
              SendDone(0x715, IBV_WC_SEND, 16)},
             qp->qp_num, peer.qpn);
  }
  oob.Barrier("srq.sent");
  if (env.server) SrqServerChecks(env, srq.get(), rcq.get(), qp.get(), peer.qpn, b);
  oob.Barrier("srq.done");
  qp.reset();  // before the SRQ it draws from
}

// ---------------------------------------------------------------------------
// Phase 4: UD with address handles, GRH, and replies through AHs made from
// received completions.

constexpr uint32_t kSeedUd = 0x4001;
constexpr uint32_t kSeedUdReply = 0x4002;
constexpr uint32_t kImmUd = 0x0d0d0001;
constexpr uint32_t kImmUdReply = 0x0d0d0002;

Qp CreateUdQp(Env& env, ibv_cq* scq, ibv_cq* rcq) {
  ibv_qp_init_attr attr{};
  attr.send_cq = scq;
  attr.recv_cq = rcq;
  attr.qp_type = IBV_QPT_UD;
  attr.cap.max_send_wr = 8;
  attr.cap.max_recv_wr = 8;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  Qp qp(ibv_create_qp(env.pd.get(), &attr));
  if (!qp) Die("ibv_create_qp(UD): %s", std::strerror(errno));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = kIbPort;
  a.qkey = kQkey;
  ModifyQp(qp.get(), a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, "UD INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  ModifyQp(qp.get(), a, IBV_QP_STATE, "UD RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = NewPsn(env);
  ModifyQp(qp.get(), a, IBV_QP_STATE | IBV_QP_SQ_PSN, "UD RTS");
  return qp;
}

// The 40 bytes before a UD payload. For RoCE v2 over IPv4 there is no GRH on
// the wire: the provider puts the IPv4 header in the last 20 bytes, and the
// GIDs are the IPv4-mapped addresses of its source and destination.
struct GrhGids {
  ibv_gid sgid{};
  ibv_gid dgid{};
  const char* form = "";
};

GrhGids ParseGrh(const uint8_t* area) {
  GrhGids g;
  const uint8_t* ip = area + 20;
  if ((ip[0] >> 4) == 4) {
    g.form = "ipv4 header";
    for (ibv_gid* gid : {&g.sgid, &g.dgid}) {
      gid->raw[10] = 0xff;
      gid->raw[11] = 0xff;
    }
    std::memcpy(g.sgid.raw + 12, ip + 12, 4);
    std::memcpy(g.dgid.raw + 12, ip + 16, 4);
  } else {
    g.form = "grh";
    std::memcpy(g.sgid.raw, area + 8, 16);
    std::memcpy(g.dgid.raw, area + 24, 16);
  }
  return g;
}

void CheckUdRecv(Env& env, const std::string& label, const ibv_wc& wc, Expect e, uint32_t own_qpn,
                 const WireEndpoint& peer, const uint8_t* slot,
                 const std::vector<uint8_t>& payload) {
  e.grh = true;
  e.src_qp_is_peer = true;
  CheckWc(label, wc, e, own_qpn, peer.qpn);
  const GrhGids g = ParseGrh(slot);
  Check(SameGid(g.sgid, peer.gid), Sprintf("%s: grh (%s) source gid == peer gid: %s", label.c_str(),
                                           g.form, YesNo(SameGid(g.sgid, peer.gid))));
  Check(SameGid(g.dgid, env.gid), Sprintf("%s: grh destination gid == own gid: %s", label.c_str(),
                                          YesNo(SameGid(g.dgid, env.gid))));
  CheckBytes(label + " payload", slot + kGrhLen, payload);
}

std::vector<ibv_wc> UdSend(ibv_qp* qp, ibv_cq* scq, Buffer& b, ibv_ah* ah[2],
                           uint32_t remote_qpn[2], uint64_t first_wr_id, const uint32_t len[2],
                           uint32_t imm) {
  ibv_sge sge[2] = {b.Sge(kSrcOff, len[0]), b.Sge(kSrcOff + 256, len[1])};
  std::vector<ibv_send_wr> wrs = {SendWr(first_wr_id, IBV_WR_SEND, &sge[0], 1),
                                  SendWr(first_wr_id + 1, IBV_WR_SEND_WITH_IMM, &sge[1], 1)};
  for (int i = 0; i < 2; ++i) {
    wrs[i].wr.ud.ah = ah[i];
    wrs[i].wr.ud.remote_qpn = remote_qpn[i];
    wrs[i].wr.ud.remote_qkey = kQkey;
  }
  wrs[1].imm_data = htonl(imm);
  PostSendChain(qp, wrs, "ud sends");
  return PollCq(scq, 2, "ud sends");
}

void UdServerReply(Env& env, ibv_qp* qp, ibv_cq* scq, Buffer& b, std::vector<ibv_wc>& wcs,
                   const WireEndpoint& peer) {
  auto* grh0 = reinterpret_cast<ibv_grh*>(b.at(0));
  auto* grh1 = reinterpret_cast<ibv_grh*>(b.at(kUdSlot));
  Ah ah_from_wc(ibv_create_ah_from_wc(env.pd.get(), &wcs[0], grh0, kIbPort));
  if (!ah_from_wc) Die("ibv_create_ah_from_wc: %s", std::strerror(errno));
  Line("ud.create_ah_from_wc: ok");
  ibv_ah_attr attr{};
  if (ibv_init_ah_from_wc(env.ctx.get(), kIbPort, &wcs[1], grh1, &attr) != 0) {
    Die("ibv_init_ah_from_wc: %s", std::strerror(errno));
  }
  Check(attr.is_global == 1,
        Sprintf("ud.init_ah_from_wc: is_global: %s", YesNo(attr.is_global == 1)));
  Check(SameGid(attr.grh.dgid, peer.gid), Sprintf("ud.init_ah_from_wc: dgid == peer gid: %s",
                                                  YesNo(SameGid(attr.grh.dgid, peer.gid))));
  Check(attr.grh.sgid_index == env.opt.gid_idx,
        Sprintf("ud.init_ah_from_wc: sgid_index == gid-idx: %s",
                YesNo(attr.grh.sgid_index == env.opt.gid_idx)));
  Check(attr.port_num == kIbPort, Sprintf("ud.init_ah_from_wc: port_num: %u", attr.port_num));
  Ah ah_from_attr(ibv_create_ah(env.pd.get(), &attr));
  if (!ah_from_attr) Die("ibv_create_ah(from wc attr): %s", std::strerror(errno));

  Fill(b.at(kSrcOff), kSrcLen, kSeedUdReply);
  ibv_ah* ahs[2] = {ah_from_wc.get(), ah_from_attr.get()};
  uint32_t qpns[2] = {wcs[0].src_qp, wcs[1].src_qp};
  const uint32_t lens[2] = {150, 50};
  CheckWcs("ud.reply_send", UdSend(qp, scq, b, ahs, qpns, 0x8a1, lens, kImmUdReply),
           {SendDone(0x8a1, IBV_WC_SEND, 150), SendDone(0x8a2, IBV_WC_SEND, 50)}, qp->qp_num,
           peer.qpn);
}

void RunUdPhase(Env& env, Oob& oob) {
  Buffer b(env.pd.get(), kBufSize, IBV_ACCESS_LOCAL_WRITE);
  Cq scq = CreateCq(env);
  Cq rcq = CreateCq(env);
  Qp qp = CreateUdQp(env, scq.get(), rcq.get());
  const uint64_t recv_base = env.server ? 0x801 : 0x901;
  for (int i = 0; i < 2; ++i) {
    PostRecv(qp.get(), recv_base + i, {b.Sge(i * kUdSlot, kUdSlot)});
  }
  const WireEndpoint peer = oob.Exchange(Describe(env, qp.get(), 0, nullptr));
  oob.Barrier("ud.ready");

  if (!env.server) {
    ibv_ah_attr attr{};
    attr.is_global = 1;
    std::memcpy(attr.grh.dgid.raw, peer.gid, 16);
    attr.grh.sgid_index = static_cast<uint8_t>(env.opt.gid_idx);
    attr.grh.hop_limit = 64;
    attr.port_num = kIbPort;
    Ah ah(ibv_create_ah(env.pd.get(), &attr));
    if (!ah) Die("ibv_create_ah: %s", std::strerror(errno));
    Line("ud.create_ah with grh: ok");
    Fill(b.at(kSrcOff), kSrcLen, kSeedUd);
    ibv_ah* ahs[2] = {ah.get(), ah.get()};
    uint32_t qpns[2] = {peer.qpn, peer.qpn};
    const uint32_t lens[2] = {200, 100};
    CheckWcs("ud.send", UdSend(qp.get(), scq.get(), b, ahs, qpns, 0x811, lens, kImmUd),
             {SendDone(0x811, IBV_WC_SEND, 200), SendDone(0x812, IBV_WC_SEND, 100)}, qp->qp_num,
             peer.qpn);
  }
  oob.Barrier("ud.sent");
  if (env.server) {
    std::vector<ibv_wc> wcs = PollCq(rcq.get(), 2, "ud receives");
    CheckUdRecv(env, "ud.recv[0]", wcs[0], RecvDone(0x801, IBV_WC_RECV, kGrhLen + 200), qp->qp_num,
                peer, b.at(0), Expected(kSeedUd, {{0, 200}}));
    CheckUdRecv(env, "ud.recv[1]", wcs[1], RecvDone(0x802, IBV_WC_RECV, kGrhLen + 100, kImmUd),
                qp->qp_num, peer, b.at(kUdSlot), Expected(kSeedUd, {{256, 100}}));
    UdServerReply(env, qp.get(), scq.get(), b, wcs, peer);
  }
  oob.Barrier("ud.replied");
  if (!env.server) {
    std::vector<ibv_wc> wcs = PollCq(rcq.get(), 2, "ud replies");
    CheckUdRecv(env, "ud.reply_recv[0]", wcs[0], RecvDone(0x901, IBV_WC_RECV, kGrhLen + 150),
                qp->qp_num, peer, b.at(0), Expected(kSeedUdReply, {{0, 150}}));
    CheckUdRecv(env, "ud.reply_recv[1]", wcs[1],
                RecvDone(0x902, IBV_WC_RECV, kGrhLen + 50, kImmUdReply), qp->qp_num, peer,
                b.at(kUdSlot), Expected(kSeedUdReply, {{256, 50}}));
  }
  CheckCqEmpty(rcq.get(), "ud.recv_cq");
  oob.Barrier("ud.done");
}

// ---------------------------------------------------------------------------
// Phase 5: completion channels and CQ events.

constexpr uint32_t kSeedChan = 0x5001;
constexpr uint32_t kImmChan = 0xc4a40001;

// The cq_context the program hands to ibv_create_cq; events must return it.
struct CqCookie {
  const char* name;
};

void WaitCqEvent(ibv_comp_channel* ch, ibv_cq* want_cq, void* want_ctx, const std::string& label) {
  pollfd pfd{ch->fd, POLLIN, 0};
  const int ready = poll(&pfd, 1, kEventTimeoutMs);
  if (ready <= 0) Die("%s: no CQ event within %d ms", label.c_str(), kEventTimeoutMs);
  ibv_cq* cq = nullptr;
  void* ctx = nullptr;
  if (ibv_get_cq_event(ch, &cq, &ctx) != 0) {
    Die("%s: ibv_get_cq_event: %s", label.c_str(), std::strerror(errno));
  }
  // Acked right away: ibv_destroy_cq waits for every event to be acked.
  ibv_ack_cq_events(cq, 1);
  Check(cq == want_cq, Sprintf("%s: event cq is ours: %s", label.c_str(), YesNo(cq == want_cq)));
  Check(ctx == want_ctx,
        Sprintf("%s: event cq_context is ours: %s", label.c_str(), YesNo(ctx == want_ctx)));
}

void ArmCq(ibv_cq* cq, bool solicited_only) {
  if (const int rc = ibv_req_notify_cq(cq, solicited_only ? 1 : 0); rc != 0) {
    Die("ibv_req_notify_cq: %s", std::strerror(rc));
  }
}

void RunChannelPhase(Env& env, Oob& oob) {
  Buffer b(env.pd.get(), kBufSize, kRcAccess);
  CompChannel ch(ibv_create_comp_channel(env.ctx.get()));
  if (!ch) Die("ibv_create_comp_channel: %s", std::strerror(errno));
  SetNonBlocking(ch->fd);
  CqCookie cookie{"channel cq"};
  Cq cq = CreateCq(env, ch.get(), &cookie);
  Check(cq->channel == ch.get() && cq->cq_context == &cookie,
        "chan.create_cq: channel and cq_context recorded: yes");
  Qp qp = CreateRcQp(env, cq.get(), cq.get());
  const uint32_t psn = NewPsn(env);
  if (env.server) {
    for (int i = 0; i < 3; ++i) PostRecv(qp.get(), 0xa01 + i, {b.Sge(i * kSlot, kSlot)});
  } else {
    Fill(b.at(kSrcOff), kSrcLen, kSeedChan);
  }
  ArmCq(cq.get(), false);
  const WireEndpoint peer = ExchangeAndConnect(env, oob, qp.get(), psn, &b, "chan.connected");

  // Round 1: any completion raises an event on both sides.
  if (!env.server) {
    ibv_sge sge = b.Sge(kSrcOff, 100);
    std::vector<ibv_send_wr> wr = {SendWr(0xa11, IBV_WR_SEND, &sge, 1)};
    PostSendChain(qp.get(), wr, "chan send");
    WaitCqEvent(ch.get(), cq.get(), &cookie, "chan.event_send");
    CheckWc("chan.send", PollCq(cq.get(), 1, "chan send")[0], SendDone(0xa11, IBV_WC_SEND, 100),
            qp->qp_num, peer.qpn);
  } else {
    WaitCqEvent(ch.get(), cq.get(), &cookie, "chan.event_recv");
    CheckWc("chan.recv", PollCq(cq.get(), 1, "chan recv")[0], RecvDone(0xa01, IBV_WC_RECV, 100),
            qp->qp_num, peer.qpn);
    CheckBytes("chan.recv bytes", b.at(0), Expected(kSeedChan, {{0, 100}}));
    ArmCq(cq.get(), true);
  }
  oob.Barrier("chan.round1");

  // Round 2: the server's CQ is armed for solicited completions only; the
  // second SEND carries IBV_SEND_SOLICITED.
  if (!env.server) {
    ibv_sge sge[2] = {b.Sge(kSrcOff + 100, 64), b.Sge(kSrcOff + 164, 32)};
    std::vector<ibv_send_wr> wrs = {
        SendWr(0xa12, IBV_WR_SEND, &sge[0], 1),
        SendWr(0xa13, IBV_WR_SEND_WITH_IMM, &sge[1], 1, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED)};
    wrs[1].imm_data = htonl(kImmChan);
    PostSendChain(qp.get(), wrs, "chan solicited");
    CheckWcs("chan.send_solicited", PollCq(cq.get(), 2, "chan solicited"),
             {SendDone(0xa12, IBV_WC_SEND, 64), SendDone(0xa13, IBV_WC_SEND, 32)}, qp->qp_num,
             peer.qpn);
  } else {
    WaitCqEvent(ch.get(), cq.get(), &cookie, "chan.event_solicited");
    CheckWcs("chan.recv_solicited", PollCq(cq.get(), 2, "chan solicited"),
             {RecvDone(0xa02, IBV_WC_RECV, 64), RecvDone(0xa03, IBV_WC_RECV, 32, kImmChan)},
             qp->qp_num, peer.qpn);
    CheckBytes("chan.recv_solicited bytes", b.at(kSlot), Expected(kSeedChan, {{100, 64}}));
  }
  oob.Barrier("chan.done");
}

// ---------------------------------------------------------------------------
// Phase 6: error paths. Each sub-test uses a fresh connection because an
// error moves the QPs to the error state.

constexpr uint32_t kSeedErr = 0x6001;

void ErrorBadLkey(Env& env, Oob& oob) {
  Buffer b(env.pd.get(), kBufSize, kRcAccess);
  Cq cq = CreateCq(env);
  Qp qp = CreateRcQp(env, cq.get(), cq.get());
  const uint32_t psn = NewPsn(env);
  const WireEndpoint peer = ExchangeAndConnect(env, oob, qp.get(), psn, &b, "err.lkey.connected");
  if (!env.server) {
    Fill(b.at(kSrcOff), kSrcLen, kSeedErr);
    ibv_sge bad = b.Sge(kSrcOff, 64);
    bad.lkey = kBadKey;
    ibv_sge good = b.Sge(kSrcOff, 64);
    std::vector<ibv_send_wr> wrs = {SendWr(0xb01, IBV_WR_SEND, &bad, 1),
                                    SendWr(0xb02, IBV_WR_SEND, &good, 1)};
    PostSendChain(qp.get(), wrs, "bad lkey");
    CheckWcs("err.bad_lkey", PollCq(cq.get(), 2, "bad lkey"),
             {ErrorDone(0xb01, std::nullopt), ErrorDone(0xb02, IBV_WC_WR_FLUSH_ERR)}, qp->qp_num,
             peer.qpn);
    const ibv_qp_state st = QueryQpState(qp.get());
    Check(st == IBV_QPS_ERR, Sprintf("err.bad_lkey: requester state=%s", QpStateName(st)));
  }
  oob.Barrier("err.lkey.done");
  if (env.server) {
    Line("err.bad_lkey: responder state=%s", QpStateName(QueryQpState(qp.get())));
  }
}

void ErrorBadRkey(Env& env, Oob& oob) {
  Buffer b(env.pd.get(), kBufSize, kRcAccess);
  Cq cq = CreateCq(env);
  Qp qp = CreateRcQp(env, cq.get(), cq.get());
  const uint32_t psn = NewPsn(env);
  const WireEndpoint peer = ExchangeAndConnect(env, oob, qp.get(), psn, &b, "err.rkey.connected");
  if (!env.server) {
    Fill(b.at(kSrcOff), kSrcLen, kSeedErr);
    ibv_sge sge = b.Sge(kSrcOff, 64);
    std::vector<ibv_send_wr> wr = {SendWr(0xb11, IBV_WR_RDMA_WRITE, &sge, 1)};
    wr[0].wr.rdma = {peer.addr + kRdmaOff, kBadKey};
    PostSendChain(qp.get(), wr, "bad rkey");
    CheckWc("err.bad_rkey", PollCq(cq.get(), 1, "bad rkey")[0],
            ErrorDone(0xb11, IBV_WC_REM_ACCESS_ERR), qp->qp_num, peer.qpn);
    const ibv_qp_state st = QueryQpState(qp.get());
    Check(st == IBV_QPS_ERR, Sprintf("err.bad_rkey: requester state=%s", QpStateName(st)));
  }
  oob.Barrier("err.rkey.done");
  if (env.server) {
    const uint8_t zero[64] = {};
    Check(std::memcmp(b.at(kRdmaOff), zero, sizeof(zero)) == 0,
          "err.bad_rkey: target bytes untouched: yes");
    Line("err.bad_rkey: responder state=%s", QpStateName(SettledQpState(qp.get())));
  }
}

// Local: transitions the QP state machine forbids.
void ErrorBadTransitions(Env& env) {
  Cq cq = CreateCq(env);
  ibv_qp_init_attr init = RcInitAttr(cq.get(), cq.get(), nullptr);
  Qp qp(ibv_create_qp(env.pd.get(), &init));  // stays in RESET
  if (!qp) Die("ibv_create_qp(RC): %s", std::strerror(errno));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  errno = 0;
  int rc = ibv_modify_qp(qp.get(), &a,
                         IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                             IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  int err = errno;
  Check(rc == EINVAL, Sprintf("err.modify RESET->RTS: rc=%s errno=%s", ErrnoName(rc).c_str(),
                              ErrnoName(err).c_str()));
  a = {};
  a.qp_state = IBV_QPS_INIT;  // missing the required PKEY_INDEX, PORT, ACCESS
  errno = 0;
  rc = ibv_modify_qp(qp.get(), &a, IBV_QP_STATE);
  err = errno;
  Check(rc == EINVAL, Sprintf("err.modify RESET->INIT without attrs: rc=%s errno=%s",
                              ErrnoName(rc).c_str(), ErrnoName(err).c_str()));
  const ibv_qp_state st = QueryQpState(qp.get());
  Check(st == IBV_QPS_RESET, Sprintf("err.modify: state stays %s", QpStateName(st)));
}

void RunErrorPhase(Env& env, Oob& oob) {
  ErrorBadLkey(env, oob);
  ErrorBadRkey(env, oob);
  ErrorBadTransitions(env);
  oob.Barrier("err.done");
}

// ---------------------------------------------------------------------------
// Setup and main.

[[noreturn]] void Usage() {
  std::fprintf(stderr,
               "usage: verbs_coverage [--port P] [--dev NAME] [--gid-idx N] "
               "[SERVER_HOST]\n");
  std::exit(2);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) Usage();
      return argv[++i];
    };
    if (a == "--port") {
      o.tcp_port = std::atoi(value());
    } else if (a == "--dev") {
      o.dev = value();
    } else if (a == "--gid-idx") {
      o.gid_idx = std::atoi(value());
    } else if (a.starts_with("-") || !o.server_host.empty()) {
      Usage();
    } else {
      o.server_host = a;
    }
  }
  if (o.tcp_port <= 0 || o.tcp_port > 65535 || o.gid_idx < 0) Usage();
  return o;
}

Context OpenDevice(const std::string& name) {
  int n = 0;
  DeviceList list(ibv_get_device_list(&n));
  if (!list) Die("ibv_get_device_list: %s", std::strerror(errno));
  for (int i = 0; i < n; ++i) {
    if (name == ibv_get_device_name(list.get()[i])) {
      Context ctx(ibv_open_device(list.get()[i]));
      if (!ctx) Die("ibv_open_device(%s): %s", name.c_str(), std::strerror(errno));
      return ctx;
    }
  }
  Die("no RDMA device named %s", name.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Env env;
  env.opt = ParseArgs(argc, argv);
  env.server = env.opt.server_host.empty();
  // PSNs differ from run to run (like ibv_rc_pingpong's); they never reach
  // the transcript.
  env.rng.seed(static_cast<uint32_t>(getpid()) ^
               static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Line("verbs_coverage: role=%s scenario=%u", env.server ? "server" : "client", kScenarioVersion);

  env.ctx = OpenDevice(env.opt.dev);
  env.pd.reset(ibv_alloc_pd(env.ctx.get()));
  if (!env.pd) Die("ibv_alloc_pd: %s", std::strerror(errno));
  RunDeviceQueries(env);

  Oob oob = env.server ? Oob::Listen(env.opt.tcp_port)
                       : Oob::Connect(env.opt.server_host, env.opt.tcp_port);
  const uint32_t peer_version = oob.Exchange(kScenarioVersion);
  if (peer_version != kScenarioVersion) Die("peer runs scenario %u", peer_version);

  RunRcPhase(env, oob);
  RunExPhase(env, oob);
  RunSrqPhase(env, oob);
  RunUdPhase(env, oob);
  RunChannelPhase(env, oob);
  RunErrorPhase(env, oob);
  oob.Barrier("all.done");

  env.pd.reset();
  env.ctx.reset();
  if (g_destroy_failed) Die("a verbs object failed to be destroyed");
  Line("verbs_coverage: all %d checks passed", g_checks);
  return 0;
}
