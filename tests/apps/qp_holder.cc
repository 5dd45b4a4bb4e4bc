// qp_holder: a verbs process of a chosen size, for measuring what a move
// costs as the number of connected QPs and the registered memory grow.
//
// The client and the server each create --qps RC QPs and connect them in
// pairs (details exchanged over TCP, the socket closed before any RDMA).
// The client registers --mr-mib MiB, fills it with a pattern, and for
// --seconds of its own running time writes 64 bytes with RDMA WRITE on each
// QP in turn, every --interval-ms, into the server's buffer, waiting for
// each completion: every QP is used again after a move. At the end it
// prints one JSON object (writes, errors) and exits 0 when nothing failed.
//
// --heap-mib H: the client also holds H MiB that are not registered, and
// rewrites --dirty-mib-s MiB of them per second of its running time, page
// after page (what pre-copy must chase). Each page's first word counts the
// times it was written, the rest holds a pattern; at the end every page is
// checked (heap_bad_pages in the JSON).
//
// --threads T: the client writes from T threads, thread t on QPs t, t+T,
// ... with a CQ of its own, so that several threads of one process ring the
// device's doorbell. The heap is dirtied by the first thread only. About
// once a second of running time the client prints each thread's writes so
// far ("writes by thread: W0 W1 ..."); so does the JSON. With
// --block-signals the program blocks every signal first thing, before any
// verbs call (with pthread_sigmask, as programs that take signals on one
// thread do), and its first thread opens SIGTERM and SIGINT again once
// the others have started: they keep every signal blocked.
//
// --no-rdma: the client only allocates and fills --mr-mib MiB (and the
// heap, dirtied the same way) and runs for --seconds: the same memory with
// no verbs, for a plain baseline. With --open-device it also opens the
// device, allocates a PD (no QP, no MR) and queries its port every 20 ms,
// so that the migrator moves it through the same path as an RDMA process.
//
// SIGTERM or SIGINT end the client early, with the same checks and JSON.
//
//   qp_holder --server [--port P] [--qps N] [--seconds S]
//   qp_holder --connect HOST [--port P] [--qps N] [--mr-mib M] [--seconds S]
//             [--interval-ms MS] [--device rxe0] [--gid-index 1]
//             [--heap-mib H] [--dirty-mib-s D] [--threads T [--block-signals]]
//             [--no-rdma [--open-device]]
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/apps/app_common.h"

