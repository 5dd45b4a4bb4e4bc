// The driver tools/bench-shim runs under callgrind and strace to count what
// the shim adds to each data-path call over the null backend.
//
//   shim_data_path_count OP PATH N
//     OP: post_send | post_send_rdma_write | post_recv | poll_cq |
//         poll_cq_recv | all
//     PATH: direct | shim | shim-offset | shim-migratable
//   Runs OP N times (rounded up to whole batches of kQueueDepth) on the null
//   backend's own objects (direct) or on one shim's (data_path_fixture.h:
//   default mode, offset mode, default mode of a migratable process), inside
//   the loop function for OP: rdmavirt_bench_*_loop. poll_cq polls send
//   completions, poll_cq_recv receive completions. Receives go in batches:
//   post kQueueDepth, then poll their completions, so the shim's journal of
//   receives stays in its steady state; the half of a batch that is not OP
//   runs outside the loop functions. The same machine code runs for every
//   path, so under
//   `valgrind --tool=callgrind --collect-atstart=no --toggle-collect=LOOP`
//   (Ir_shim - Ir_direct) / N is exactly the instructions the shim adds.
//
//   shim_data_path_count --check N
//   Runs every op N times through each shim stack and prints how many heap
//   allocations and lock acquisitions happened inside the loops (this file
//   interposes malloc and the pthread locks), after checking that the
//   shim translated (completions carry the virtual QPN) and restored (work
//   requests are as the application made them), and that the migratable
//   stack's posts and polls went through the pause gate. Exit status 1 on a
//   failed check, 2 on bad usage.
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "shim/core/objects.h"
#include "tests/bench/data_path_fixture.h"

// ------------------------------------------------------------- interposers
//
// Defined in the executable, these take the place of libc's for every caller
// in the process, the shim's static code included. They count only while
// g_counting is set.

namespace {
bool g_counting = false;
long g_allocations = 0;
long g_locks = 0;

// libc's definition of an interposed function, looked up on first use.
// No function-local static: its guard could take the lock being counted.
template <typename Fn>
Fn Next(Fn* cache, const char* name) {
  if (*cache == nullptr) *cache = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
  return *cache;
}
using MutexFn = int (*)(pthread_mutex_t*);
using SpinFn = int (*)(pthread_spinlock_t*);
using RwlockFn = int (*)(pthread_rwlock_t*);
MutexFn g_mutex_lock = nullptr;
MutexFn g_mutex_trylock = nullptr;
SpinFn g_spin_lock = nullptr;
RwlockFn g_rwlock_rdlock = nullptr;
RwlockFn g_rwlock_wrlock = nullptr;
}  // namespace

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void __libc_free(void*);

void* malloc(size_t n) {
  if (g_counting) ++g_allocations;
  return __libc_malloc(n);
}
void* calloc(size_t n, size_t size) {
  if (g_counting) ++g_allocations;
  return __libc_calloc(n, size);
}
void* realloc(void* p, size_t n) {
  if (g_counting) ++g_allocations;
  return __libc_realloc(p, n);
}
void free(void* p) { __libc_free(p); }

int pthread_mutex_lock(pthread_mutex_t* m) {
  if (g_counting) ++g_locks;
  return Next(&g_mutex_lock, "pthread_mutex_lock")(m);
}
int pthread_mutex_trylock(pthread_mutex_t* m) {
  if (g_counting) ++g_locks;
  return Next(&g_mutex_trylock, "pthread_mutex_trylock")(m);
}
int pthread_spin_lock(pthread_spinlock_t* l) {
  if (g_counting) ++g_locks;
  return Next(&g_spin_lock, "pthread_spin_lock")(l);
}
int pthread_rwlock_rdlock(pthread_rwlock_t* l) {
  if (g_counting) ++g_locks;
  return Next(&g_rwlock_rdlock, "pthread_rwlock_rdlock")(l);
}
int pthread_rwlock_wrlock(pthread_rwlock_t* l) {
  if (g_counting) ++g_locks;
  return Next(&g_rwlock_wrlock, "pthread_rwlock_wrlock")(l);
}

// ------------------------------------------------------------- measured loops
//
// One per verb, not inlined, with C names for --toggle-collect.

__attribute__((noinline)) int rdmavirt_bench_post_send_loop(ibv_qp* qp, ibv_send_wr* wr, long n) {
  ibv_send_wr* bad = nullptr;
  int rc = 0;
  for (long i = 0; i < n; ++i) rc |= ibv_post_send(qp, wr, &bad);
  return rc;
}

