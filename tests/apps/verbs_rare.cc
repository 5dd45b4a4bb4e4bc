// verbs_rare: the less common verbs, on one host, printing a transcript
// that must be the same natively and under the shim (default and offset
// modes). It exists because programs nobody here wrote (rdma-core's own
// tools and bindings) call exports that a shim must not pass a shadow
// object to: GID types, ibv_query_qp_data_in_order, L2 resolution, the
// extended device and port queries, extended CQs polled both ways, CQ
// resize, MR re-registration, advice refused, async events, fork.
//
// Two RC QP pairs connected to each other on the same device (rxe loops
// them back), so no peer host is needed. Identities (QPNs, keys, GIDs)
// differ by design between the runs; the transcript shows only what must
// not: whether each identity matches where it must, values and errors.
//
//   verbs_rare [-d DEVICE]      exit 0 when every check passed
#include <infiniband/verbs.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/apps/app_common.h"

// Private exports (IBVERBS_PRIVATE_NN) that rdma-core's tools and pyverbs
// call; not in the public headers.
extern "C" int ibv_query_gid_type(ibv_context* context, uint8_t port_num, unsigned int index,
                                  int* type);
// The exported ibv_query_port (verbs.h's inline of that name uses the
// context's extended op): it fills the older prefix of ibv_port_attr.
extern "C" int ExportedQueryPort(ibv_context* context, uint8_t port_num,
                                 ibv_port_attr* attr) __asm__("ibv_query_port");

namespace {

using rdmavirt::apps::Die;

int failures = 0;

// One line of the transcript.
void Say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vprintf(fmt, ap);
  va_end(ap);
  std::printf("\n");
  std::fflush(stdout);
}

// A check: printed as part of the transcript, counted when false.
void Check(bool ok, const char* what) {
  Say("%s: %s", what, ok ? "yes" : "NO");
  if (!ok) ++failures;
}

const char* YesNo(bool b) { return b ? "yes" : "no"; }

constexpr uint8_t kPort = 1;
constexpr size_t kBuf = 4096;

struct Pair {
  ibv_qp* a = nullptr;
  ibv_qp* b = nullptr;
};

Pair Connect(ibv_pd* pd, ibv_cq* cq, ibv_srq* srq_b, const ibv_gid& gid, int sgid_index) {
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = 16;
  init.cap.max_recv_wr = 16;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  Pair p;
  p.a = ibv_create_qp(pd, &init);
  init.srq = srq_b;
  p.b = ibv_create_qp(pd, &init);
  if (p.a == nullptr || p.b == nullptr) Die("ibv_create_qp: %s", strerror(errno));
  rdmavirt::apps::LoopbackToRts(p.a, p.b->qp_num, gid, sgid_index);
  rdmavirt::apps::LoopbackToRts(p.b, p.a->qp_num, gid, sgid_index);
  return p;
}

void PostRecv(ibv_qp* qp, ibv_srq* srq, ibv_mr* mr, void* addr, uint32_t len, uint64_t wr_id) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(addr), len, mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = srq ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(qp, &wr, &bad);
  if (rc != 0) Die("post_recv: %s", strerror(rc));
}

void PostSend(ibv_qp* qp, ibv_wr_opcode op, ibv_mr* mr, void* addr, uint32_t len, uint64_t wr_id,
              uint64_t remote = 0, uint32_t rkey = 0) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(addr), len, mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp, &wr, &bad)) Die("post_send: %s", strerror(rc));
}

// ibv_poll_cq until `n` completions, 10 s at most.
std::vector<ibv_wc> PollN(ibv_cq* cq, int n) {
  std::vector<ibv_wc> out;
  for (int spins = 0; static_cast<int>(out.size()) < n && spins < 100000; ++spins) {
    ibv_wc wc[4];
    const int got = ibv_poll_cq(cq, 4, wc);
    if (got < 0) Die("ibv_poll_cq: %d", got);
    out.insert(out.end(), wc, wc + got);
    if (got == 0) usleep(100);
  }
  if (static_cast<int>(out.size()) < n) Die("%d of %d completions in 10 s", int(out.size()), n);
  return out;
}

