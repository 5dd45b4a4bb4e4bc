// What the workload programs share: messages, exit on setup failure, RAII
// owners of verbs objects and the TCP exchange of connection details (the
// programs close their sockets before any RDMA traffic).
#ifndef RDMAVIRT_TESTS_APPS_APP_COMMON_H_
#define RDMAVIRT_TESTS_APPS_APP_COMMON_H_

#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
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
#include <string>
#include <thread>
#include <utility>

namespace rdmavirt::apps {

// The program's name in its messages; main() sets it.
inline const char* program_name = "app";

inline std::string Vformat(const char* fmt, va_list ap) {
  va_list copy;
  va_copy(copy, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? n : 0, '\0');
  std::vsnprintf(out.data(), out.size() + 1, fmt, ap);
  return out;
}

inline std::string Sprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string Sprintf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = Vformat(fmt, ap);
  va_end(ap);
  return s;
}

// Setup failures: a test program, not a library, so it exits and the kernel
// releases every verbs resource with the process.
[[noreturn]] inline void Die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void Die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const std::string msg = Vformat(fmt, ap);
  va_end(ap);
  std::fflush(stdout);
  std::fprintf(stderr, "%s: FAIL: %s\n", program_name, msg.c_str());
  std::exit(1);
}

// ---------------------------------------------------------------------------
// Command lines and clocks.

// A program's arguments, one at a time: the next argument, its value, a
// number in a range. `usage` reports what is wrong and exits.
class ArgReader {
 public:
  using Usage = void (*)(const char* why, int status);
  ArgReader(int argc, char** argv, Usage usage) : argc_(argc), argv_(argv), usage_(usage) {}

  // Steps to the next argument; false after the last.
  bool Next() {
    if (++i_ >= argc_) return false;
    arg_ = argv_[i_];
    return true;
  }
  const std::string& arg() const { return arg_; }
  // The argument after this one.
  std::string Value() {
    if (i_ + 1 >= argc_) Fail(arg_ + " needs a value");
    return argv_[++i_];
  }
  double Number(double min, double max) {
    const std::string v = Value();
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || d < min || d > max)
      Fail(Sprintf("%s: %s is not a number in [%g, %g]", arg_.c_str(), v.c_str(), min, max));
    return d;
  }

 private:
  [[noreturn]] void Fail(const std::string& why) {
    usage_(why.c_str(), 2);
    std::exit(2);
  }

  int argc_;
  char** argv_;
  Usage usage_;
  int i_ = 0;
  std::string arg_;
};

// This process's own time running: a stop (a dump, a move) does not count.
class RunningClock {
 public:
  double Seconds() {
    const auto now = std::chrono::steady_clock::now();
    const double step = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    if (step < 1.0) total_ += step;  // a longer step is a stop
    return total_;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
  double total_ = 0;
};

// ---------------------------------------------------------------------------
// RAII owners. Destroy failures are only reported: they happen at exit.

template <auto kDestroy>
struct Destroyer {
  template <typename T>
  void operator()(T* p) const {
    if (const int rc = kDestroy(p); rc != 0) {
      std::fprintf(stderr, "%s: destroying a verbs object: %s\n", program_name, std::strerror(rc));
    }
  }
};
struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};
struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

using DeviceList = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using Context = std::unique_ptr<ibv_context, Destroyer<&ibv_close_device>>;
using Pd = std::unique_ptr<ibv_pd, Destroyer<&ibv_dealloc_pd>>;
using Mr = std::unique_ptr<ibv_mr, Destroyer<&ibv_dereg_mr>>;
using Cq = std::unique_ptr<ibv_cq, Destroyer<&ibv_destroy_cq>>;
using Qp = std::unique_ptr<ibv_qp, Destroyer<&ibv_destroy_qp>>;
using Ah = std::unique_ptr<ibv_ah, Destroyer<&ibv_destroy_ah>>;
using Srq = std::unique_ptr<ibv_srq, Destroyer<&ibv_destroy_srq>>;

// The device named `name` (the first one if empty), open.
inline Context OpenDevice(const std::string& name) {
  int num = 0;
  DeviceList list(ibv_get_device_list(&num));
  if (!list || num == 0) Die("no RDMA device");
  ibv_device* dev = nullptr;
  for (int i = 0; i < num && dev == nullptr; ++i)
    if (name.empty() || name == ibv_get_device_name(list.get()[i])) dev = list.get()[i];
  if (dev == nullptr) Die("no RDMA device named %s", name.c_str());
  Context ctx(ibv_open_device(dev));
  if (!ctx) Die("ibv_open_device: %s", std::strerror(errno));
  return ctx;
}

// Loopback pairs (two RC QPs of one process connected to each other on
// port 1 of one device: rxe loops them back, no peer host needed).

// The first RoCE v2 GID of an IPv4 address (::ffff:a.b.c.d), or -1.
inline int Ipv4V2GidIndex(ibv_context* ctx, int table_len) {
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, 1, i, &e, 0) != 0) continue;
    static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && memcmp(e.gid.raw, kMapped, 12) == 0) return i;
  }
  return -1;
}

inline void LoopbackToRts(ibv_qp* qp, uint32_t dest_qpn, const ibv_gid& dgid, int sgid_index) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    Die("INIT: %s", strerror(rc));
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest_qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = dgid;
  a.ah_attr.grh.sgid_index = static_cast<uint8_t>(sgid_index);
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.port_num = 1;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    Die("RTR: %s", strerror(rc));
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                 IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    Die("RTS: %s", strerror(rc));
}

class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&&) = delete;
  ~UniqueFd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

inline void SendAll(int fd, const void* data, size_t len) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    const ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) Die("TCP send to the peer: %s", std::strerror(errno));
    p += n;
    len -= static_cast<size_t>(n);
  }
}

inline void RecvAll(int fd, void* data, size_t len) {
  auto* p = static_cast<uint8_t*>(data);
  while (len > 0) {
    const ssize_t n = recv(fd, p, len, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) Die("the peer closed the TCP connection (did it fail?)");
    if (n < 0) Die("TCP receive from the peer: %s", std::strerror(errno));
    p += n;
    len -= static_cast<size_t>(n);
  }
}

inline UniqueFd WithTimeouts(UniqueFd fd) {
  const timeval tv{300, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

// One connection on `port`; the listening socket is closed on return.
inline UniqueFd AcceptOne(int port) {
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
  if (poll(&pfd, 1, 300 * 1000) <= 0) Die("no client connected within 300 s");
  UniqueFd fd(accept(ls.get(), nullptr, nullptr));
  if (fd.get() < 0) Die("accept: %s", std::strerror(errno));
  return WithTimeouts(std::move(fd));
}

// The server may start after the client: retries for 120 s.
inline UniqueFd ConnectTo(const std::string& host, int port) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::string error = "no address";
  while (std::chrono::steady_clock::now() < deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res)) {
      error = gai_strerror(rc);
    }
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      UniqueFd fd(socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
      if (fd.get() >= 0 && connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) {
        freeaddrinfo(res);
        return WithTimeouts(std::move(fd));
      }
      error = std::strerror(errno);
    }
    if (res != nullptr) freeaddrinfo(res);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  Die("cannot connect to %s:%d: %s", host.c_str(), port, error.c_str());
}

}  // namespace rdmavirt::apps

#endif  // RDMAVIRT_TESTS_APPS_APP_COMMON_H_
