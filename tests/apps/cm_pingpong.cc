// An RDMA CM ping-pong that checks every byte and every CM event: the
// client connects through librdmacm (resolve address, route, connect), the
// server listens and accepts; each iteration the client SENDs a message
// made of its number and the server SENDs it back changed, each side
// checking what it got. No CM event may come while they talk. At the end
// the side named by -d disconnects and both must see DISCONNECTED within a
// deadline; the addresses librdmacm reports must be those of the start.
//
//   cm_pingpong -s -a ADDR -p PORT -n N [-d client|server]
//   cm_pingpong -c ADDR -p PORT -n N [-i MS] [-t MS] [-u FILE] [-d client|server]
//
// -i: a pause after each iteration; -t: the address and route
// resolutions' timeout (default 5000); -u: the client's last iteration is
// the first after FILE exists (its message tells the server so), or the
// N-th.
//
// Prints "iteration I" every 100 iterations and, last, its verdict:
// "cm_pingpong: PASS ..." (exit 0) or "cm_pingpong: FAIL: why" (exit 1).
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "tests/apps/app_common.h"

namespace {

using rdmavirt::apps::Die;
using Clock = std::chrono::steady_clock;

constexpr int kMsg = 64;
constexpr int kStepSeconds = 120;  // a move's blackout fits many times

struct Event {
  rdma_cm_event_type type;
  rdma_cm_id* id;
};

// Every CM event, taken by a thread of its own (as rping's) and acked.
class Events {
 public:
  explicit Events(rdma_event_channel* ch) : ch_(ch), thread_([this] { Run(); }) {
    thread_.detach();
  }
  // The next event, or Die after the deadline.
  Event Next(const char* waiting_for) {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, std::chrono::seconds(kStepSeconds), [&] { return !q_.empty(); }))
      Die("no CM event within %d s waiting for %s", kStepSeconds, waiting_for);
    Event e = q_.front();
    q_.pop_front();
    return e;
  }
  void Expect(rdma_cm_event_type want, Event* out = nullptr) {
    Event e = Next(rdma_event_str(want));
    if (e.type != want)
      Die("%s while waiting for %s", rdma_event_str(e.type), rdma_event_str(want));
    if (out) *out = e;
  }
  // An event that came while none should have.
  bool Unexpected(Event* out) {
    std::lock_guard<std::mutex> l(mu_);
    if (q_.empty()) return false;
    *out = q_.front();
    return true;
  }

 private:
  void Run() {
    for (;;) {
      rdma_cm_event* e = nullptr;
      if (rdma_get_cm_event(ch_, &e) != 0) {
        if (errno == EINTR) continue;
        Die("rdma_get_cm_event: %s", strerror(errno));
      }
      Event ev{e->event, e->id};
      rdma_ack_cm_event(e);
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(ev);
      cv_.notify_all();
    }
  }
  rdma_event_channel* ch_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> q_;
  std::thread thread_;
};

struct Conn {
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  char buf[2 * kMsg] = {};  // send half, receive half
  int done[3] = {};         // completions by wr_id (1 send, 2 receive) not yet awaited
};

void Setup(Conn* c) {
  c->pd = ibv_alloc_pd(c->id->verbs);
  c->cq = c->pd ? ibv_create_cq(c->id->verbs, 16, nullptr, nullptr, 0) : nullptr;
  if (!c->cq) Die("PD or CQ: %s", strerror(errno));
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = c->cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  if (rdma_create_qp(c->id, c->pd, &qa) != 0) Die("rdma_create_qp: %s", strerror(errno));
  c->mr = ibv_reg_mr(c->pd, c->buf, sizeof c->buf, IBV_ACCESS_LOCAL_WRITE);
  if (!c->mr) Die("ibv_reg_mr: %s", strerror(errno));
}

void PostRecv(Conn* c) {
  ibv_sge s{reinterpret_cast<uintptr_t>(c->buf + kMsg), kMsg, c->mr->lkey};
  ibv_recv_wr w{}, *bad = nullptr;
  w.wr_id = 2;
  w.sg_list = &s;
  w.num_sge = 1;
  if (ibv_post_recv(c->id->qp, &w, &bad) != 0) Die("ibv_post_recv: %s", strerror(errno));
}

