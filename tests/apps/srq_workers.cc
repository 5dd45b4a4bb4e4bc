// srq_workers: worker threads that share one SRQ, each replenishing it as
// its receives complete: a process whose threads post to the same receive
// queue at once, for moves of such a process.
//
// The server creates one SRQ holding --depth receives (a 64-byte slot
// each, the slot's number its wr_id) and --threads RC QPs attached to it;
// QP t's completions go to a CQ of its own, which worker thread t polls.
// The workers post the slots first (worker t slots t, t + T, ..., all at
// once, so that one takes the queue from another while it posts). For
// every receive a worker
// checks the message (its QP, its sequence number, the next one on that
// QP, and its pattern) and posts the slot back to the SRQ from its own
// thread. The client sends SENDs on the QPs in turn, at most --window in
// flight per QP, until SIGTERM or SIGINT (or --seconds of its running
// time), then one last message per QP that says how many came before it.
// A worker ends on its QP's last message. About once a second of running
// time the server prints "received by thread: R0 R1 ..." and, at the end,
// one JSON object: ok, received_by_thread, reposts_by_thread, bad,
// receives and stale_slots (slots not used again within 4 * depth
// receives: receives the SRQ lost; a receive posted twice shows as
// messages overwritten in their slot before they were checked, in bad);
// the client one with sent_by_qp and errors. Exit status 0 iff nothing was
// lost, repeated, reordered or corrupted (server) or failed (client).
//
// With --ud (both sides) the QPs are UD: each receive slot starts with the
// 40-byte GRH area, and each worker also checks whom the datagram says it
// is from: the completion's src_qp must be the client's QP t and the GRH's
// source address the client's GID, as the client knows them (a receive
// completion whose buffer the shim mistook shows the sender's physical
// address after the sender moved: wrong_sender). UD may drop datagrams,
// so sequence numbers may skip (counted in `skipped`), never go back; the
// client's last message goes 50 times, and counts are not compared.
//
//   srq_workers --server [--port P] [--threads T] [--depth D] [--ud]
//   srq_workers --connect HOST [--port P] [--threads T] [--window W]
//               [--seconds S] [--ud]
//   common: [--device rxe0] [--gid-index 1]
#include <infiniband/verbs.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/apps/app_common.h"

namespace {

using namespace rdmavirt::apps;  // NOLINT: the programs' shared helpers

constexpr uint8_t kIbPort = 1;
constexpr uint32_t kMsg = 64;
constexpr uint32_t kMagic = 0x5352510a;
constexpr uint64_t kLast = ~uint64_t{0};
constexpr uint32_t kMaxThreads = 16;
constexpr uint32_t kGrh = 40;  // a UD receive's GRH area
constexpr uint32_t kQkey = 0x5352510b;

struct Options {
  bool server = false;
  std::string host;
  int port = 18960;
  bool ud = false;
  uint32_t threads = 3;
  uint32_t depth = 256;
  uint32_t window = 8;
  double seconds = 3600;
  std::string device;
  int gid_index = 1;
};

volatile sig_atomic_t g_stop = 0;
void OnStop(int) { g_stop = 1; }

[[noreturn]] void Usage(const char* why, int status = 2) {
  std::fprintf(status == 0 ? stdout : stderr,
               "srq_workers: %s\n"
               "usage: srq_workers --server|--connect HOST [--port P] [--threads T]\n"
               "                   [--depth D] [--window W] [--seconds S] [--device NAME]\n"
               "                   [--gid-index I] [--ud]\n",
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
    } else if (a == "--ud") {
      o.ud = true;
    } else if (a == "--threads") {
      o.threads = static_cast<uint32_t>(r.Number(1, kMaxThreads));
    } else if (a == "--depth") {
      o.depth = static_cast<uint32_t>(r.Number(1, 4096));
    } else if (a == "--window") {
      o.window = static_cast<uint32_t>(r.Number(1, 64));
    } else if (a == "--seconds") {
      o.seconds = r.Number(1, 86400);
    } else if (a == "--device") {
      o.device = r.Value();
    } else if (a == "--gid-index") {
      o.gid_index = static_cast<int>(r.Number(0, 255));
    } else if (a == "-h" || a == "--help") {
      Usage("worker threads sharing one SRQ, checking every message", 0);
    } else {
      Usage(("unknown argument " + a).c_str());
    }
  }
  if (!role) Usage("--server or --connect HOST is required");
  return o;
}