// One completion through ibv_start_poll / ibv_next_poll, 10 s at most.
struct ExWc {
  uint64_t wr_id;
  ibv_wc_status status;
  ibv_wc_opcode opcode;
  uint32_t byte_len;
  uint32_t qp_num;
};
std::vector<ExWc> PollEx(ibv_cq_ex* cq, int n) {
  std::vector<ExWc> out;
  for (int spins = 0; static_cast<int>(out.size()) < n && spins < 100000; ++spins) {
    ibv_poll_cq_attr attr{};
    int rc = ibv_start_poll(cq, &attr);
    if (rc == ENOENT) {
      usleep(100);
      continue;
    }
    if (rc != 0) Die("ibv_start_poll: %s", strerror(rc));
    do {
      out.push_back({cq->wr_id, cq->status, ibv_wc_read_opcode(cq), ibv_wc_read_byte_len(cq),
                     ibv_wc_read_qp_num(cq)});
    } while (static_cast<int>(out.size()) < n && (rc = ibv_next_poll(cq)) == 0);
    ibv_end_poll(cq);
  }
  if (static_cast<int>(out.size()) < n) Die("%d of %d extended completions", int(out.size()), n);
  return out;
}

bool Readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, timeout_ms) == 1;
}

const char* GidTypeName(int t) {
  switch (t) {
    case IBV_GID_TYPE_IB:
      return "IB";
    case IBV_GID_TYPE_ROCE_V1:
      return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2:
      return "RoCE v2";
    default:
      return "?";
  }
}