namespace {

using namespace rdmavirt::apps;  // NOLINT: the programs' shared helpers

constexpr uint8_t kIbPort = 1;
constexpr uint32_t kWriteBytes = 64;
constexpr uint32_t kMaxQps = 4096;

struct Options {
  bool server = false;
  std::string host;
  int port = 18950;
  uint32_t qps = 1;
  uint64_t mr_mib = 1;
  double seconds = 60;
  uint32_t interval_ms = 20;
  std::string device;
  int gid_index = 1;
  bool no_rdma = false;
  bool open_device = false;
  uint64_t heap_mib = 0;
  double dirty_mib_s = 0;
  uint32_t threads = 1;
  bool block_signals = false;
};

volatile sig_atomic_t g_stop = 0;

void OnStop(int) { g_stop = 1; }

[[noreturn]] void Usage(const char* why, int status = 2) {
  std::fprintf(status == 0 ? stdout : stderr,
               "qp_holder: %s\n"
               "usage: qp_holder --server|--connect HOST [--port P] [--qps N] [--mr-mib M]\n"
               "                 [--seconds S] [--interval-ms MS] [--device NAME]\n"
               "                 [--gid-index I] [--heap-mib H] [--dirty-mib-s D]\n"
               "                 [--threads T [--block-signals]] [--no-rdma [--open-device]]\n",
               why);
  std::exit(status);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  bool role = false;
  ArgReader r(argc, argv, Usage);
  while (r.Next()) {
    const std::string& a = r.arg();
    if (a == "--server") {
      o.server = true;
      role = true;
    } else if (a == "--connect") {
      o.host = r.Value();
      role = true;
    } else if (a == "--port") {
      o.port = static_cast<int>(r.Number(1, 65535));
    } else if (a == "--qps") {
      o.qps = static_cast<uint32_t>(r.Number(1, kMaxQps));
    } else if (a == "--mr-mib") {
      o.mr_mib = static_cast<uint64_t>(r.Number(1, 65536));
    } else if (a == "--seconds") {
      o.seconds = r.Number(1, 86400);
    } else if (a == "--interval-ms") {
      o.interval_ms = static_cast<uint32_t>(r.Number(0, 60000));
    } else if (a == "--device") {
      o.device = r.Value();
    } else if (a == "--gid-index") {
      o.gid_index = static_cast<int>(r.Number(0, 255));
    } else if (a == "--no-rdma") {
      o.no_rdma = true;
    } else if (a == "--open-device") {
      o.open_device = true;
    } else if (a == "--heap-mib") {
      o.heap_mib = static_cast<uint64_t>(r.Number(0, 65536));
    } else if (a == "--dirty-mib-s") {
      o.dirty_mib_s = r.Number(0, 65536);
    } else if (a == "--threads") {
      o.threads = static_cast<uint32_t>(r.Number(1, 64));
    } else if (a == "--block-signals") {
      o.block_signals = true;
    } else if (a == "-h" || a == "--help") {
      Usage("a verbs process of a chosen size: N connected RC QPs, M MiB registered", 0);
    } else {
      Usage(("unknown argument " + a).c_str());
    }
  }
  if (!role) Usage("--server or --connect HOST is required");
  if (o.server && (o.no_rdma || o.heap_mib)) Usage("--no-rdma and --heap-mib are for the client");
  if (o.open_device && !o.no_rdma) Usage("--open-device goes with --no-rdma");
  if (o.dirty_mib_s > 0 && o.heap_mib == 0) Usage("--dirty-mib-s needs --heap-mib");
  if (o.threads > o.qps) Usage("--threads may not exceed --qps: each thread writes on its own QPs");
  if (o.threads > 1 && o.no_rdma) Usage("--threads is for RDMA clients");
  if (o.block_signals && o.threads < 2) Usage("--block-signals goes with --threads 2 or more");
  return o;
}

// What each side tells the other: its QPNs, its GID, its buffer.
struct Header {
  uint32_t qps;
  uint32_t rkey;
  uint64_t addr;
  uint8_t gid[16];
};

// Memory that is not registered, rewritten at a fixed rate. Page k holds
// in its first word the number of times it was written (the fill is the
// first), and in the rest the byte Fill(k).
class Heap {
 public:
  Heap(uint64_t mib, double dirty_mib_s)
      : pages_((mib << 20) / kPage), pages_per_s_(dirty_mib_s * (1 << 20) / kPage) {
    if (pages_ == 0) return;
    p_ = static_cast<uint8_t*>(
        mmap(nullptr, pages_ * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (p_ == MAP_FAILED) Die("mmap %" PRIu64 " MiB: %s", mib, std::strerror(errno));
    for (size_t k = 0; k < pages_; ++k) {
      uint8_t* page = p_ + k * kPage;
      std::memset(page, Fill(k), kPage);
      const uint64_t once = 1;
      std::memcpy(page, &once, sizeof(once));
    }
  }

  // Writes the pages due by `running_seconds` of running time, in order,
  // wrapping around: a stop (a dump, a move) is not caught up.
  void DirtyUntil(double running_seconds) {
    if (pages_ == 0) return;
    const auto due = static_cast<uint64_t>(running_seconds * pages_per_s_);
    for (; written_ < due; ++written_) {
      uint8_t* page = p_ + (written_ % pages_) * kPage;
      uint64_t n;
      std::memcpy(&n, page, sizeof(n));
      ++n;
      std::memcpy(page, &n, sizeof(n));
    }
  }

  // Pages whose count or pattern is not what was written.
  uint64_t BadPages() const {
    uint64_t bad = 0;
    uint8_t expect[kPage];
    for (size_t k = 0; k < pages_; ++k) {
      const uint8_t* page = p_ + k * kPage;
      const uint64_t times = 1 + written_ / pages_ + (k < written_ % pages_ ? 1 : 0);
      uint64_t n;
      std::memcpy(&n, page, sizeof(n));
      std::memset(expect, Fill(k), kPage);
      if (n != times || std::memcmp(page + sizeof(n), expect + sizeof(n), kPage - sizeof(n)) != 0)
        ++bad;
    }
    return bad;
  }

  uint64_t mib() const { return (pages_ * kPage) >> 20; }
  uint64_t written() const { return written_; }

 private:
  static constexpr size_t kPage = 4096;
  static uint8_t Fill(size_t k) { return static_cast<uint8_t>(k % 251 + 1); }

  size_t pages_;
  double pages_per_s_;
  uint8_t* p_ = nullptr;
  uint64_t written_ = 0;
};

// The heap's part of the closing JSON object.
std::string HeapJson(const Heap& heap, uint64_t bad) {
  return Sprintf(", \"heap_mib\": %" PRIu64 ", \"heap_pages_written\": %" PRIu64
                 ", \"heap_bad_pages\": %" PRIu64,
                 heap.mib(), heap.written(), bad);
}

int RunWithoutRdma(const Options& o) {
  const size_t bytes = o.mr_mib << 20;
  auto* p = static_cast<uint8_t*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (p == MAP_FAILED) Die("mmap %zu bytes: %s", bytes, std::strerror(errno));
  for (size_t i = 0; i < bytes; i += 8) std::memcpy(p + i, &i, 8);
  Heap heap(o.heap_mib, o.dirty_mib_s);
  Context ctx;
  Pd pd;
  if (o.open_device) {
    ctx = OpenDevice(o.device);
    pd.reset(ibv_alloc_pd(ctx.get()));
    if (!pd) Die("ibv_alloc_pd: %s", std::strerror(errno));
  }
  std::printf("qp_holder: client pid %d: no RDMA%s, %zu bytes, heap %" PRIu64 " MiB; connected\n",
              static_cast<int>(getpid()), o.open_device ? " (device open)" : "", bytes, heap.mib());
  RunningClock clock;
  for (double t = 0; (t = clock.Seconds()) < o.seconds && !g_stop;) {
    heap.DirtyUntil(t);
    // A verb now and then, as a process that uses its device makes: after
    // a restore the shim runs its steps on the first application thread
    // that calls one (docs/shim.md), else only after waiting for one.
    ibv_port_attr port{};
    if (ctx && ibv_query_port(ctx.get(), kIbPort, &port) != 0)
      Die("ibv_query_port: %s", std::strerror(errno));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const uint64_t bad = heap.BadPages();
  std::printf("{\"ok\": %s, \"qps\": 0, \"mr_mib\": %" PRIu64 "%s}\n", bad ? "false" : "true",
              o.mr_mib, HeapJson(heap, bad).c_str());
  return bad ? 1 : 0;
}

int Run(const Options& o) {
  Context ctx = OpenDevice(o.device);
  Pd pd(ibv_alloc_pd(ctx.get()));
  if (!pd) Die("ibv_alloc_pd: %s", std::strerror(errno));
  const size_t bytes = o.server ? size_t{o.qps} * kWriteBytes : (o.mr_mib << 20);
  auto* buf = static_cast<uint8_t*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (buf == MAP_FAILED) Die("mmap %zu bytes: %s", bytes, std::strerror(errno));
  for (size_t i = 0; i + 8 <= bytes; i += 8) std::memcpy(buf + i, &i, 8);
  Mr mr(ibv_reg_mr(pd.get(), buf, bytes,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ));
  if (!mr) Die("ibv_reg_mr of %zu bytes: %s", bytes, std::strerror(errno));
  Heap heap(o.heap_mib, o.dirty_mib_s);
  std::vector<Cq> cqs;
  for (uint32_t t = 0; t < o.threads; ++t) {
    cqs.emplace_back(ibv_create_cq(ctx.get(), static_cast<int>(o.qps) + 16, nullptr, nullptr, 0));
    if (!cqs.back()) Die("ibv_create_cq: %s", std::strerror(errno));
  }
  std::vector<Qp> qps;
  std::vector<uint32_t> mine;
  for (uint32_t i = 0; i < o.qps; ++i) {
    ibv_qp_init_attr ia{};
    ia.send_cq = cqs[i % o.threads].get();
    ia.recv_cq = cqs[i % o.threads].get();
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 4;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    qps.emplace_back(ibv_create_qp(pd.get(), &ia));
    if (!qps.back()) Die("ibv_create_qp %u of %u: %s", i + 1, o.qps, std::strerror(errno));
    mine.push_back(qps.back()->qp_num);
  }
  Header me{o.qps, mr->rkey, reinterpret_cast<uintptr_t>(buf), {}};
  ibv_gid gid;
  if (ibv_query_gid(ctx.get(), kIbPort, o.gid_index, &gid) != 0)
    Die("ibv_query_gid index %d: %s", o.gid_index, std::strerror(errno));
  std::memcpy(me.gid, gid.raw, 16);
  Header peer{};
  std::vector<uint32_t> theirs(o.qps);
  {
    UniqueFd fd = o.server ? AcceptOne(o.port) : ConnectTo(o.host, o.port);
    SendAll(fd.get(), &me, sizeof(me));
    SendAll(fd.get(), mine.data(), mine.size() * sizeof(uint32_t));
    RecvAll(fd.get(), &peer, sizeof(peer));
    if (peer.qps != o.qps) Die("the peer has %u QPs, this side %u", peer.qps, o.qps);
    RecvAll(fd.get(), theirs.data(), theirs.size() * sizeof(uint32_t));
  }  // the socket is closed: nothing but RDMA from here on
  for (uint32_t i = 0; i < o.qps; ++i) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = kIbPort;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (const int rc = ibv_modify_qp(
            qps[i].get(), &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
      Die("QP %u to INIT: %s", i, std::strerror(rc));
    a = {};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = theirs[i];
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = kIbPort;
    std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(o.gid_index);
    a.ah_attr.grh.hop_limit = 1;
    if (const int rc =
            ibv_modify_qp(qps[i].get(), &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      Die("QP %u to RTR: %s", i, std::strerror(rc));
    a = {};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    if (const int rc =
            ibv_modify_qp(qps[i].get(), &a,
                          IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                              IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
      Die("QP %u to RTS: %s", i, std::strerror(rc));
  }
  std::printf("qp_holder: %s pid %d: %u QPs connected, %zu bytes registered, heap %" PRIu64
              " MiB\n",
              o.server ? "server" : "client", static_cast<int>(getpid()), o.qps, bytes, heap.mib());
  std::fflush(stdout);

  uint64_t writes = 0, errors = 0;
  std::vector<uint64_t> writes_by_thread(o.threads);
  if (o.server) {
    // The client writes; the server only keeps its QPs (a little longer).
    RunningClock clock;
    while (clock.Seconds() < o.seconds + 120 && !g_stop)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
  } else {
    std::mutex report_mu;
    std::vector<std::atomic<uint64_t>> so_far(o.threads);
    double shown = 0;
    // Thread t writes on QPs t, t+T, ... in turn and polls its own CQ.
    auto writer = [&](uint32_t t) {
      RunningClock clock;
      uint64_t mine_written = 0, mine_failed = 0;
      for (uint32_t i = t; !g_stop; i = (i + o.threads) % o.qps) {
        const double now = clock.Seconds();
        if (now >= o.seconds) break;
        if (t == 0) {
          heap.DirtyUntil(now);
          if (now >= shown + 1) {
            shown = now;
            std::string line;
            for (const auto& w : so_far) line += Sprintf(" %" PRIu64, w.load());
            std::printf("qp_holder: writes by thread:%s\n", line.c_str());
          }
        }
        ibv_sge sge{reinterpret_cast<uintptr_t>(buf) + (i * kWriteBytes) % bytes, kWriteBytes,
                    mr->lkey};
        ibv_send_wr wr{};
        wr.wr_id = i;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr.rdma.remote_addr = peer.addr + uint64_t{i} * kWriteBytes;
        wr.wr.rdma.rkey = peer.rkey;
        ibv_send_wr* bad = nullptr;
        if (const int rc = ibv_post_send(qps[i].get(), &wr, &bad))
          Die("thread %u: ibv_post_send on QP %u: %s", t, i, std::strerror(rc));
        ibv_wc wc{};
        int n = 0;
        while ((n = ibv_poll_cq(cqs[t].get(), 1, &wc)) == 0) std::this_thread::yield();
        if (n < 0) Die("ibv_poll_cq: %d", n);
        if (wc.status != IBV_WC_SUCCESS || wc.wr_id != i) {
          ++mine_failed;
          std::fprintf(stderr, "qp_holder: thread %u, QP %u: %s (wr_id %" PRIu64 ")\n", t, i,
                       ibv_wc_status_str(wc.status), wc.wr_id);
          break;  // that QP is in the error state now
        }
        ++mine_written;
        so_far[t].store(mine_written, std::memory_order_relaxed);
        if (o.interval_ms) std::this_thread::sleep_for(std::chrono::milliseconds(o.interval_ms));
      }
      std::lock_guard<std::mutex> lock(report_mu);
      writes += mine_written;
      errors += mine_failed;
      writes_by_thread[t] = mine_written;
    };
    std::vector<std::thread> others;
    for (uint32_t t = 1; t < o.threads; ++t) others.emplace_back(writer, t);
    if (o.block_signals) {
      sigset_t stop;
      sigemptyset(&stop);
      sigaddset(&stop, SIGTERM);
      sigaddset(&stop, SIGINT);
      if (const int rc = pthread_sigmask(SIG_UNBLOCK, &stop, nullptr))
        Die("pthread_sigmask: %s", std::strerror(rc));
    }
    writer(0);
    for (std::thread& th : others) th.join();
  }
  std::string by_thread;
  for (uint64_t w : writes_by_thread)
    by_thread += Sprintf("%s%" PRIu64, by_thread.empty() ? "" : ", ", w);
  const uint64_t bad = heap.BadPages();
  std::printf("{\"ok\": %s, \"qps\": %u, \"mr_mib\": %" PRIu64 ", \"writes\": %" PRIu64
              ", \"writes_by_thread\": [%s], \"errors\": %" PRIu64 "%s}\n",
              errors == 0 && bad == 0 ? "true" : "false", o.qps, o.server ? 0 : o.mr_mib, writes,
              by_thread.c_str(), errors, HeapJson(heap, bad).c_str());
  return errors == 0 && bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  program_name = "qp_holder";
  const Options o = ParseArgs(argc, argv);
  if (o.block_signals) {
    sigset_t all;
    sigfillset(&all);
    if (const int rc = pthread_sigmask(SIG_BLOCK, &all, nullptr))
      Die("pthread_sigmask: %s", std::strerror(rc));
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  struct sigaction sa {};
  sa.sa_handler = OnStop;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  return o.no_rdma ? RunWithoutRdma(o) : Run(o);
}