void PostSend(Conn* c) {
  ibv_sge s{reinterpret_cast<uintptr_t>(c->buf), kMsg, c->mr->lkey};
  ibv_send_wr w{}, *bad = nullptr;
  w.wr_id = 1;
  w.sg_list = &s;
  w.num_sge = 1;
  w.opcode = IBV_WR_SEND;
  w.send_flags = IBV_SEND_SIGNALED;
  if (ibv_post_send(c->id->qp, &w, &bad) != 0) Die("ibv_post_send: %s", strerror(errno));
}

// Waits for a completion of wr_id `want` (1 send, 2 receive); the other
// kind may complete first.
void Await(Conn* c, Events* ev, uint64_t want, int iteration) {
  const auto deadline = Clock::now() + std::chrono::seconds(kStepSeconds);
  for (;;) {
    if (c->done[want] > 0) {
      --c->done[want];
      return;
    }
    ibv_wc wc{};
    const int n = ibv_poll_cq(c->cq, 1, &wc);
    if (n < 0) Die("ibv_poll_cq failed");
    if (n == 1) {
      if (wc.status != IBV_WC_SUCCESS)
        Die("iteration %d: completion %s", iteration, ibv_wc_status_str(wc.status));
      if (wc.wr_id == 1 || wc.wr_id == 2) ++c->done[wc.wr_id];
      continue;
    }
    Event e;
    if (ev->Unexpected(&e))
      Die("iteration %d: CM event %s while connected", iteration, rdma_event_str(e.type));
    if (Clock::now() > deadline)
      Die("iteration %d: no completion within %d s", iteration, kStepSeconds);
    usleep(50);
  }
}

void Fill(char* p, int iteration, char salt) {
  for (int k = 0; k < kMsg; ++k) p[k] = static_cast<char>((iteration * 31 + k) ^ salt);
}

void Check(const char* p, int iteration, char salt) {
  char want[kMsg];
  Fill(want, iteration, salt);
  if (memcmp(p, want, kMsg) != 0) Die("iteration %d: the message's bytes differ", iteration);
}

std::string Addr(const sockaddr* sa) {
  char host[64] = "?";
  const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
  if (sa->sa_family == AF_INET) inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
  return std::string(host) + ":" + std::to_string(ntohs(in->sin_port));
}

struct Options {
  bool server = false;
  const char* addr = nullptr;
  int port = 0;
  int iterations = 100;
  int interval_ms = 0;
  bool client_disconnects = true;
  int resolve_ms = 5000;
  const char* until = nullptr;
};

// The client's message of its last iteration before -n (its -u file
// appeared): the same iteration's bytes, salted so.
constexpr char kLastSalt = 0x7f;

Options Parse(int argc, char** argv) {
  Options o;
  int c;
  while ((c = getopt(argc, argv, "sc:a:p:n:i:t:d:u:")) != -1) {
    switch (c) {
      case 's':
        o.server = true;
        break;
      case 'c':
        o.addr = optarg;
        break;
      case 'a':
        o.addr = optarg;
        break;
      case 'p':
        o.port = atoi(optarg);
        break;
      case 'n':
        o.iterations = atoi(optarg);
        break;
      case 'i':
        o.interval_ms = atoi(optarg);
        break;
      case 't':
        o.resolve_ms = atoi(optarg);
        break;
      case 'd':
        o.client_disconnects = strcmp(optarg, "server") != 0;
        break;
      case 'u':
        o.until = optarg;
        break;
      default:
        Die("usage: cm_pingpong -s -a ADDR | -c ADDR, -p PORT [-n N] [-i MS] [-t MS] "
            "[-u FILE] [-d client|server]");
    }
  }
  if (!o.addr || o.port <= 0 || o.iterations <= 0) Die("an address, a port and -n > 0 are needed");
  return o;
}

