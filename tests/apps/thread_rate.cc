// thread_rate: SENDs per second of N threads, each posting and polling on
// its own loopback QP pair and its own CQ, on one device of one host. The
// same binary runs natively and under the shim, so their rates show what
// the shim costs threads that share a process but nothing else
// (tools/bench-lab-shim --threads).
//
//   thread_rate [-d DEVICE] [-t THREADS] [-s SECONDS] [-w WINDOW]
//
// Each thread keeps WINDOW signaled SENDs of 64 bytes in flight, each with
// a receive posted for it, re-posting both as their completions come, and
// counts the SENDs completed while every thread runs. Any completion
// with an error ends the program with exit 1. Prints one line per thread
// and the total: "total: N sends in S s = R sends/s".
#include <infiniband/verbs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/apps/app_common.h"

namespace {

using rdmavirt::apps::Die;

constexpr uint32_t kMsg = 64;
constexpr uint64_t kRecvBit = 1ull << 63;

struct Options {
  std::string device = "rxe0";
  int threads = 2;
  double seconds = 5;
  int window = 16;
};

// What every thread starts from and reports to.
struct Run {
  ibv_context* ctx;
  ibv_pd* pd;
  ibv_gid gid;
  int sgid;
  Options o;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> stop{false};
};

void PostRecv(ibv_qp* qp, ibv_mr* mr, uint64_t id) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(mr->addr), kMsg, mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = id | kRecvBit;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (int rc = ibv_post_recv(qp, &wr, &bad)) Die("ibv_post_recv: %s", strerror(rc));
}

void PostSend(ibv_qp* qp, ibv_mr* mr, uint64_t id) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(mr->addr) + kMsg, kMsg, mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp, &wr, &bad)) Die("ibv_post_send: %s", strerror(rc));
}

void Worker(Run* run, int index, uint64_t* sends_out) {
  const Options& o = run->o;
  const int depth = o.window + 1;
  rdmavirt::apps::Cq cq(ibv_create_cq(run->ctx, 2 * depth, nullptr, nullptr, 0));
  if (!cq) Die("ibv_create_cq: %s", strerror(errno));
  std::vector<uint8_t> buf(2 * kMsg);
  rdmavirt::apps::Mr mr(ibv_reg_mr(run->pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!mr) Die("ibv_reg_mr: %s", strerror(errno));
  ibv_qp_init_attr init{};
  init.send_cq = cq.get();
  init.recv_cq = cq.get();
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = static_cast<uint32_t>(depth);
  init.cap.max_recv_wr = static_cast<uint32_t>(depth);
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  rdmavirt::apps::Qp a(ibv_create_qp(run->pd, &init));
  rdmavirt::apps::Qp b(ibv_create_qp(run->pd, &init));
  if (!a || !b) Die("ibv_create_qp: %s", strerror(errno));
  rdmavirt::apps::LoopbackToRts(a.get(), b->qp_num, run->gid, run->sgid);
  rdmavirt::apps::LoopbackToRts(b.get(), a->qp_num, run->gid, run->sgid);

  run->ready.fetch_add(1);
  while (!run->go.load()) std::this_thread::yield();
  for (int i = 0; i < o.window; ++i) {
    PostRecv(b.get(), mr.get(), static_cast<uint64_t>(i));
    PostSend(a.get(), mr.get(), static_cast<uint64_t>(i));
  }
  int in_flight = o.window;  // SENDs and receives not yet completed, each
  int receives = o.window;
  uint64_t sends = 0;
  ibv_wc wc[16];
  while (in_flight > 0 || receives > 0) {
    const int n = ibv_poll_cq(cq.get(), 16, wc);
    if (n < 0) Die("thread %d: ibv_poll_cq: %d", index, n);
    const bool more = !run->stop.load(std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS)
        Die("thread %d: completion %s (wr_id %llu)", index, ibv_wc_status_str(wc[i].status),
            static_cast<unsigned long long>(wc[i].wr_id));
      if (wc[i].wr_id & kRecvBit) {
        --receives;
        continue;
      }
      --in_flight;
      ++sends;
      if (more) {
        PostRecv(b.get(), mr.get(), wc[i].wr_id);
        PostSend(a.get(), mr.get(), wc[i].wr_id);
        ++in_flight;
        ++receives;
      }
    }
  }
  *sends_out = sends;
}

}  // namespace

int main(int argc, char** argv) {
  rdmavirt::apps::program_name = "thread_rate";
  Options o;
  for (int c; (c = getopt(argc, argv, "d:t:s:w:h")) != -1;) {
    switch (c) {
      case 'd':
        o.device = optarg;
        break;
      case 't':
        o.threads = atoi(optarg);
        break;
      case 's':
        o.seconds = atof(optarg);
        break;
      case 'w':
        o.window = atoi(optarg);
        break;
      default:
        fprintf(stderr, "usage: thread_rate [-d DEVICE] [-t THREADS] [-s SECONDS] [-w WINDOW]\n");
        return c == 'h' ? 0 : 2;
    }
  }
  if (o.threads < 1 || o.threads > 64 || o.seconds <= 0 || o.window < 1 || o.window > 1024)
    Die("threads 1..64, seconds > 0, window 1..1024");
  int num = 0;
  rdmavirt::apps::DeviceList list(ibv_get_device_list(&num));
  ibv_device* dev = nullptr;
  for (int i = 0; list && i < num; ++i)
    if (o.device == ibv_get_device_name(list.get()[i])) dev = list.get()[i];
  if (dev == nullptr) Die("no device %s", o.device.c_str());
  rdmavirt::apps::Context ctx(ibv_open_device(dev));
  if (!ctx) Die("ibv_open_device: %s", strerror(errno));
  rdmavirt::apps::Pd pd(ibv_alloc_pd(ctx.get()));
  if (!pd) Die("ibv_alloc_pd: %s", strerror(errno));
  ibv_port_attr port{};
  if (ibv_query_port(ctx.get(), 1, &port) != 0) Die("ibv_query_port: %s", strerror(errno));

  Run run;
  run.ctx = ctx.get();
  run.pd = pd.get();
  run.o = o;
  run.sgid = rdmavirt::apps::Ipv4V2GidIndex(ctx.get(), port.gid_tbl_len);
  if (run.sgid < 0) Die("no RoCE v2 GID of an IPv4 address on %s", o.device.c_str());
  if (ibv_query_gid(ctx.get(), 1, run.sgid, &run.gid) != 0) Die("ibv_query_gid");

  std::vector<uint64_t> counts(static_cast<size_t>(o.threads));
  std::vector<std::thread> threads;
  for (int i = 0; i < o.threads; ++i) threads.emplace_back(Worker, &run, i, &counts[i]);
  while (run.ready.load() < o.threads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = std::chrono::steady_clock::now();
  run.go = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
  run.stop = true;
  for (std::thread& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t total = 0;
  for (int i = 0; i < o.threads; ++i) {
    printf("thread %d: %llu sends\n", i, static_cast<unsigned long long>(counts[i]));
    total += counts[i];
  }
  printf("total: %llu sends in %.3f s = %.0f sends/s\n", static_cast<unsigned long long>(total), s,
         static_cast<double>(total) / s);
  return 0;
}