// A message: its QP, its sequence number on that QP (kLast for the last
// one, whose `count` says how many came before it), and a pattern that
// follows from both.
struct Message {
  uint32_t qp;
  uint32_t magic;
  uint64_t seq;
  uint64_t count;
  uint8_t pattern[kMsg - 24];
};
static_assert(sizeof(Message) == kMsg);

uint8_t PatternByte(uint32_t qp, uint64_t seq, size_t i) {
  return static_cast<uint8_t>((seq * 131 + qp * 31 + i * 7) & 0xff);
}
void Fill(Message* m, uint32_t qp, uint64_t seq, uint64_t count) {
  m->qp = qp;
  m->magic = kMagic;
  m->seq = seq;
  m->count = count;
  for (size_t i = 0; i < sizeof(m->pattern); ++i) m->pattern[i] = PatternByte(qp, seq, i);
}
bool PatternOk(const Message& m) {
  for (size_t i = 0; i < sizeof(m.pattern); ++i)
    if (m.pattern[i] != PatternByte(m.qp, m.seq, i)) return false;
  return true;
}

// What each side tells the other.
struct Header {
  uint32_t threads;
  uint32_t ud;
  uint32_t qpns[kMaxThreads];
  uint8_t gid[16];
};

// A receive slot: the message, after the GRH area on a UD QP.
uint32_t SlotBytes(const Options& o) { return o.ud ? kGrh + kMsg : kMsg; }

// A UD QP to RTS: it needs no peer.
void UdToRts(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = kIbPort;
  a.qkey = kQkey;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
    Die("UD INIT: %s", std::strerror(rc));
  a = {};
  a.qp_state = IBV_QPS_RTR;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE)) Die("UD RTR: %s", std::strerror(rc));
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
    Die("UD RTS: %s", std::strerror(rc));
}

// Tells the peer this side's QPs and GID over TCP (the socket closed
// before any RDMA) and brings QP t up toward the peer's QP t (RC), or up
// (UD). The peer's header.
Header Connect(const Options& o, const Header& me, const std::vector<Qp>& qps) {
  Header peer{};
  {
    UniqueFd fd = o.server ? AcceptOne(o.port) : ConnectTo(o.host, o.port);
    SendAll(fd.get(), &me, sizeof(me));
    RecvAll(fd.get(), &peer, sizeof(peer));
  }
  if (peer.threads != o.threads) Die("the peer has %u QPs, this side %u", peer.threads, o.threads);
  if (peer.ud != me.ud) Die("one side runs with --ud, the other without");
  ibv_gid gid;
  std::memcpy(gid.raw, peer.gid, 16);
  for (uint32_t t = 0; t < o.threads; ++t) {
    if (o.ud)
      UdToRts(qps[t].get());
    else
      LoopbackToRts(qps[t].get(), peer.qpns[t], gid, o.gid_index);
  }
  return peer;
}

// The source address in a UD receive's GRH area: RoCE v2 over IPv4 puts
// an IPv4 header in its last 20 bytes, otherwise the GRH's own source GID
// is at byte 8.
bool GrhFrom(const uint8_t* grh, const uint8_t gid[16]) {
  static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(gid, kMapped, 12) == 0) return std::memcmp(grh + 20 + 12, gid + 12, 4) == 0;
  return std::memcmp(grh + 8, gid, 16) == 0;
}

void PostSlot(ibv_srq* srq, ibv_mr* mr, uint8_t* slots, uint32_t slot_bytes, uint64_t slot) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(slots + slot * slot_bytes), slot_bytes, mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (const int rc = ibv_post_srq_recv(srq, &wr, &bad))
    Die("ibv_post_srq_recv of slot %" PRIu64 ": %s", slot, std::strerror(rc));
}

// One worker's tally.
struct Tally {
  std::atomic<uint64_t> received{0};
  uint64_t reposts = 0;
  uint64_t bad = 0;
  uint64_t wrong_sender = 0;  // UD: src_qp or GRH source not the client's
  uint64_t skipped = 0;       // UD: datagrams dropped on the way
  bool ended = false;
};