std::string EthMac(const char* ifname) {
  FILE* f = fopen((std::string("/sys/class/net/") + ifname + "/address").c_str(), "r");
  if (f == nullptr) return "";
  char buf[64] = {};
  if (fgets(buf, sizeof buf, f) == nullptr) buf[0] = 0;
  fclose(f);
  std::string s(buf);
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

std::atomic<int> g_alarms{0};
void OnAlarm(int) { g_alarms.fetch_add(1); }

// Whether thread `tid` sleeps (state S in /proc) within `timeout_ms`.
bool AsleepWithin(pid_t tid, int timeout_ms) {
  const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
  for (int waited = 0; waited <= timeout_ms; ++waited) {
    FILE* f = fopen(path.c_str(), "r");
    char line[512] = {};
    const bool read = f != nullptr && fgets(line, sizeof line, f) != nullptr;
    if (f != nullptr) fclose(f);
    const char* paren = read ? strrchr(line, ')') : nullptr;
    if (paren != nullptr && paren[1] == ' ' && paren[2] == 'S') return true;
    usleep(1000);
  }
  return false;
}

// What ibv_get_cq_event returned when SIGALRM, handled with `flags`,
// came while it waited on the armed `cq`: another thread sends the
// signal once this one sleeps, and makes the event (an RDMA WRITE on
// `qp`) only if the wait has not ended 2 s after it. A timed loop ends
// so (qperf stops its tests with SIGALRM): libibverbs' read(2) returns
// EINTR after a handler installed without SA_RESTART, and goes on
// waiting after one with it.
struct Interrupted {
  int rc;
  int err;
  bool event;
};
Interrupted GetCqEventThroughAlarm(ibv_comp_channel* channel, ibv_cq* cq, int flags, ibv_qp* qp,
                                   ibv_mr* mr, void* src, uint64_t remote, uint32_t rkey) {
  struct sigaction sa {};
  sa.sa_handler = OnAlarm;
  sa.sa_flags = flags;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGALRM, &sa, nullptr);
  g_alarms.store(0);
  if (ibv_req_notify_cq(cq, 0) != 0) Die("ibv_req_notify_cq");
  const pid_t self = gettid();
  const pthread_t self_thread = pthread_self();
  std::atomic<bool> returned{false};
  std::thread signaller([&] {
    if (!AsleepWithin(self, 10000)) Die("the waiter never slept in ibv_get_cq_event");
    pthread_kill(self_thread, SIGALRM);
    for (int waited = 0; waited < 2000 && !returned.load(); ++waited) usleep(1000);
    if (!returned.load()) PostSend(qp, IBV_WR_RDMA_WRITE, mr, src, 64, 6, remote, rkey);
  });
  ibv_cq* got = nullptr;
  void* tag = nullptr;
  errno = 0;
  Interrupted out{ibv_get_cq_event(channel, &got, &tag), errno, false};
  returned.store(true);
  signaller.join();
  out.event = out.rc == 0 && got == cq;
  if (out.event) {
    ibv_ack_cq_events(cq, 1);
    PollN(cq, 1);
  }
  signal(SIGALRM, SIG_DFL);
  if (g_alarms.load() != 1) Die("SIGALRM handled %d times", g_alarms.load());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  rdmavirt::apps::program_name = "verbs_rare";
  const char* want = "rxe0";
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "-d") == 0 && i + 1 < argc) {
      want = argv[++i];
    } else {
      std::fprintf(stderr, "usage: verbs_rare [-d DEVICE]\n");
      return 2;
    }
  }

  // ---- fork support, first: it must precede every other verb.
  Say("ibv_fork_init: %d", ibv_fork_init());
  Say("ibv_is_fork_initialized: %d", static_cast<int>(ibv_is_fork_initialized()));

  // ---- devices (real objects, not shadowed)
  int ndev = 0;
  ibv_device** list = ibv_get_device_list(&ndev);
  if (list == nullptr) Die("ibv_get_device_list: %s", strerror(errno));
  ibv_device* dev = nullptr;
  for (int i = 0; i < ndev; ++i)
    if (strcmp(ibv_get_device_name(list[i]), want) == 0) dev = list[i];
  if (dev == nullptr) Die("no device %s", want);
  Say("device: %s", ibv_get_device_name(dev));
  Check(ibv_get_device_index(dev) >= 0, "ibv_get_device_index >= 0");
  Check(ibv_get_device_guid(dev) != 0, "ibv_get_device_guid nonzero");
  ibv_context* ctx = ibv_open_device(dev);
  if (ctx == nullptr) Die("ibv_open_device: %s", strerror(errno));
  Check(ctx->device == dev, "the context's device is the listed one");

  // ---- extended device and port queries
  ibv_device_attr_ex dx{};
  int rc = ibv_query_device_ex(ctx, nullptr, &dx);
  Say("ibv_query_device_ex: %d, ports %u, max_qp > 0: %s, max_cqe > 0: %s", rc,
      dx.orig_attr.phys_port_cnt, YesNo(dx.orig_attr.max_qp > 0), YesNo(dx.orig_attr.max_cqe > 0));
  ibv_device_attr d{};
  rc = ibv_query_device(ctx, &d);
  Check(rc == 0 && d.max_qp == dx.orig_attr.max_qp && d.max_qp_wr == dx.orig_attr.max_qp_wr,
        "ibv_query_device agrees with ibv_query_device_ex");
  ibv_port_attr pa{};
  rc = ibv_query_port(ctx, kPort, &pa);  // the inline: the context's extended op
  Say("ibv_query_port: %d, state %s, link layer %s, max_mtu %d", rc, ibv_port_state_str(pa.state),
      pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "other", pa.max_mtu);
  ibv_port_attr old{};
  rc = ExportedQueryPort(ctx, kPort, &old);
  Check(rc == 0 && old.state == pa.state && old.gid_tbl_len == pa.gid_tbl_len,
        "the exported ibv_query_port agrees with the extended one");
  ibv_values_ex rt{};
  rt.comp_mask = IBV_VALUES_MASK_RAW_CLOCK;
  Say("ibv_query_rt_values_ex: %d", ibv_query_rt_values_ex(ctx, &rt));

  // ---- GIDs and their types, four ways
  const int table_len = pa.gid_tbl_len < 4 ? pa.gid_tbl_len : 4;
  std::vector<ibv_gid_entry> table(static_cast<size_t>(pa.gid_tbl_len));
  const ssize_t nvalid = ibv_query_gid_table(ctx, table.data(), table.size(), 0);
  Say("ibv_query_gid_table: %zd entries", nvalid);
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry e{};
    const int erc = ibv_query_gid_ex(ctx, kPort, i, &e, 0);
    int sysfs_type = -1;
    const int trc = ibv_query_gid_type(ctx, kPort, static_cast<unsigned int>(i), &sysfs_type);
    if (erc != 0) {
      Say("gid %d: ibv_query_gid_ex %s, ibv_query_gid_type %d (type %d)", i, strerror(erc), trc,
          sysfs_type);
      continue;
    }
    ibv_gid g{};
    const int grc = ibv_query_gid(ctx, kPort, i, &g);
    bool in_table = false;
    for (ssize_t k = 0; k < nvalid; ++k)
      in_table |= table[k].gid_index == static_cast<uint32_t>(i) &&
                  memcmp(&table[k].gid, &e.gid, sizeof g) == 0 && table[k].gid_type == e.gid_type;
    Say("gid %d: %s, ibv_query_gid_type %d (type %d), same as ibv_query_gid: %s, in the table: "
        "%s",
        i, GidTypeName(e.gid_type), trc, sysfs_type,
        YesNo(grc == 0 && memcmp(&g, &e.gid, sizeof g) == 0), YesNo(in_table));
  }
  const int sgid = rdmavirt::apps::Ipv4V2GidIndex(ctx, table_len);
  if (sgid < 0) Die("no RoCE v2 IPv4 GID on port 1");
  ibv_gid gid{};
  if (ibv_query_gid(ctx, kPort, sgid, &gid) != 0) Die("ibv_query_gid");
  Say("the IPv4 RoCE v2 GID is at index %d", sgid);

  // ---- L2 address of a GID (this host's own address)
  {
    ibv_ah_attr ah{};
    ah.is_global = 1;
    ah.grh.dgid = gid;
    ah.grh.sgid_index = static_cast<uint8_t>(sgid);
    ah.port_num = kPort;
    uint8_t mac[6] = {};
    uint16_t vid = 0;
    rc = ibv_resolve_eth_l2_from_gid(ctx, &ah, mac, &vid);
    char text[32];
    snprintf(text, sizeof text, "%02x:%02x:%02x:%02x:%02x:%02x", mac[0], mac[1], mac[2], mac[3],
             mac[4], mac[5]);
    Say("ibv_resolve_eth_l2_from_gid: %d, vid %u", rc, vid);
    Check(rc != 0 || text == EthMac("eth0"), "the MAC resolved is eth0's");
  }

  // ---- protection domain, memory, refusals of the device's absent features
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (pd == nullptr) Die("ibv_alloc_pd: %s", strerror(errno));
  // Pages of its own: with ibv_fork_init, registered pages are not in a
  // forked child.
  const size_t mem_len = 6 * kBuf;
  auto* mem = static_cast<uint8_t*>(
      mmap(nullptr, mem_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (mem == MAP_FAILED) Die("mmap: %s", strerror(errno));
  uint8_t* src = mem;
  uint8_t* dst = src + kBuf;
  uint8_t* dst2 = src + 2 * kBuf;
  uint8_t* rbuf = src + 3 * kBuf;
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  ibv_mr* mr = ibv_reg_mr(pd, mem, mem_len, access);
  ibv_mr* target = ibv_reg_mr(pd, dst, kBuf, access);
  if (mr == nullptr || target == nullptr) Die("ibv_reg_mr: %s", strerror(errno));
  {
    ibv_sge sge{reinterpret_cast<uintptr_t>(src), 64, mr->lkey};
    Say("ibv_advise_mr: %d", ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sge, 1));
    errno = 0;
    ibv_mr* null_mr = ibv_alloc_null_mr(pd);
    Say("ibv_alloc_null_mr: %s, errno %s", null_mr ? "made" : "NULL", strerrorname_np(errno));
    if (null_mr) ibv_dereg_mr(null_mr);
    ibv_td_init_attr td_attr{};
    errno = 0;
    ibv_td* td = ibv_alloc_td(ctx, &td_attr);
    Say("ibv_alloc_td: %s, errno %s", td ? "made" : "NULL", strerrorname_np(errno));
    if (td) ibv_dealloc_td(td);
    ibv_alloc_dm_attr dm_attr{};
    dm_attr.length = 64;
    errno = 0;
    ibv_dm* dm = ibv_alloc_dm(ctx, &dm_attr);
    Say("ibv_alloc_dm: %s, errno %s", dm ? "made" : "NULL", strerrorname_np(errno));
    if (dm) ibv_free_dm(dm);
    ibv_counters_init_attr cnt_attr{};
    errno = 0;
    ibv_counters* counters = ibv_create_counters(ctx, &cnt_attr);
    Say("ibv_create_counters: %s, errno %s", counters ? "made" : "NULL", strerrorname_np(errno));
    if (counters) ibv_destroy_counters(counters);
  }

  // ---- an extended CQ (polled both ways), a plain one with a channel
  ibv_cq_init_attr_ex cqx_attr{};
  cqx_attr.cqe = 64;
  cqx_attr.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM;
  ibv_cq_ex* cqx = ibv_create_cq_ex(ctx, &cqx_attr);
  if (cqx == nullptr) Die("ibv_create_cq_ex: %s", strerror(errno));
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  ibv_comp_channel* channel = ibv_create_comp_channel(ctx);
  int cq_tag = 0;
  ibv_cq* evcq = channel ? ibv_create_cq(ctx, 16, &cq_tag, channel, 0) : nullptr;
  if (evcq == nullptr) Die("completion channel or its CQ: %s", strerror(errno));
  rc = ibv_resize_cq(evcq, 256);
  Say("ibv_resize_cq to 256: %d, cqe >= 256: %s", rc, YesNo(evcq->cqe >= 256));
  ibv_modify_cq_attr mcq{};
  mcq.attr_mask = IBV_CQ_ATTR_MODERATE;
  mcq.moderate.cq_count = 1;
  Say("ibv_modify_cq: %d", ibv_modify_cq(evcq, &mcq));

  // ---- a connected pair on the extended CQ
  Pair p = Connect(pd, cq, nullptr, gid, sgid);
  Say("ibv_query_qp_data_in_order(RDMA_WRITE): %d",
      ibv_query_qp_data_in_order(p.a, IBV_WR_RDMA_WRITE, 0));
  Say("ibv_query_qp_data_in_order(SEND): %d", ibv_query_qp_data_in_order(p.a, IBV_WR_SEND, 0));
  ibv_ece ece{};
  Say("ibv_query_ece: %d", ibv_query_ece(p.a, &ece));

  for (size_t i = 0; i < kBuf; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  PostSend(p.a, IBV_WR_RDMA_WRITE, mr, src, kBuf, 1, reinterpret_cast<uintptr_t>(dst),
           target->rkey);
  for (const ExWc& w : PollEx(cqx, 1))
    Say("start_poll: wr_id %lu, %s, opcode %d, byte_len %u, its QP: %s",
        static_cast<unsigned long>(w.wr_id), ibv_wc_status_str(w.status), w.opcode, w.byte_len,
        YesNo(w.qp_num == p.a->qp_num));
  Check(memcmp(src, dst, kBuf) == 0, "the RDMA WRITE's bytes arrived");

  PostRecv(p.b, nullptr, mr, rbuf, 256, 20);
  PostSend(p.a, IBV_WR_SEND, mr, src, 200, 2);
  // One completion each way: the extended poll and ibv_poll_cq on one CQ.
  std::vector<ExWc> first = PollEx(cqx, 1);
  std::vector<ibv_wc> second = PollN(cq, 1);
  const bool send_first = first[0].wr_id == 2;
  const uint32_t first_qp = send_first ? p.a->qp_num : p.b->qp_num;
  const uint32_t second_qp = send_first ? p.b->qp_num : p.a->qp_num;
  Check(first[0].status == IBV_WC_SUCCESS && first[0].qp_num == first_qp &&
            second[0].status == IBV_WC_SUCCESS && second[0].qp_num == second_qp &&
            first[0].wr_id + second[0].wr_id == 22,
        "a SEND and its receive, one through start_poll and one through ibv_poll_cq");
  const ibv_wc_opcode recv_op = send_first ? second[0].opcode : first[0].opcode;
  const uint32_t recv_len = send_first ? second[0].byte_len : first[0].byte_len;
  Say("receive: opcode %d, byte_len %u", recv_op, recv_len);
  Check(memcmp(src, rbuf, 200) == 0, "the SEND's bytes arrived");

  // ---- re-registration: the same MR now covers another buffer (a
  // provider may refuse it: rxe does, with IBV_REREG_MR_ERR_CMD)
  uint8_t* target_buf = dst;
  rc = ibv_rereg_mr(target, IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS, nullptr,
                    dst2, kBuf, access);
  Say("ibv_rereg_mr: %d", rc);
  if (rc == 0) target_buf = dst2;
  {
    for (size_t i = 0; i < kBuf; ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
    PostSend(p.a, IBV_WR_RDMA_WRITE, mr, src, kBuf, 3, reinterpret_cast<uintptr_t>(target_buf),
             target->rkey);
    const ExWc w = PollEx(cqx, 1)[0];
    Say("RDMA WRITE after rereg: %s", ibv_wc_status_str(w.status));
    Check(memcmp(src, target_buf, kBuf) == 0, "it landed where the MR now points");
  }

  // ---- completion events: the CQ and context handed back are the application's
  {
    ibv_qp_init_attr init{};
    init.send_cq = evcq;
    init.recv_cq = evcq;
    init.qp_type = IBV_QPT_RC;
    init.cap = {4, 4, 1, 1, 0};
    ibv_qp* e1 = ibv_create_qp(pd, &init);
    ibv_qp* e2 = ibv_create_qp(pd, &init);
    if (e1 == nullptr || e2 == nullptr) Die("event QPs: %s", strerror(errno));
    rdmavirt::apps::LoopbackToRts(e1, e2->qp_num, gid, sgid);
    rdmavirt::apps::LoopbackToRts(e2, e1->qp_num, gid, sgid);
    if (ibv_req_notify_cq(evcq, 0) != 0) Die("ibv_req_notify_cq");
    PostSend(e1, IBV_WR_RDMA_WRITE, mr, src, 64, 4, reinterpret_cast<uintptr_t>(target_buf),
             target->rkey);
    const bool ready = Readable(channel->fd, 10000);
    ibv_cq* got = nullptr;
    void* tag = nullptr;
    rc = ready ? ibv_get_cq_event(channel, &got, &tag) : -1;
    Say("ibv_get_cq_event: %d", rc);
    Check(rc == 0 && got == evcq && tag == &cq_tag, "the event names the application's CQ");
    if (rc == 0) ibv_ack_cq_events(evcq, 1);
    Say("its completion: %s", ibv_wc_status_str(PollN(evcq, 1)[0].status));
    for (int flags : {0, SA_RESTART}) {
      const Interrupted w = GetCqEventThroughAlarm(
          channel, evcq, flags, e1, mr, src, reinterpret_cast<uintptr_t>(target_buf), target->rkey);
      Say("ibv_get_cq_event, SIGALRM handled %s SA_RESTART: %d, errno %s, the event: %s",
          flags ? "with" : "without", w.rc, w.rc == 0 ? "-" : strerrorname_np(w.err),
          YesNo(w.event));
    }
    ibv_destroy_qp(e1);
    ibv_destroy_qp(e2);
  }

  // ---- an async event: the SRQ's limit reached
  {
    ibv_srq_init_attr_ex sx{};
    sx.attr.max_wr = 16;
    sx.attr.max_sge = 1;
    sx.comp_mask = IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_TYPE;
    sx.srq_type = IBV_SRQT_BASIC;
    sx.pd = pd;
    ibv_srq* srq = ibv_create_srq_ex(ctx, &sx);
    if (srq == nullptr) Die("ibv_create_srq_ex (basic): %s", strerror(errno));
    Pair s = Connect(pd, cq, srq, gid, sgid);
    for (int i = 0; i < 8; ++i) PostRecv(nullptr, srq, mr, rbuf + 256 * i, 256, 100 + i);
    ibv_srq_attr limit{};
    limit.srq_limit = 6;
    Say("ibv_modify_srq (limit 6): %d", ibv_modify_srq(srq, &limit, IBV_SRQ_LIMIT));
    for (int i = 0; i < 4; ++i) PostSend(s.a, IBV_WR_SEND, mr, src, 32, 200 + i);
    PollN(cq, 8);
    const bool ready = Readable(ctx->async_fd, 10000);
    ibv_async_event ev{};
    rc = ready ? ibv_get_async_event(ctx, &ev) : -1;
    Say("ibv_get_async_event: %d, %s", rc, rc == 0 ? ibv_event_type_str(ev.event_type) : "-");
    Check(rc == 0 && ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && ev.element.srq == srq,
          "the event names the application's SRQ");
    if (rc == 0) ibv_ack_async_event(&ev);
    ibv_srq_attr now{};
    Say("ibv_query_srq: %d, limit now %u", ibv_query_srq(srq, &now), now.srq_limit);
    ibv_destroy_qp(s.a);
    ibv_destroy_qp(s.b);
    ibv_destroy_srq(srq);
  }

  // ---- fork: the child opens the device for itself; the parent keeps
  // using its QPs afterwards.
  {
    const pid_t child = fork();
    if (child == 0) {
      int n = 0;
      ibv_device** l = ibv_get_device_list(&n);
      ibv_context* c = l && n > 0 ? ibv_open_device(l[0]) : nullptr;
      ibv_pd* cpd = c ? ibv_alloc_pd(c) : nullptr;
      const bool ok = cpd && ibv_dealloc_pd(cpd) == 0 && ibv_close_device(c) == 0;
      _exit(ok ? 0 : 3);
    }
    int status = 0;
    waitpid(child, &status, 0);
    Say("forked child: %s %d", WIFEXITED(status) ? "exit" : "signal",
        WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    for (size_t i = 0; i < kBuf; ++i) src[i] = static_cast<uint8_t>(i * 3 + 9);
    PostSend(p.a, IBV_WR_RDMA_WRITE, mr, src, kBuf, 5, reinterpret_cast<uintptr_t>(target_buf),
             target->rkey);
    Say("RDMA WRITE after fork: %s", ibv_wc_status_str(PollEx(cqx, 1)[0].status));
    Check(memcmp(src, target_buf, kBuf) == 0, "its bytes arrived");
  }

  ibv_destroy_qp(p.a);
  ibv_destroy_qp(p.b);
  // In order: each object before what it was made from.
  const int d_cq = ibv_destroy_cq(cq);
  const int d_evcq = ibv_destroy_cq(evcq);
  const int d_channel = ibv_destroy_comp_channel(channel);
  const int d_target = ibv_dereg_mr(target);
  const int d_mr = ibv_dereg_mr(mr);
  const int d_pd = ibv_dealloc_pd(pd);
  Say("destroy: cq %d, event cq %d, channel %d, mrs %d %d, pd %d", d_cq, d_evcq, d_channel,
      d_target, d_mr, d_pd);
  Say("close: %d", ibv_close_device(ctx));
  munmap(mem, mem_len);
  ibv_free_device_list(list);
  Say("%s: %d failed", failures == 0 ? "all checks passed" : "CHECKS FAILED", failures);
  return failures == 0 ? 0 : 1;
}