__attribute__((noinline)) int rdmavirt_bench_post_recv_loop(ibv_qp* qp, ibv_recv_wr* wr, long n) {
  ibv_recv_wr* bad = nullptr;
  int rc = 0;
  for (long i = 0; i < n; ++i) rc |= ibv_post_recv(qp, wr, &bad);
  return rc;
}

__attribute__((noinline)) int rdmavirt_bench_poll_cq_loop(ibv_cq* cq, ibv_wc* wc, long n) {
  int got = 0;
  for (long i = 0; i < n; ++i) got += ibv_poll_cq(cq, 1, wc);
  return got;
}

}  // extern "C"

namespace rdmavirt::bench {
namespace {

enum Op { kPostSend, kPostSendRdmaWrite, kPostRecv, kPollCq, kPollCqRecv, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"post_send", "post_send_rdma_write", "post_recv",
                                           "poll_cq", "poll_cq_recv"};

enum Path { kDirect, kShim, kShimOffset, kShimMigratable, kShimMigratableOffset, kNumPaths };
constexpr const char* kPathNames[kNumPaths] = {"direct", "shim", "shim-offset", "shim-migratable",
                                               "shim-migratable-offset"};

DataPathStack& StackOf(DataPathFixture& f, Path path) {
  switch (path) {
    case kShim:
      return f.shim();
    case kShimOffset:
      return f.shim_offset();
    case kShimMigratable:
      return f.shim_migratable();
    case kShimMigratableOffset:
      return f.shim_migratable_offset();
    case kDirect:
    case kNumPaths:
      break;
  }
  return f.direct();
}

// The other half of a receive batch, outside the measured loops.
bool PostReceives(DataPathStack& s, int n) {
  ibv_recv_wr* bad = nullptr;
  for (int i = 0; i < n; ++i) {
    if (ibv_post_recv(s.qp, &s.recv, &bad) != 0) return false;
  }
  return true;
}
bool PollReceives(DataPathStack& s, int n) {
  ibv_wc wc;
  for (int i = 0; i < n; ++i) {
    if (ibv_poll_cq(s.recv_cq, 1, &wc) != 1) return false;
  }
  return true;
}

// A thread's first call through the pause gate registers its mark (the
// slow path, once per thread): a receive posted and polled outside the
// measured loops, so that they count the steady state.
bool WarmUp(DataPathStack& s) { return PostReceives(s, 1) && PollReceives(s, 1); }

// Runs op on s in batches of kQueueDepth until at least n calls are done;
// false if a call failed.
bool Run(Op op, DataPathStack& s, long n) {
  constexpr int k = kQueueDepth;
  ibv_wc wc{};
  for (long done = 0; done < n; done += k) {
    bool ok = false;
    switch (op) {
      case kPostSend:
        ok = rdmavirt_bench_post_send_loop(s.qp, &s.send, k) == 0;
        break;
      case kPostSendRdmaWrite:
        ok = rdmavirt_bench_post_send_loop(s.qp, &s.write, k) == 0;
        break;
      case kPostRecv:
        ok = rdmavirt_bench_post_recv_loop(s.qp, &s.recv, k) == 0 && PollReceives(s, k);
        break;
      case kPollCq:
        ok = rdmavirt_bench_poll_cq_loop(s.send_cq, &wc, k) == k;
        break;
      case kPollCqRecv:
        ok = PostReceives(s, k) && rdmavirt_bench_poll_cq_loop(s.recv_cq, &wc, k) == k;
        break;
      case kNumOps:
        break;
    }
    if (!ok) return false;
  }
  return true;
}

// The shim translated and restored: what an application would notice.
bool CheckShimSemantics(DataPathFixture& f) {
  DataPathStack& s = f.shim_offset();
  const DataPathStack& d = f.direct();
  const ibv_send_wr send = s.send;
  const ibv_sge sge = s.send_sge;
  const uint32_t rkey = s.write.wr.rdma.rkey;
  ibv_wc wc{};
  bool ok = true;
  ibv_send_wr* bad_send = nullptr;
  ibv_recv_wr* bad_recv = nullptr;
  if (ibv_post_send(s.qp, &s.send, &bad_send) != 0 ||
      ibv_post_send(s.qp, &s.write, &bad_send) != 0 ||
      ibv_post_recv(s.qp, &s.recv, &bad_recv) != 0) {
    std::fprintf(stderr, "check: a post through the shim failed\n");
    ok = false;
  }
  if (s.send.next != send.next || s.send.sg_list != send.sg_list || s.send_sge.lkey != sge.lkey ||
      s.write.wr.rdma.rkey != rkey) {
    std::fprintf(stderr, "check: the shim left a work request changed\n");
    ok = false;
  }
  if (s.mr->lkey == d.mr->lkey || s.mr->rkey == d.mr->rkey || s.qp->qp_num == d.qp->qp_num) {
    std::fprintf(stderr, "check: the shim's keys or QPN are not virtual (offset mode)\n");
    ok = false;
  }
  for (ibv_cq* cq : {s.send_cq, s.recv_cq}) {
    if (ibv_poll_cq(cq, 1, &wc) != 1 || wc.qp_num != s.qp->qp_num) {
      std::fprintf(stderr, "check: completion has qp_num %#x, want the virtual %#x\n", wc.qp_num,
                   s.qp->qp_num);
      ok = false;
    }
  }
  return ok;
}

// Whether the stack's QP and both CQs are on `path` and the QP may be
// paused. The shim hands out its shadow objects' embedded verbs structs,
// first members (shim/core/objects.h).
bool GatedOn(const DataPathStack& s, shim::Path path) {
  const auto* qp = reinterpret_cast<const shim::Qp*>(s.qp);
  return qp->pause != nullptr && qp->path.get() == path &&
         reinterpret_cast<const shim::Cq*>(s.send_cq)->path.get() == path &&
         reinterpret_cast<const shim::Cq*>(s.recv_cq)->path.get() == path;
}

// The migratable stack's numbers are the probed path's only if it ran
// (a process's default: shim/datapath/thread_probe.h): its QP and CQs are on the
// marked path, and on a thread of its own (whose mark starts
// unregistered) a send, a receive and their polls succeed without
// registering the mark, which any call through the pause gate does
// (pause.h). The thread's receive is the queue's first: the thread owns
// the queue from then on (shim/datapath/recv_log.h).
bool CheckProbedPath(DataPathFixture& f) {
  DataPathStack& s = f.shim_migratable();
  if (!GatedOn(s, shim::Path::kMarked)) {
    std::fprintf(stderr, "check: the migratable stack has a queue off the marked path\n");
    return false;
  }
  const char* failed = nullptr;
  ibv_send_wr* bad = nullptr;
  ibv_wc wc{};
  if (shim::tls_thread_mark.registered) {
    failed = "a new thread's mark is registered";
  } else if (ibv_post_send(s.qp, &s.send, &bad) != 0 || ibv_poll_cq(s.send_cq, 1, &wc) != 1 ||
             !PostReceives(s, 1) || !PollReceives(s, 1)) {
    failed = "a post or poll failed";
  } else if (shim::tls_thread_mark.registered || shim::tls_thread_mark.depth.load() != 0) {
    failed = "the posts and polls went through the pause gate, not the probed path";
  }
  if (failed != nullptr) {
    std::fprintf(stderr, "check: migratable stack: %s\n", failed);
    return false;
  }
  return true;
}

// The migratable offset stack's numbers are those of a migratable
// process after a move only if its queues translate, probed: its QP and
// CQs are on the translating path; on a thread of its own (whose mark
// starts unregistered), a send, a receive and their polls leave the mark
// unregistered (the gate would register it), put the WRs back and return
// the completion with the virtual QPN.
bool CheckTranslatedProbedPath(DataPathFixture& f) {
  DataPathStack& s = f.shim_migratable_offset();
  const shim::Qp* qp = reinterpret_cast<const shim::Qp*>(s.qp);
  if (!GatedOn(s, shim::Path::kTranslated)) {
    std::fprintf(stderr, "check: the migratable offset stack is not translating or not gated\n");
    return false;
  }
  const char* failed = nullptr;
  [&] {
    if (shim::tls_thread_mark.registered) {
      failed = "a new thread's mark is registered";
      return;
    }
    const ibv_send_wr write = s.write;
    const ibv_sge sge = s.write_sge;
    ibv_send_wr* bad = nullptr;
    ibv_wc wc{};
    const ibv_recv_wr recv = s.recv;
    const ibv_sge recv_sge = *s.recv.sg_list;
    if (ibv_post_send(s.qp, &s.write, &bad) != 0 || ibv_poll_cq(s.send_cq, 1, &wc) != 1) {
      failed = "a post or poll on the migratable offset stack failed";
    } else if (!PostReceives(s, 1) || !PollReceives(s, 1)) {
      failed = "a receive on the migratable offset stack failed";
    } else if (std::memcmp(&recv, &s.recv, sizeof(recv)) != 0 ||
               std::memcmp(&recv_sge, s.recv.sg_list, sizeof(recv_sge)) != 0) {
      failed = "the shim left the receive work request changed";
    } else if (wc.qp_num != s.qp->qp_num || wc.qp_num == qp->physical_qpn) {
      failed = "the completion's QPN is not the virtual one";
    } else if (std::memcmp(&write, &s.write, sizeof(write)) != 0 ||
               std::memcmp(&sge, &s.write_sge, sizeof(sge)) != 0) {
      failed = "the shim left the work request changed";
    } else if (shim::tls_thread_mark.registered || shim::tls_thread_mark.depth.load() != 0) {
      failed = "the calls went through the pause gate, not the probed path";
    }
  }();
  if (failed != nullptr) {
    std::fprintf(stderr, "check: migratable offset stack: %s\n", failed);
    return false;
  }
  return true;
}

int Check(long n) {
  auto f = DataPathFixture::Create();
  if (!f.ok()) {
    std::fprintf(stderr, "shim_data_path_count: %s\n", f.status().ToString().c_str());
    return 1;
  }

  // The counters see what they should: one allocation, one lock.
  g_counting = true;
  void* volatile p = malloc(16);
  {
    std::mutex m;
    std::lock_guard<std::mutex> lock(m);
  }
  g_counting = false;
  free(p);
  if (g_allocations != 1 || g_locks != 1) {
    std::fprintf(stderr, "check: counter self-test saw %ld allocations, %ld locks\n", g_allocations,
                 g_locks);
    return 1;
  }

  // Each stack's checks and counts run on a thread of their own, the only
  // one that posts to its queues, as in the measured loops: the posts of a
  // receive queue that several threads post to take a lock.
  const long calls = (n + kQueueDepth - 1) / kQueueDepth * kQueueDepth;  // what Run does
  bool ok = true;
  for (Path path : {kShim, kShimOffset, kShimMigratable, kShimMigratableOffset}) {
    std::thread([&] {
      DataPathStack& s = StackOf(**f, path);
      bool checked = true;
      if (path == kShimOffset) checked = CheckShimSemantics(**f);
      if (path == kShimMigratable) checked = CheckProbedPath(**f);
      if (path == kShimMigratableOffset) checked = CheckTranslatedProbedPath(**f);
      // A stack that failed is not counted; the others still are.
      if (!checked || !WarmUp(s)) {
        std::fprintf(stderr, "check: %s: not counted\n", kPathNames[path]);
        ok = false;
        return;
      }
      for (int op = 0; op < kNumOps; ++op) {
        g_allocations = g_locks = 0;
        g_counting = true;
        const bool ran = Run(static_cast<Op>(op), s, n);
        g_counting = false;
        std::printf("%s %s x%ld: allocations %ld locks %ld%s\n", kOpNames[op], kPathNames[path],
                    calls, g_allocations, g_locks, ran ? "" : " (calls failed)");
        ok = ok && ran && g_allocations == 0 && g_locks == 0;
      }
    }).join();
  }
  return ok ? 0 : 1;
}

int Usage() {
  std::fprintf(stderr,
               "usage: shim_data_path_count OP direct|shim|shim-offset|shim-migratable|"
               "shim-migratable-offset N\n"
               "       shim_data_path_count --check N\n"
               "OP: post_send post_send_rdma_write post_recv poll_cq poll_cq_recv all\n");
  return 2;
}

bool ParseCount(const char* s, long* n) {
  char* end = nullptr;
  *n = std::strtol(s, &end, 10);
  return end != s && *end == '\0' && *n > 0;
}

int Main(int argc, char** argv) {
  long n = 0;
  if (argc == 3 && std::strcmp(argv[1], "--check") == 0) {
    return ParseCount(argv[2], &n) ? Check(n) : Usage();
  }
  if (argc != 4 || !ParseCount(argv[3], &n)) return Usage();
  const bool all = std::strcmp(argv[1], "all") == 0;
  int only = -1;
  for (int op = 0; op < kNumOps; ++op) {
    if (std::strcmp(argv[1], kOpNames[op]) == 0) only = op;
  }
  int path = -1;
  for (int p = 0; p < kNumPaths; ++p) {
    if (std::strcmp(argv[2], kPathNames[p]) == 0) path = p;
  }
  if ((!all && only < 0) || path < 0) return Usage();

  auto f = DataPathFixture::Create();
  if (!f.ok()) {
    std::fprintf(stderr, "shim_data_path_count: %s\n", f.status().ToString().c_str());
    return 1;
  }
  DataPathStack& s = StackOf(**f, static_cast<Path>(path));
  if (!WarmUp(s)) {
    std::fprintf(stderr, "shim_data_path_count: the warm-up receive failed\n");
    return 1;
  }
  for (int op = 0; op < kNumOps; ++op) {
    if (!all && op != only) continue;
    if (!Run(static_cast<Op>(op), s, n)) {
      std::fprintf(stderr, "shim_data_path_count: %s failed\n", kOpNames[op]);
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace rdmavirt::bench

int main(int argc, char** argv) { return rdmavirt::bench::Main(argc, argv); }