int Serve(const Options& o, ibv_context* ctx, ibv_pd* pd, const ibv_gid& gid) {
  const uint32_t slot_bytes = SlotBytes(o);
  std::vector<uint8_t> slots(size_t{o.depth} * slot_bytes);
  Mr mr(ibv_reg_mr(pd, slots.data(), slots.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!mr) Die("ibv_reg_mr: %s", std::strerror(errno));
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = o.depth;
  sa.attr.max_sge = 1;
  Srq srq(ibv_create_srq(pd, &sa));
  if (!srq) Die("ibv_create_srq of %u: %s", o.depth, std::strerror(errno));
  std::vector<Cq> cqs;
  std::vector<Qp> qps;
  Header me{o.threads, o.ud, {}, {}};
  std::memcpy(me.gid, gid.raw, 16);
  for (uint32_t t = 0; t < o.threads; ++t) {
    cqs.emplace_back(ibv_create_cq(ctx, static_cast<int>(o.depth) + 8, nullptr, nullptr, 0));
    if (!cqs.back()) Die("ibv_create_cq: %s", std::strerror(errno));
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cqs.back().get();
    ia.srq = srq.get();
    ia.qp_type = o.ud ? IBV_QPT_UD : IBV_QPT_RC;
    ia.cap.max_send_wr = 1;
    ia.cap.max_send_sge = 1;
    qps.emplace_back(ibv_create_qp(pd, &ia));
    if (!qps.back()) Die("ibv_create_qp: %s", std::strerror(errno));
    me.qpns[t] = qps.back()->qp_num;
  }
  const Header client = Connect(o, me, qps);
  std::printf("srq_workers: server pid %d: %u workers on one SRQ of %u receives (%s)\n",
              static_cast<int>(getpid()), o.threads, o.depth, o.ud ? "UD" : "RC");

  std::vector<Tally> tally(o.threads);
  // Every slot is posted once at any time, and the SRQ hands receives out
  // in the order they were posted: a slot not used again within a few
  // times `depth` receives was lost (a move that did not post it again).
  std::atomic<uint64_t> total{0};
  std::vector<std::atomic<uint64_t>> last_use(o.depth);
  auto worker = [&](uint32_t t) {
    Tally& me_t = tally[t];
    for (uint64_t slot = t; slot < o.depth; slot += o.threads)
      PostSlot(srq.get(), mr.get(), slots.data(), slot_bytes, slot);
    uint64_t expect = 0;
    while (!me_t.ended) {
      ibv_wc wc{};
      const int n = ibv_poll_cq(cqs[t].get(), 1, &wc);
      if (n < 0) Die("worker %u: ibv_poll_cq: %d", t, n);
      if (n == 0) {
        std::this_thread::yield();
        continue;
      }
      const uint8_t* slot = slots.data() + (wc.wr_id < o.depth ? wc.wr_id : 0) * slot_bytes;
      Message m;
      std::memcpy(&m, slot + (o.ud ? kGrh : 0), sizeof(m));
      // UD drops datagrams: a later one may come next, never an earlier.
      const bool in_order = m.seq == expect || m.seq == kLast || (o.ud && m.seq > expect);
      const bool ok = wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV &&
                      wc.byte_len == slot_bytes && wc.wr_id < o.depth && m.magic == kMagic &&
                      m.qp == t && PatternOk(m) && in_order;
      if (ok && o.ud &&
          (wc.src_qp != client.qpns[t] || !(wc.wc_flags & IBV_WC_GRH) ||
           !GrhFrom(slot, client.gid))) {
        if (me_t.wrong_sender++ < 5)
          std::fprintf(stderr,
                       "srq_workers: worker %u: seq %" PRIu64
                       " from QP 0x%x (the client's is 0x%x)%s\n",
                       t, m.seq, wc.src_qp, client.qpns[t],
                       GrhFrom(slot, client.gid) ? "" : ", GRH source not the client's");
      }
      if (!ok) {
        ++me_t.bad;
        std::fprintf(stderr,
                     "srq_workers: worker %u: %s, wr_id %" PRIu64 ", %u bytes, qp %u, seq %" PRIu64
                     " (expected %" PRIu64 ")\n",
                     t, ibv_wc_status_str(wc.status), wc.wr_id, wc.byte_len, m.qp, m.seq, expect);
        if (wc.status != IBV_WC_SUCCESS) return;  // the QP is in the error state
      }
      if (m.seq == kLast) {
        if (!o.ud && m.count != expect) {
          ++me_t.bad;
          std::fprintf(stderr, "srq_workers: worker %u: %" PRIu64 " sent, %" PRIu64 " received\n",
                       t, m.count, expect);
        }
        me_t.ended = true;
      } else if (ok) {
        me_t.skipped += m.seq - expect;
        expect = m.seq + 1;
        me_t.received.store(expect, std::memory_order_relaxed);
      }
      if (wc.wr_id < o.depth) {
        last_use[wc.wr_id].store(total.fetch_add(1) + 1);
        PostSlot(srq.get(), mr.get(), slots.data(), slot_bytes, wc.wr_id);
        ++me_t.reposts;
      }
    }
  };
  std::vector<std::thread> workers;
  for (uint32_t t = 0; t < o.threads; ++t) workers.emplace_back(worker, t);
  std::atomic<bool> done{false};
  std::thread progress([&] {
    RunningClock clock;
    double shown = 0;
    while (!done.load()) {
      const double now = clock.Seconds();
      if (now >= shown + 1) {
        shown = now;
        std::string line;
        for (const Tally& x : tally) line += Sprintf(" %" PRIu64, x.received.load());
        std::printf("srq_workers: received by thread:%s\n", line.c_str());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  for (std::thread& w : workers) w.join();
  done.store(true);
  progress.join();
  std::string received, reposts;
  uint64_t bad = 0, wrong_sender = 0, skipped = 0;
  bool ended = true;
  for (const Tally& x : tally) {
    received += Sprintf("%s%" PRIu64, received.empty() ? "" : ", ", x.received.load());
    reposts += Sprintf("%s%" PRIu64, reposts.empty() ? "" : ", ", x.reposts);
    bad += x.bad;
    wrong_sender += x.wrong_sender;
    skipped += x.skipped;
    ended = ended && x.ended;
  }
  // Slots not used in the last 4 * depth receives (slack: the workers'
  // reposts are not in the SRQ's order among themselves).
  uint64_t stale = 0;
  if (total.load() > 8 * uint64_t{o.depth}) {
    for (const auto& u : last_use) stale += u.load() + 4 * uint64_t{o.depth} < total.load();
  }
  const bool ok = bad == 0 && wrong_sender == 0 && ended && stale == 0;
  std::printf(
      "{\"ok\": %s, \"received_by_thread\": [%s], \"reposts_by_thread\": [%s], "
      "\"bad\": %" PRIu64 ", \"wrong_sender\": %" PRIu64 ", \"skipped\": %" PRIu64
      ", \"receives\": %" PRIu64 ", \"stale_slots\": %" PRIu64 "}\n",
      ok ? "true" : "false", received.c_str(), reposts.c_str(), bad, wrong_sender, skipped,
      total.load(), stale);
  return ok ? 0 : 1;
}

int Send(const Options& o, ibv_context* ctx, ibv_pd* pd, const ibv_gid& gid) {
  const uint32_t slots_n = o.threads * o.window;
  std::vector<uint8_t> slots(size_t{slots_n} * kMsg);
  Mr mr(ibv_reg_mr(pd, slots.data(), slots.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!mr) Die("ibv_reg_mr: %s", std::strerror(errno));
  Cq cq(ibv_create_cq(ctx, static_cast<int>(slots_n) + 8, nullptr, nullptr, 0));
  if (!cq) Die("ibv_create_cq: %s", std::strerror(errno));
  std::vector<Qp> qps;
  Header me{o.threads, o.ud, {}, {}};
  std::memcpy(me.gid, gid.raw, 16);
  for (uint32_t t = 0; t < o.threads; ++t) {
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cq.get();
    ia.qp_type = o.ud ? IBV_QPT_UD : IBV_QPT_RC;
    ia.cap.max_send_wr = o.window + 1;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
    qps.emplace_back(ibv_create_qp(pd, &ia));
    if (!qps.back()) Die("ibv_create_qp: %s", std::strerror(errno));
    me.qpns[t] = qps.back()->qp_num;
  }
  const Header server = Connect(o, me, qps);
  Ah ah;
  if (o.ud) {
    ibv_ah_attr aa{};
    aa.is_global = 1;
    std::memcpy(aa.grh.dgid.raw, server.gid, 16);
    aa.grh.sgid_index = static_cast<uint8_t>(o.gid_index);
    aa.grh.hop_limit = 64;
    aa.port_num = kIbPort;
    ah.reset(ibv_create_ah(pd, &aa));
    if (!ah) Die("ibv_create_ah: %s", std::strerror(errno));
  }
  std::printf("srq_workers: client pid %d: %u QPs connected (%s)\n", static_cast<int>(getpid()),
              o.threads, o.ud ? "UD" : "RC");

  std::vector<uint64_t> sent(o.threads, 0);
  std::vector<uint32_t> in_flight(o.threads, 0);
  uint64_t errors = 0;
  // Slot (t, k) of QP t is free again once its send completed.
  auto post = [&](uint32_t t, uint64_t seq, uint64_t count) {
    const uint32_t slot = t * o.window + static_cast<uint32_t>(seq == kLast ? 0 : seq % o.window);
    auto* m = reinterpret_cast<Message*>(slots.data() + size_t{slot} * kMsg);
    Fill(m, t, seq, count);
    ibv_sge sge{reinterpret_cast<uintptr_t>(m), kMsg, mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = t;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (o.ud) {
      wr.wr.ud.ah = ah.get();
      wr.wr.ud.remote_qpn = server.qpns[t];
      wr.wr.ud.remote_qkey = kQkey;
    }
    ibv_send_wr* bad = nullptr;
    if (const int rc = ibv_post_send(qps[t].get(), &wr, &bad))
      Die("ibv_post_send on QP %u: %s", t, std::strerror(rc));
    ++in_flight[t];
  };
  auto reap = [&]() {
    ibv_wc wcs[16];
    const int n = ibv_poll_cq(cq.get(), 16, wcs);
    if (n < 0) Die("ibv_poll_cq: %d", n);
    for (int i = 0; i < n; ++i) {
      if (wcs[i].status != IBV_WC_SUCCESS) {
        ++errors;
        std::fprintf(stderr, "srq_workers: QP %" PRIu64 ": %s\n", wcs[i].wr_id,
                     ibv_wc_status_str(wcs[i].status));
      }
      if (wcs[i].wr_id < o.threads && in_flight[wcs[i].wr_id] > 0) --in_flight[wcs[i].wr_id];
    }
    return n;
  };
  RunningClock clock;
  double shown = 0;
  while (!g_stop && errors == 0) {
    const double now = clock.Seconds();
    if (now >= o.seconds) break;
    if (now >= shown + 1) {
      shown = now;
      std::string line;
      for (uint64_t s : sent) line += Sprintf(" %" PRIu64, s);
      std::printf("srq_workers: sent by qp:%s\n", line.c_str());
    }
    bool posted = false;
    for (uint32_t t = 0; t < o.threads; ++t) {
      if (in_flight[t] < o.window) {
        post(t, sent[t]++, 0);
        posted = true;
      }
    }
    if (reap() == 0 && !posted) std::this_thread::yield();
  }
  // Every send completed, then the last message on each QP.
  auto drain = [&]() {
    for (;;) {
      uint32_t left = 0;
      for (uint32_t f : in_flight) left += f;
      if (left == 0 || errors > 0) return;
      if (reap() == 0) std::this_thread::yield();
    }
  };
  drain();
  // A datagram may be dropped: the last one goes several times.
  for (int i = 0; i < (o.ud ? 50 : 1) && errors == 0; ++i) {
    for (uint32_t t = 0; t < o.threads; ++t) post(t, kLast, sent[t]);
    drain();
    if (o.ud) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string by_qp;
  for (uint64_t s : sent) by_qp += Sprintf("%s%" PRIu64, by_qp.empty() ? "" : ", ", s);
  std::printf("{\"ok\": %s, \"sent_by_qp\": [%s], \"errors\": %" PRIu64 "}\n",
              errors == 0 ? "true" : "false", by_qp.c_str(), errors);
  return errors == 0 ? 0 : 1;
}

int Run(const Options& o) {
  Context ctx = OpenDevice(o.device);
  Pd pd(ibv_alloc_pd(ctx.get()));
  if (!pd) Die("ibv_alloc_pd: %s", std::strerror(errno));
  ibv_gid gid;
  if (ibv_query_gid(ctx.get(), kIbPort, o.gid_index, &gid) != 0)
    Die("ibv_query_gid index %d: %s", o.gid_index, std::strerror(errno));
  return o.server ? Serve(o, ctx.get(), pd.get(), gid) : Send(o, ctx.get(), pd.get(), gid);
}

}  // namespace

int main(int argc, char** argv) {
  program_name = "srq_workers";
  const Options o = ParseArgs(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  struct sigaction sa {};
  sa.sa_handler = OnStop;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  return Run(o);
}