void Connect(const Options& o, rdma_event_channel* ch, Events* ev, Conn* c) {
  addrinfo* ai = nullptr;
  if (getaddrinfo(o.addr, std::to_string(o.port).c_str(), nullptr, &ai) != 0) Die("bad address");
  if (o.server) {
    rdma_cm_id* listener = nullptr;
    if (rdma_create_id(ch, &listener, nullptr, RDMA_PS_TCP) ||
        rdma_bind_addr(listener, ai->ai_addr) || rdma_listen(listener, 4))
      Die("listen: %s", strerror(errno));
    std::printf("listening\n");
    std::fflush(stdout);
    Event req;
    ev->Expect(RDMA_CM_EVENT_CONNECT_REQUEST, &req);
    c->id = req.id;
    Setup(c);
    PostRecv(c);
    rdma_conn_param p{};
    if (rdma_accept(c->id, &p) != 0) Die("rdma_accept: %s", strerror(errno));
  } else {
    if (rdma_create_id(ch, &c->id, nullptr, RDMA_PS_TCP) ||
        rdma_resolve_addr(c->id, nullptr, ai->ai_addr, o.resolve_ms))
      Die("resolve: %s", strerror(errno));
    ev->Expect(RDMA_CM_EVENT_ADDR_RESOLVED);
    std::printf("resolved\n");
    if (rdma_resolve_route(c->id, o.resolve_ms)) Die("rdma_resolve_route: %s", strerror(errno));
    ev->Expect(RDMA_CM_EVENT_ROUTE_RESOLVED);
    Setup(c);
    PostRecv(c);
    rdma_conn_param p{};
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    if (rdma_connect(c->id, &p) != 0) Die("rdma_connect: %s", strerror(errno));
  }
  freeaddrinfo(ai);
  ev->Expect(RDMA_CM_EVENT_ESTABLISHED);
}

}  // namespace

int main(int argc, char** argv) {
  rdmavirt::apps::program_name = "cm_pingpong";
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const Options o = Parse(argc, argv);
  rdma_event_channel* ch = rdma_create_event_channel();
  if (!ch) Die("rdma_create_event_channel: %s", strerror(errno));
  Events ev(ch);
  Conn c;
  Connect(o, ch, &ev, &c);
  const std::string local = Addr(rdma_get_local_addr(c.id));
  const std::string peer = Addr(rdma_get_peer_addr(c.id));
  std::printf("connected %s -> %s\n", local.c_str(), peer.c_str());
  int done = 0;
  bool last = false;
  for (int i = 0; i < o.iterations && !last; ++i) {
    if (o.server) {
      Await(&c, &ev, 2, i);
      char final_message[kMsg];
      Fill(final_message, i, kLastSalt);
      last = memcmp(c.buf + kMsg, final_message, kMsg) == 0;
      if (!last) Check(c.buf + kMsg, i, 0);
      PostRecv(&c);
      Fill(c.buf, i, 0x5a);
      PostSend(&c);
      Await(&c, &ev, 1, i);
    } else {
      last = o.until != nullptr && access(o.until, F_OK) == 0 && i + 1 < o.iterations;
      Fill(c.buf, i, last ? kLastSalt : 0);
      PostSend(&c);
      Await(&c, &ev, 1, i);
      Await(&c, &ev, 2, i);
      Check(c.buf + kMsg, i, 0x5a);
      PostRecv(&c);
      if (o.interval_ms) usleep(o.interval_ms * 1000);
    }
    done = i + 1;
    if (done % 100 == 0) std::printf("iteration %d\n", done);
  }
  const bool mine = o.server != o.client_disconnects;
  if (mine && rdma_disconnect(c.id) != 0) Die("rdma_disconnect: %s", strerror(errno));
  ev.Expect(RDMA_CM_EVENT_DISCONNECTED);
  if (!mine && rdma_disconnect(c.id) != 0) Die("rdma_disconnect: %s", strerror(errno));
  const std::string local2 = Addr(rdma_get_local_addr(c.id));
  const std::string peer2 = Addr(rdma_get_peer_addr(c.id));
  if (local2 != local || peer2 != peer)
    Die("addresses changed: %s -> %s, then %s -> %s", local.c_str(), peer.c_str(), local2.c_str(),
        peer2.c_str());
  rdma_destroy_qp(c.id);
  if (rdma_destroy_id(c.id) != 0) Die("rdma_destroy_id: %s", strerror(errno));
  std::printf("cm_pingpong: PASS iterations=%d disconnected by %s, seen as DISCONNECTED\n", done,
              o.client_disconnects ? "client" : "server");
  return 0;
}
