// integrity: a plain libibverbs workload between two hosts that checks every
// byte it moves and counts every message lost, repeated, reordered or
// corrupted, for runs that are paused, checkpointed and moved to other hosts.
//
// Why it exists: whatever moves a verbs process (the rdmavirt shim and its
// migrator) must do it without the application noticing. This program knows
// nothing about that; it keeps a steady, self-describing stream going over
// the four kinds of traffic applications use, in both directions:
//   1. SENDs with immediate data over RC (imm = seq), payload derived from seq;
//   2. RDMA WRITEs into a ring in the peer's memory, each slot carrying seq,
//      pattern and checksum, announced by WRITE_WITH_IMM (even seq) or by a
//      plain WRITE followed by a SEND naming the seq (odd seq);
//   3. RDMA READs of a region of the peer whose content follows from a seed;
//   4. UD datagrams, sent only into receives the peer has posted;
//   5. with --canvas, RDMA WRITEs of small cells all over two large regions
//      of the peer (one on 4 KiB pages, one on transparent huge pages, which
//      also holds the receive buffers), each cell written once per pass;
//      at the end the peer checks every byte of both regions against the
//      last write each cell received, so a page whose HCA-written content
//      a checkpoint or a move lost shows up even if nothing announced it.
//
// One TCP connection carries the endpoints (QPNs, GIDs, rkeys, addresses,
// seeds) and a barrier; every socket is closed before the first RDMA
// operation, so that a checkpoint finds no socket to restore. From then on
// each side RDMA-WRITEs a checksummed status record (cumulative counters,
// which are also the credits for the peer's RC and UD sends, and whether it
// has finished) into a mailbox in the peer's memory. Both exit once both
// records say "finished": the final record is the last WR either side posts.
//
// Pauses: either side may be frozen for tens of seconds at any point. RC
// uses retry_cnt 7, rnr_retry 7 (infinite) and a long ACK timeout; every
// timeout counts this process's running time only (RunClock); nothing gives
// up in under 5 minutes except a missing UD datagram (after 60 s).
//
// A run is --iterations long, or shorter with --until-file: a side that
// finds the file stops where it is (it posts each kind of traffic up to the
// furthest seq any kind reached), its record says where, and its peer does
// the same when it reads that. A test then ends the workload when it has
// done what it needed, instead of sizing it in advance.
//
// Usage: integrity (--server | --connect HOST) [--port P] [options], see
// Usage(). Prints a counter line about once a second, then a JSON report
// (also to --report FILE). Exit status 0 iff neither side saw an error.
//
// Depends only on libibverbs and POSIX sockets, single-threaded.

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tests/apps/app_common.h"

namespace {

using namespace rdmavirt::apps;  // NOLINT: the programs' shared helpers

// ---------------------------------------------------------------------------
// Constants.

constexpr uint32_t kWireVersion = 3;
constexpr uint8_t kIbPort = 1;
constexpr uint32_t kQkey = 0x11111111;
constexpr size_t kGrhLen = 40;  // UD receives start with the GRH area

// Windows. Each bounds the WRs of one kind in flight, so the queue sizes
// follow from them and a post never finds its queue full.
constexpr size_t kRcRecvDepth = 64;  // RC receives posted: the peer's credits
constexpr size_t kUdRecvDepth = 64;  // UD receives posted: the peer's window
constexpr size_t kSendSlots = 64;    // data SENDs in flight
constexpr size_t kRingSlots = 32;    // ring slots written and not yet verified
constexpr size_t kReadDepth = 8;     // RDMA READs in flight (max_rd_atomic)
constexpr size_t kStatusSlots = 4;   // status records in flight
constexpr size_t kCanvasSlots = 8;   // canvas cells written and not yet completed
constexpr uint32_t kRcSendWr =
    kSendSlots + 2 * kRingSlots + kReadDepth + kStatusSlots + kCanvasSlots;
constexpr int kCqDepth = kRcSendWr + kUdRecvDepth + kRcRecvDepth + kUdRecvDepth;

// Sizes. Lengths vary with seq over these ranges, so messages of one packet,
// several packets and sizes that are multiples of nothing all occur.
constexpr uint32_t kMaxMsg = 4096;     // data SENDs, ring slots, READs
constexpr uint32_t kMaxUd = 1024;      // a datagram fits the 1024-byte path MTU
constexpr size_t kReadRegion = 65536;  // the region the peer reads
constexpr uint32_t kMinFrame = 32;     // header, checksum and some pattern
// --canvas: cells of the peer's two regions, kCanvasCells per 4 KiB page.
constexpr uint32_t kCanvasCell = 128;
constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kCanvasCellsPerPage = kPage / kCanvasCell;

// Bytes of SENDs, WRITEs, READs and datagrams in flight from one side. The
// lab's fabric (QEMU guests on a VDE switch, whose Unix datagram sockets
// queue 10 packets) drops bursts whenever a guest is slow to read; RC repairs
// that by retransmitting, UD cannot. A few packets in flight keep it lossless.
constexpr uint64_t kMaxInflightBytes = 8192;
constexpr double kMaxBurst = 4;  // posts of one kind at once, when paced
constexpr double kStatusIntervalS = 0.002;
constexpr double kMaxClockStep = 1.0;  // s; see RunClock
constexpr double kStallAfterS = 300;   // no progress at all: give up
constexpr int kMaxComplaints = 50;     // error lines on stderr

// ---------------------------------------------------------------------------
// Messages.

// Errors seen while running are counted; the first few are also described.
void Complain(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Complain(const char* fmt, ...) {
  static int complaints = 0;
  if (++complaints > kMaxComplaints) return;
  va_list ap;
  va_start(ap, fmt);
  const std::string msg = Vformat(fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "integrity: ERROR: %s%s\n", msg.c_str(),
               complaints == kMaxComplaints ? " (further errors not described)" : "");
}

// What backs a Buffer: whatever the kernel chooses, 4 KiB pages only, or
// transparent huge pages (2 MiB aligned, madvise(MADV_HUGEPAGE)).
enum class Pages { kAny, kSmall, kHuge };

// Zeroed anonymous memory of its own mapping, registered as one MR.
class Buffer {
 public:
  Buffer(ibv_pd* pd, size_t size, int access, Pages pages = Pages::kAny) {
    const size_t align = pages == Pages::kHuge ? kHugePage : kPage;
    len_ = (size + align - 1) / align * align;
    // Over-allocated by `align`, then trimmed to an aligned start.
    void* m =
        mmap(nullptr, len_ + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) Die("mmap(%zu bytes): %s", len_ + align, std::strerror(errno));
    const uintptr_t base = reinterpret_cast<uintptr_t>(m);
    const uintptr_t start = (base + align - 1) / align * align;
    if (start > base) munmap(m, start - base);
    if (const size_t tail = base + align - start; tail > 0) {
      munmap(reinterpret_cast<void*>(start + len_), tail);
    }
    mem_ = reinterpret_cast<uint8_t*>(start);
    if (pages != Pages::kAny &&
        madvise(mem_, len_, pages == Pages::kHuge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0) {
      Die("madvise(%s): %s", pages == Pages::kHuge ? "MADV_HUGEPAGE" : "MADV_NOHUGEPAGE",
          std::strerror(errno));
    }
    std::memset(mem_, 0, len_);  // faulted in now, on the pages asked for
    mr_.reset(ibv_reg_mr(pd, mem_, size, access));
    if (!mr_) Die("ibv_reg_mr(%zu bytes): %s", size, std::strerror(errno));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    mr_.reset();  // deregistered before the memory goes
    munmap(mem_, len_);
  }
  uint8_t* at(size_t off) const { return mem_ + off; }
  uint64_t addr() const { return reinterpret_cast<uintptr_t>(mem_); }
  uint32_t rkey() const { return mr_->rkey; }
  ibv_sge Sge(size_t off, uint32_t len) const {
    return ibv_sge{reinterpret_cast<uintptr_t>(at(off)), len, mr_->lkey};
  }

 private:
  uint8_t* mem_ = nullptr;
  size_t len_ = 0;
  Mr mr_;
};

// KiB of the mapping that holds `addr` backed by transparent huge pages
// (AnonHugePages in /proc/self/smaps), or -1 if it cannot be read.
long AnonHugeKib(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    if (std::sscanf(line.c_str(), "%lx%c%lx", &lo, &dash, &hi) == 3 && dash == '-') {
      inside = lo <= a && a < hi;
    } else if (long kib = 0;
               inside && std::sscanf(line.c_str(), "AnonHugePages: %ld kB", &kib) == 1) {
      return kib;
    }
  }
  return -1;
}

// ---------------------------------------------------------------------------
// Deterministic content. Every byte either side sends follows from the
// sender's seed, the kind of traffic and the seq, so the receiver checks
// every byte without a copy of what was sent.

// What a work request is: the top byte of its wr_id.
enum Kind : uint8_t {
  kSend,
  kWrite,
  kWrote,
  kRead,
  kUd,
  kStatus,
  kCanvas,
  kRcRecv,
  kUdRecv,
  kNumKinds
};

const char* KindName(Kind k) {
  static constexpr const char* kNames[kNumKinds] = {
      "SEND",    "RDMA_WRITE",         "SEND(wrote)",        "RDMA_READ",
      "UD SEND", "RDMA_WRITE(status)", "RDMA_WRITE(canvas)", "RECV",
      "UD RECV"};
  return k < kNumKinds ? kNames[k] : "unknown";
}

constexpr uint64_t kSeqMask = (uint64_t{1} << 56) - 1;
uint64_t WrId(Kind k, uint64_t seq) { return (uint64_t{k} << 56) | (seq & kSeqMask); }
Kind WrKind(uint64_t wr_id) { return static_cast<Kind>(wr_id >> 56); }
uint64_t WrSeq(uint64_t wr_id) { return wr_id & kSeqMask; }

// splitmix64's finalizer: cheap, and every input bit reaches every output bit.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Key(uint64_t seed, Kind kind, uint64_t seq) {
  return Mix(seed ^ (uint64_t{kind} << 56) ^ Mix(seq));
}

// Byte `pos` of the pattern of `key` is byte pos % 8 of Mix(key + pos / 8),
// so a region can be filled or checked from any offset.
template <typename Visit>
size_t WalkPattern(size_t len, uint64_t key, size_t start, Visit visit) {
  for (size_t i = 0; i < len;) {
    const uint64_t word = Mix(key + (start + i) / 8);
    for (size_t b = (start + i) % 8; b < 8 && i < len; ++b, ++i) {
      if (!visit(i, static_cast<uint8_t>(word >> (8 * b)))) return i;
    }
  }
  return len;
}

void FillPattern(uint8_t* p, size_t len, uint64_t key, size_t start) {
  WalkPattern(len, key, start, [p](size_t i, uint8_t v) {
    p[i] = v;
    return true;
  });
}

// Index of the first byte that is not the pattern, or len.
size_t FirstMismatch(const uint8_t* p, size_t len, uint64_t key, size_t start) {
  return WalkPattern(len, key, start, [p](size_t i, uint8_t v) { return p[i] == v; });
}

uint64_t Fnv1a64(const uint8_t* p, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

uint32_t VaryLen(Kind kind, uint64_t seq, uint32_t max) {
  return kMinFrame + static_cast<uint32_t>(Mix(seq * 31 + kind) % (max - kMinFrame + 1));
}

// The span of the peer's read region that READ `seq` covers: any offset and
// length, so unaligned starts and ends occur.
std::pair<uint32_t, uint32_t> ReadSpan(uint64_t seq) {
  const uint32_t len = VaryLen(kRead, seq, kMaxMsg);
  return {static_cast<uint32_t>(Mix(seq ^ 0x52454144ull) % (kReadRegion - len + 1)), len};
}

// A frame (data SEND, datagram, ring slot): header, pattern of (seed, kind,
// seq), and for ring slots a checksum of all before it in the last 8 bytes.
struct FrameHeader {
  uint64_t seq;
  uint32_t len;
  uint32_t kind;
};

void WriteFrame(uint8_t* p, uint32_t len, uint64_t seed, Kind kind, uint64_t seq, bool checksum) {
  const FrameHeader h{seq, len, kind};
  std::memcpy(p, &h, sizeof(h));
  FillPattern(p + sizeof(h), len - sizeof(h) - (checksum ? 8 : 0), Key(seed, kind, seq), 0);
  if (checksum) {
    const uint64_t sum = Fnv1a64(p, len - 8);
    std::memcpy(p + len - 8, &sum, 8);
  }
}

// Empty if `p` holds the `want_len`-byte frame of `seq`, else what is wrong.
std::string CheckFrame(const uint8_t* p, uint32_t len, uint32_t want_len, uint64_t seed, Kind kind,
                       uint64_t seq, bool checksum) {
  if (len != want_len) return Sprintf("length %u, expected %u", len, want_len);
  FrameHeader h;
  std::memcpy(&h, p, sizeof(h));
  if (h.seq != seq || h.len != len || h.kind != kind) {
    return Sprintf("header says seq %" PRIu64 " len %u kind %u", h.seq, h.len, h.kind);
  }
  const uint32_t body = len - sizeof(h) - (checksum ? 8 : 0);
  if (const size_t bad = FirstMismatch(p + sizeof(h), body, Key(seed, kind, seq), 0); bad < body) {
    return Sprintf("byte %zu differs from the pattern", sizeof(h) + bad);
  }
  if (checksum) {
    uint64_t sum;
    std::memcpy(&sum, p + len - 8, 8);
    if (sum != Fnv1a64(p, len - 8)) return "checksum differs";
  }
  return "";
}

// The announcement of a plain RDMA WRITE: a SEND without immediate data.
struct WroteMsg {
  uint64_t magic;
  uint64_t seq;
};
constexpr uint64_t kWroteMagic = 0x5752495454454e21ull;

// ---------------------------------------------------------------------------
// Coordination over RDMA: the record each side writes into the peer's
// mailbox. All counters are cumulative, so only the newest record matters.

enum State : uint64_t { kRunning = 1, kFinished = 2 };

struct Status {
  uint64_t gen;             // grows with every record written
  uint64_t state;           // State
  uint64_t rc_reposted;     // RC receives reposted after use: the peer's credits
  uint64_t ud_reposted;     // UD receives reposted after use
  uint64_t ud_lost;         // datagrams given up on: their receives are still posted
  uint64_t sends_handled;   // the peer's data SENDs checked (intact or not)
  uint64_t writes_handled;  // the peer's ring slots checked: free to reuse
  uint64_t ud_handled;      // the peer's datagrams received or given up on
  uint64_t ud_sent;         // datagrams this side has sent
  uint64_t errors;          // errors this side has counted
  uint64_t canvas_written;  // canvas cells this side wrote into the peer (completed)
  uint64_t last;            // this side sends seqs [0, last) of each kind (--until-file)
  uint64_t checksum;
};

uint64_t StatusChecksum(const Status& s) {
  // Keyed, so that an all-zero mailbox (nothing written yet) is not valid.
  return Mix(Fnv1a64(reinterpret_cast<const uint8_t*>(&s), offsetof(Status, checksum)) ^
             0x5354415455530001ull);
}

// ---------------------------------------------------------------------------
// Time.

// Seconds this process has been running. Each step of the monotonic clock is
// capped at kMaxClockStep: a longer one means the process was frozen, or
// restored on a host whose monotonic clock is elsewhere. A freeze must count
// neither against the peer's deadlines nor as time owed to the pacers.
class RunClock {
 public:
  double Now() {
    const auto t = std::chrono::steady_clock::now();
    now_ += std::clamp(std::chrono::duration<double>(t - last_).count(), 0.0, kMaxClockStep);
    last_ = t;
    return now_;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
  double now_ = 0;
};

// Wall time for the report: the same before and after a move between hosts.
double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Paces one kind of traffic at `rate` posts per second of running time, with
// bursts of at most kMaxBurst and no catching up after a stall: on the lab's
// fabric a burst of packets becomes a burst of drops.
class Pacer {
 public:
  // Whether one more post is allowed now (rate 0: always).
  bool Take(double now, double rate) {
    if (rate == 0) return true;
    tokens_ = std::min(kMaxBurst, tokens_ + (now - last_) * rate);
    last_ = now;
    if (tokens_ < 1) return false;
    tokens_ -= 1;
    return true;
  }

 private:
  double tokens_ = 1;
  double last_ = 0;
};

// ---------------------------------------------------------------------------
// Checking what arrives.

struct Tally {
  uint64_t ok = 0;
  uint64_t lost = 0;
  uint64_t duplicated = 0;
  uint64_t corrupted = 0;
  uint64_t out_of_order = 0;
  uint64_t Errors() const { return lost + duplicated + corrupted + out_of_order; }
};

// One numbered stream from the peer: each seq in [0, total) must arrive
// exactly once and intact; in order if `ordered` (RC), else reordering is
// only noted (UD may reorder).
class Stream {
 public:
  Stream(const char* name, bool ordered) : name_(name), ordered_(ordered) {}
  void Reset(uint64_t total) { state_.assign(total, kMissing); }

  // Records `seq`; verify() (true: intact) runs only for a seq new and in range.
  template <typename Verify>
  void Arrive(uint64_t seq, Verify verify) {
    if (seq >= state_.size()) {
      ++tally.corrupted;
      Complain("%s: seq %" PRIu64 " was never sent", name_, seq);
      return;
    }
    if (state_[seq] != kMissing) {
      // A datagram counted lost that shows up after all is late, not repeated.
      ++(state_[seq] == kLost ? reordered : tally.duplicated);
      Complain("%s: seq %" PRIu64 " arrived %s", name_, seq,
               state_[seq] == kLost ? "after it was counted lost" : "again");
      state_[seq] = kArrived;
      return;
    }
    if (seq < end_) {
      ++(ordered_ ? tally.out_of_order : reordered);
      if (ordered_) Complain("%s: seq %" PRIu64 " arrived after %" PRIu64, name_, seq, end_ - 1);
    }
    state_[seq] = kArrived;
    end_ = std::max(end_, seq + 1);
    ++handled_;
    ++(verify() ? tally.ok : tally.corrupted);
    Advance();
  }

  void DeclareLost(uint64_t seq) {
    state_[seq] = kLost;
    ++handled_;
    ++tally.lost;
    Advance();
  }

  // The first `limit` seqs neither arrived nor declared lost.
  std::vector<uint64_t> Missing(size_t limit) const {
    std::vector<uint64_t> out;
    for (uint64_t s = next_; s < state_.size() && out.size() < limit; ++s)
      if (state_[s] == kMissing) out.push_back(s);
    return out;
  }

  // The peer sends seqs [0, total) only, fewer than Reset said; false
  // (nothing changed) if one at or past it has arrived.
  bool End(uint64_t total) {
    if (total < end_) return false;
    if (total < state_.size()) state_.resize(total);
    return true;
  }
  uint64_t total() const { return state_.size(); }
  uint64_t handled() const { return handled_; }     // arrived or declared lost
  uint64_t first_missing() const { return next_; }  // lowest seq not handled
  const char* name() const { return name_; }
  uint64_t end() const { return end_; }  // 1 + the highest seq arrived

  Tally tally;
  uint64_t reordered = 0;

 private:
  enum : uint8_t { kMissing, kArrived, kLost };
  void Advance() {
    while (next_ < state_.size() && state_[next_] != kMissing) ++next_;
  }
  const char* name_;
  bool ordered_;
  std::vector<uint8_t> state_;
  uint64_t handled_ = 0, next_ = 0, end_ = 0;
};

// ---------------------------------------------------------------------------
// Options and the TCP phase.

struct Options {
  bool server = false;
  std::string connect;  // the server's host (client side)
  int port = 18800;
  std::string device = "rxe0";
  int gid_index = 1;
  uint64_t iterations = 1000;  // messages of each kind in each direction
  double rate = 50;            // iterations per second; 0: as fast as the windows allow
  std::string report;
  int ack_timeout = 20;  // 4.096 us << 20 = 4.3 s per try; 8 tries: 34 s of silence
  double ud_lost_after_s = 60;
  // Private memory that no verb touches, filled with a known pattern and
  // checked at the end: a larger image to dump and move, and a check that
  // the process's plain memory came through intact too.
  uint64_t ballast_mib = 0;
  // MiB of each of the two canvas regions the peer writes into (0: none).
  uint64_t canvas_mib = 0;
  // Stop early once this file exists (looked for once a second).
  std::string until_file;
  // Testing the checker: corrupts one byte of the SEND, the ring slot, the
  // datagram and the canvas cell of this seq, and one byte of the region
  // the peer reads.
  int64_t inject_corruption = -1;
};

[[noreturn]] void Usage() {
  std::fprintf(stderr,
               "usage: integrity (--server | --connect HOST) [--port P (18800)]\n"
               "         [--device NAME (rxe0)] [--gid-index N (1)] [--iterations N (1000)]\n"
               "         [--rate ITERATIONS_PER_S (50; 0: unpaced)] [--report FILE]\n"
               "         [--ack-timeout T (20: 4.096 us * 2^T per try)] [--ud-lost-after S (60)]\n"
               "         [--ballast MIB (0)] [--canvas MIB (0)] [--until-file PATH]\n"
               "Each iteration is one SEND, one RDMA WRITE, one RDMA READ and one UD\n"
               "datagram in each direction, and one canvas cell into a peer that has\n"
               "--canvas: MIB on 4 KiB pages and MIB on huge pages, checked whole at the end.\n"
               "--until-file: once PATH exists (looked for once a second), this side stops\n"
               "where it is, and so does its peer when it learns of it; every message sent\n"
               "until then is still checked.\n");
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
    if (a == "--server") {
      o.server = true;
    } else if (a == "--connect") {
      o.connect = value();
    } else if (a == "--port") {
      o.port = std::atoi(value());
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--gid-index") {
      o.gid_index = std::atoi(value());
    } else if (a == "--iterations") {
      o.iterations = std::strtoull(value(), nullptr, 10);
    } else if (a == "--rate") {
      o.rate = std::atof(value());
    } else if (a == "--report") {
      o.report = value();
    } else if (a == "--ack-timeout") {
      o.ack_timeout = std::atoi(value());
    } else if (a == "--ud-lost-after") {
      o.ud_lost_after_s = std::atof(value());
    } else if (a == "--ballast") {
      o.ballast_mib = std::strtoull(value(), nullptr, 10);
    } else if (a == "--canvas") {
      o.canvas_mib = std::strtoull(value(), nullptr, 10);
    } else if (a == "--until-file") {
      o.until_file = value();
    } else if (a == "--inject-corruption") {
      o.inject_corruption = std::atoll(value());
    } else {
      Usage();
    }
  }
  // Immediate data carries the seq: 32 bits.
  if (o.server == !o.connect.empty() || o.port <= 0 || o.port > 65535 || o.gid_index < 0 ||
      o.iterations == 0 || o.iterations > UINT32_MAX || o.rate < 0 || o.ack_timeout < 1 ||
      o.ack_timeout > 31 || o.ud_lost_after_s <= 0 || o.ballast_mib > 65536 ||
      o.canvas_mib > 4096) {
    Usage();
  }
  return o;
}

// What one side tells the other. Both ends run this binary on the same
// architecture, so host byte order is shared.
struct WireInfo {
  uint32_t version;
  uint32_t rc_qpn;
  uint32_t ud_qpn;
  uint32_t rc_psn;
  uint64_t iterations;
  uint64_t seed;
  uint64_t ring_addr;
  uint64_t read_addr;
  uint64_t mailbox_addr;
  uint32_t ring_rkey;
  uint32_t read_rkey;
  uint32_t mailbox_rkey;
  uint32_t reserved;
  uint8_t gid[16];
  uint64_t canvas_bytes;  // of each region; 0: no canvas
  uint64_t canvas_addr[2];
  uint32_t canvas_rkey[2];
};

// Where canvas write `n` lands in a peer whose regions have `region_bytes`
// each: writes alternate between the regions (0: 4 KiB pages, 1: huge
// pages); a region's k-th write goes to cell k modulo its cells, taken page
// after page (slot k / pages of page k % pages), so that consecutive writes
// dirty different pages and each page is written again every `pages` writes.
struct CanvasSpot {
  int region;
  size_t offset;
};
CanvasSpot CanvasSpotOf(uint64_t n, size_t region_bytes) {
  const size_t pages = region_bytes / kPage;
  const uint64_t k = (n / 2) % (pages * kCanvasCellsPerPage);
  return {static_cast<int>(n % 2), (k % pages) * kPage + (k / pages) * kCanvasCell};
}

// ---------------------------------------------------------------------------
// The workload.

// Local buffers, one MR each. tx: sources of everything this side posts, one
// slot per WR in flight; rx: destinations of receives and READs.
constexpr size_t kTxSendOff = 0;
constexpr size_t kTxWriteOff = kTxSendOff + kSendSlots * kMaxMsg;
constexpr size_t kTxWroteOff = kTxWriteOff + kRingSlots * kMaxMsg;
constexpr size_t kTxUdOff = kTxWroteOff + kRingSlots * sizeof(WroteMsg);
constexpr size_t kTxStatusOff = kTxUdOff + kUdRecvDepth * kMaxUd;
constexpr size_t kTxCanvasOff = kTxStatusOff + kStatusSlots * sizeof(Status);
constexpr size_t kTxSize = kTxCanvasOff + kCanvasSlots * kCanvasCell;
constexpr size_t kUdRecvSlot = kGrhLen + kMaxUd;
constexpr size_t kRxRcOff = 0;
constexpr size_t kRxUdOff = kRxRcOff + kRcRecvDepth * kMaxMsg;
constexpr size_t kRxReadOff = kRxUdOff + kUdRecvDepth * kUdRecvSlot;
constexpr size_t kRxSize = kRxReadOff + kReadDepth * kMaxMsg;

class Integrity {
 public:
  explicit Integrity(const Options& opt);
  // Opens the device and creates every verbs object; receives are posted.
  void Open();
  // The TCP phase: endpoints exchanged, QPs connected, then every socket closed.
  void Connect();
  // The RDMA phase, until both sides have finished or this one gives up.
  void Run();
  // Prints and writes the report; returns the exit status.
  int Report();

 private:
  // One kind of WR this side posts: its source (or destination) slots, one
  // per WR in flight, and for the four kinds of traffic the seqs posted and
  // completed and their pace.
  struct Lane {
    struct Slot {
      uint64_t seq_plus_1 = 0;  // 0: free
      uint32_t bytes = 0;       // counted in inflight_bytes_
    };
    std::vector<Slot> slots;
    uint64_t next = 0;
    uint64_t done = 0;
    Pacer pacer;
  };

  bool Poll();
  void OnSendDone(const ibv_wc& wc);
  void OnRcRecv(const ibv_wc& wc);
  void OnUdRecv(const ibv_wc& wc);
  void CheckRingSlot(uint64_t seq);
  void DeclareUdLosses();
  bool ReadMailbox();
  bool PostSends();
  bool PostWrites();
  bool PostReads();
  bool PostUd();
  bool PostStatus();
  bool PostCanvas();
  // Checks every byte of both canvas regions against the peer's last write
  // to each cell (the peer's final record says how many it made).
  Tally VerifyCanvas();
  void PrintLive(bool force);

  // Whether the next seq of `kind`, of `bytes` bytes, may be posted now:
  // not past the last, its slot free, room in flight, and the pace allows it.
  bool CanPost(Kind kind, uint32_t bytes);
  // Posts `wr` (and WRs chained to it) and takes the slot of each; `bytes`
  // of the first count as in flight.
  bool Post(ibv_qp* qp, ibv_send_wr* wr, uint32_t bytes);
  void PostRecv(ibv_qp* qp, Kind kind, uint64_t slot);
  void Abort(const std::string& why);
  bool RcCredit() const { return rc_msgs_ < kRcRecvDepth + peer_.rc_reposted; }
  bool TxDone() const;
  bool RxDone() const;
  // --until-file: this side sends up to the furthest seq any kind reached.
  void Stop(const char* why);
  // The peer's record says it sends fewer than it said at the start.
  void PeerStops(uint64_t last);
  uint64_t Errors() const;

  const Options opt_;
  const uint64_t seed_;
  WireInfo remote_{};
  ibv_gid gid_{};

  // Member order is the reverse of destruction order: QPs and the AH go
  // before the MRs and the CQ, which go before the PD and the context.
  Context ctx_;
  Pd pd_;
  Cq cq_;
  std::unique_ptr<Buffer> tx_, rx_, ring_, read_, mailbox_;
  std::unique_ptr<Buffer> canvas_[2];  // --canvas: 4 KiB pages, huge pages
  long canvas_huge_kib_ = 0;           // of canvas_[1], once faulted in
  Qp rc_, ud_;
  Ah ah_;

  // Sending side.
  std::array<Lane, kNumKinds> lanes_;
  uint64_t rc_msgs_ = 0;  // posted WRs that consume one of the peer's RC receives
  uint64_t inflight_bytes_ = 0;

  // Receiving side.
  Stream sends_in_{"SEND", true}, writes_in_{"RDMA WRITE", true}, ud_in_{"UD", false};
  Tally reads_;
  uint64_t rc_reposted_ = 0, ud_reposted_ = 0;
  // When each count of the peer's datagrams became known to be sent.
  std::deque<std::pair<uint64_t, double>> ud_known_;
  uint64_t completion_errors_ = 0;
  std::string fatal_;
  // Where the process ran: (host, pid, wall time first seen there), one
  // entry each time either changes (checked once a second).
  struct Place {
    std::string host;
    int pid;
    double since;
    uint64_t ud_sent_from;            // the first UD seq sent from here
    uint64_t ud_arrivals_before = 0;  // the peer's datagrams taken before it got here
  };
  std::vector<Place> places_;
  // Per UD seq of the peer's: 1 + the index of the place where it arrived
  // (0: never). A datagram missing between two that arrived at one place
  // was lost while this side stayed there (JsonUdMissing).
  std::vector<uint32_t> ud_place_;
  std::vector<uint64_t> ud_ordinal_;  // per seq: how many had arrived before it
  uint64_t ud_arrivals_ = 0;
  std::string JsonUdMissing() const;
  void NotePlace();
  std::string JsonPlaces() const;

  // Coordination.
  uint64_t iterations_;        // this side sends seqs [0, iterations_) of each kind
  uint64_t peer_iterations_;   // ... and the peer [0, peer_iterations_)
  bool stopped_ = false;       // iterations_ came down (Stop)
  double until_checked_ = -1;  // when --until-file was last looked for
  Status peer_{};              // the newest record found in our mailbox
  Status last_sent_{};         // the newest record posted to the peer's
  double last_status_at_ = -1;
  bool finished_ = false;    // the final record is posted: no WR will follow
  bool final_done_ = false;  // ... and it has completed

  RunClock clock_;
  double now_ = 0, last_progress_ = 0, last_live_ = 0;
  double start_wall_ = 0, end_wall_ = 0;

  // --ballast: word i holds BallastWord(i); each differing 4 KiB page counts
  // as one corrupted.
  std::vector<uint64_t> ballast_;
  uint64_t BallastWord(uint64_t i) const { return (i + 1) * 0x9e3779b97f4a7c15ull ^ seed_; }
};

Integrity::Integrity(const Options& opt)
    : opt_(opt),
      seed_((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()),
      iterations_(opt.iterations),
      peer_iterations_(0) {
  const std::pair<Kind, size_t> slots[] = {
      {kSend, kSendSlots}, {kWrite, kRingSlots},    {kWrote, kRingSlots},   {kRead, kReadDepth},
      {kUd, kUdRecvDepth}, {kStatus, kStatusSlots}, {kCanvas, kCanvasSlots}};
  for (const auto& [kind, n] : slots) lanes_[kind].slots.resize(n);
  ballast_.resize(opt.ballast_mib << 17);  // 2^20 / 8 words per MiB
  for (uint64_t i = 0; i < ballast_.size(); ++i) ballast_[i] = BallastWord(i);
}

void Integrity::Open() {
  int n = 0;
  DeviceList list(ibv_get_device_list(&n));
  if (!list) Die("ibv_get_device_list: %s", std::strerror(errno));
  for (int i = 0; i < n && !ctx_; ++i) {
    if (opt_.device == ibv_get_device_name(list.get()[i])) {
      ctx_.reset(ibv_open_device(list.get()[i]));
      if (!ctx_) Die("ibv_open_device(%s): %s", opt_.device.c_str(), std::strerror(errno));
    }
  }
  if (!ctx_) Die("no RDMA device named %s", opt_.device.c_str());
  ibv_port_attr port{};
  if (const int rc = ibv_query_port(ctx_.get(), kIbPort, &port); rc != 0) {
    Die("ibv_query_port: %s", std::strerror(rc));
  }
  // Both sides use a 1024-byte path MTU, which datagrams of kMaxUd fit.
  if (port.active_mtu < IBV_MTU_1024) Die("port MTU below 1024");
  if (ibv_query_gid(ctx_.get(), kIbPort, opt_.gid_index, &gid_) != 0) {
    Die("ibv_query_gid(%d): %s", opt_.gid_index, std::strerror(errno));
  }
  pd_.reset(ibv_alloc_pd(ctx_.get()));
  if (!pd_) Die("ibv_alloc_pd: %s", std::strerror(errno));
  cq_.reset(ibv_create_cq(ctx_.get(), kCqDepth, nullptr, nullptr, 0));
  if (!cq_) Die("ibv_create_cq: %s", std::strerror(errno));

  constexpr int kRemoteWrite = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  tx_ = std::make_unique<Buffer>(pd_.get(), kTxSize, 0);
  // With a canvas, what SENDs, datagrams and READs bring lands on huge pages too.
  rx_ = std::make_unique<Buffer>(pd_.get(), kRxSize, IBV_ACCESS_LOCAL_WRITE,
                                 opt_.canvas_mib > 0 ? Pages::kHuge : Pages::kAny);
  ring_ = std::make_unique<Buffer>(pd_.get(), kRingSlots * kMaxMsg, kRemoteWrite);
  read_ = std::make_unique<Buffer>(pd_.get(), kReadRegion, IBV_ACCESS_REMOTE_READ);
  FillPattern(read_->at(0), kReadRegion, Key(seed_, kRead, 0), 0);
  mailbox_ = std::make_unique<Buffer>(pd_.get(), sizeof(Status), kRemoteWrite);
  if (opt_.canvas_mib > 0) {
    const size_t bytes = opt_.canvas_mib << 20;
    for (int r = 0; r < 2; ++r) {
      canvas_[r] = std::make_unique<Buffer>(pd_.get(), bytes, kRemoteWrite,
                                            r == 0 ? Pages::kSmall : Pages::kHuge);
      // Cells nobody writes keep this; a page that comes back zeroed fails.
      FillPattern(canvas_[r]->at(0), bytes, Key(seed_, kCanvas, kSeqMask - r), 0);
    }
    canvas_huge_kib_ = AnonHugeKib(canvas_[1]->at(0));
  }

  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_.get();
  init.qp_type = IBV_QPT_RC;
  init.cap = {kRcSendWr, kRcRecvDepth, 1, 1, 0};
  rc_.reset(ibv_create_qp(pd_.get(), &init));
  if (!rc_) Die("ibv_create_qp(RC): %s", std::strerror(errno));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = kIbPort;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  constexpr int kInitMask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (const int rc = ibv_modify_qp(rc_.get(), &a, kInitMask | IBV_QP_ACCESS_FLAGS); rc != 0) {
    Die("ibv_modify_qp(RC INIT): %s", std::strerror(rc));
  }

  init.qp_type = IBV_QPT_UD;
  init.cap = {kUdRecvDepth, kUdRecvDepth, 1, 1, 0};
  ud_.reset(ibv_create_qp(pd_.get(), &init));
  if (!ud_) Die("ibv_create_qp(UD): %s", std::strerror(errno));
  a = {};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = kIbPort;
  a.qkey = kQkey;
  int rc = ibv_modify_qp(ud_.get(), &a, kInitMask | IBV_QP_QKEY);
  a = {};
  a.qp_state = IBV_QPS_RTR;
  if (rc == 0) rc = ibv_modify_qp(ud_.get(), &a, IBV_QP_STATE);
  a.qp_state = IBV_QPS_RTS;
  if (rc == 0) rc = ibv_modify_qp(ud_.get(), &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
  if (rc != 0) Die("ibv_modify_qp(UD to RTS): %s", std::strerror(rc));

  for (uint64_t i = 0; i < kRcRecvDepth; ++i) PostRecv(rc_.get(), kRcRecv, i);
  for (uint64_t i = 0; i < kUdRecvDepth; ++i) PostRecv(ud_.get(), kUdRecv, i);
  if (!fatal_.empty()) Die("%s", fatal_.c_str());
}

void Integrity::Connect() {
  WireInfo mine{};
  mine.version = kWireVersion;
  mine.rc_qpn = rc_->qp_num;
  mine.ud_qpn = ud_->qp_num;
  mine.rc_psn = static_cast<uint32_t>(seed_ >> 40);
  mine.iterations = opt_.iterations;
  mine.seed = seed_;
  mine.ring_addr = ring_->addr();
  mine.ring_rkey = ring_->rkey();
  mine.read_addr = read_->addr();
  mine.read_rkey = read_->rkey();
  mine.mailbox_addr = mailbox_->addr();
  mine.mailbox_rkey = mailbox_->rkey();
  std::memcpy(mine.gid, gid_.raw, 16);
  if (opt_.canvas_mib > 0) {
    mine.canvas_bytes = opt_.canvas_mib << 20;
    for (int r = 0; r < 2; ++r) {
      mine.canvas_addr[r] = canvas_[r]->addr();
      mine.canvas_rkey[r] = canvas_[r]->rkey();
    }
  }
  {
    const UniqueFd fd = opt_.server ? AcceptOne(opt_.port) : ConnectTo(opt_.connect, opt_.port);
    SendAll(fd.get(), &mine, sizeof(mine));
    RecvAll(fd.get(), &remote_, sizeof(remote_));
    if (remote_.version != kWireVersion) Die("the peer speaks version %u", remote_.version);

    ibv_ah_attr ah{};
    ah.is_global = 1;
    std::memcpy(ah.grh.dgid.raw, remote_.gid, 16);
    ah.grh.sgid_index = static_cast<uint8_t>(opt_.gid_index);
    ah.grh.hop_limit = 64;
    ah.port_num = kIbPort;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = remote_.rc_qpn;
    a.rq_psn = remote_.rc_psn;
    a.max_dest_rd_atomic = kReadDepth;
    a.min_rnr_timer = 12;  // 0.64 ms; no RNR happens while credits are honoured
    a.ah_attr = ah;
    int rc = ibv_modify_qp(rc_.get(), &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc != 0) Die("ibv_modify_qp(RC RTR): %s", std::strerror(rc));
    // Pauses of tens of seconds: retry counters at their maximum (rnr_retry
    // 7 means forever) and a long wait for each ACK.
    a = {};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = static_cast<uint8_t>(opt_.ack_timeout);
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = mine.rc_psn;
    a.max_rd_atomic = kReadDepth;
    rc = ibv_modify_qp(rc_.get(), &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc != 0) Die("ibv_modify_qp(RC RTS): %s", std::strerror(rc));
    ah_.reset(ibv_create_ah(pd_.get(), &ah));
    if (!ah_) Die("ibv_create_ah: %s", std::strerror(errno));

    // Barrier: both QPs are connected and all receives posted before either
    // side sends anything.
    char ready = 'r';
    SendAll(fd.get(), &ready, 1);
    RecvAll(fd.get(), &ready, 1);
  }  // the last socket closes here
  peer_iterations_ = remote_.iterations;
  sends_in_.Reset(remote_.iterations);
  writes_in_.Reset(remote_.iterations);
  ud_in_.Reset(remote_.iterations);
  ud_place_.assign(remote_.iterations, 0);
  ud_ordinal_.assign(remote_.iterations, 0);
}

void Integrity::PostRecv(ibv_qp* qp, Kind kind, uint64_t slot) {
  ibv_sge sge = kind == kRcRecv ? rx_->Sge(kRxRcOff + slot * kMaxMsg, kMaxMsg)
                                : rx_->Sge(kRxUdOff + slot * kUdRecvSlot, kUdRecvSlot);
  ibv_recv_wr wr{};
  wr.wr_id = WrId(kind, slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (const int rc = ibv_post_recv(qp, &wr, &bad); rc != 0) {
    Abort(Sprintf("ibv_post_recv(%s): %s", KindName(kind), std::strerror(rc)));
  }
}

bool Integrity::CanPost(Kind kind, uint32_t bytes) {
  const Lane& l = lanes_[kind];
  return l.next < iterations_ && l.slots[l.next % l.slots.size()].seq_plus_1 == 0 &&
         (inflight_bytes_ == 0 || inflight_bytes_ + bytes <= kMaxInflightBytes) &&
         lanes_[kind].pacer.Take(now_, opt_.rate);
}

bool Integrity::Post(ibv_qp* qp, ibv_send_wr* wr, uint32_t bytes) {
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(qp, wr, &bad); rc != 0) {
    Abort(Sprintf("ibv_post_send(%s): %s", KindName(WrKind(wr->wr_id)), std::strerror(rc)));
    return false;
  }
  for (; wr != nullptr; wr = wr->next, bytes = 0) {
    Lane& l = lanes_[WrKind(wr->wr_id)];
    const uint64_t seq = WrSeq(wr->wr_id);
    l.slots[seq % l.slots.size()] = {seq + 1, bytes};
    l.next = seq + 1;
    inflight_bytes_ += bytes;
  }
  return true;
}

void Integrity::Abort(const std::string& why) {
  if (!fatal_.empty()) return;
  fatal_ = why;
  Complain("giving up: %s", why.c_str());
}

uint64_t Integrity::Errors() const {
  return completion_errors_ + (fatal_.empty() ? 0 : 1) + sends_in_.tally.Errors() +
         writes_in_.tally.Errors() + ud_in_.tally.Errors() + reads_.Errors();
}

bool Integrity::TxDone() const {
  const uint64_t n = iterations_;
  return lanes_[kSend].done == n && peer_.sends_handled == n && lanes_[kWrite].done == n &&
         peer_.writes_handled == n && lanes_[kRead].done == n && lanes_[kUd].done == n &&
         peer_.ud_handled == n && lanes_[kCanvas].done == (remote_.canvas_bytes > 0 ? n : 0);
}

bool Integrity::RxDone() const {
  const uint64_t n = peer_iterations_;
  return sends_in_.handled() == n && writes_in_.handled() == n && ud_in_.handled() == n;
}

void Integrity::Stop(const char* why) {
  if (stopped_) return;
  stopped_ = true;
  uint64_t last = 0;
  for (const Kind k : {kSend, kWrite, kRead, kUd, kCanvas}) last = std::max(last, lanes_[k].next);
  iterations_ = std::min(iterations_, last);
  std::printf("integrity: stopping at %" PRIu64 " iterations: %s\n", iterations_, why);
  std::fflush(stdout);
}

void Integrity::PeerStops(uint64_t last) {
  for (Stream* s : {&sends_in_, &writes_in_, &ud_in_}) {
    if (!s->End(last)) {
      Abort(Sprintf("the peer says it sends %" PRIu64 " of each kind, but %s seq %" PRIu64
                    " arrived",
                    last, s->name(), s->end() - 1));
      return;
    }
  }
  peer_iterations_ = last;
  ud_place_.resize(std::min<size_t>(ud_place_.size(), last));
  ud_ordinal_.resize(ud_place_.size());
  Stop("the peer stopped");
}

// ---------------------------------------------------------------------------
// Completions.

bool Integrity::Poll() {
  ibv_wc wcs[32];
  const int n = ibv_poll_cq(cq_.get(), 32, wcs);
  if (n < 0) Abort(Sprintf("ibv_poll_cq returned %d", n));
  for (int i = 0; i < n; ++i) {
    const ibv_wc& wc = wcs[i];
    if (wc.status != IBV_WC_SUCCESS) {
      // The opcode of a failed completion is undefined; the wr_id says what
      // was posted. The RC QP is in the error state now: the run ends.
      ++completion_errors_;
      Complain("completion error: %s (status %d, vendor_err 0x%x) on %s, wr_id 0x%" PRIx64
               " seq %" PRIu64,
               ibv_wc_status_str(wc.status), wc.status, wc.vendor_err, KindName(WrKind(wc.wr_id)),
               wc.wr_id, WrSeq(wc.wr_id));
      Abort("a work request completed in error");
    } else if (WrKind(wc.wr_id) == kRcRecv) {
      OnRcRecv(wc);
    } else if (WrKind(wc.wr_id) == kUdRecv) {
      OnUdRecv(wc);
    } else {
      OnSendDone(wc);
    }
  }
  return n > 0;
}

void Integrity::OnSendDone(const ibv_wc& wc) {
  const Kind kind = WrKind(wc.wr_id);
  const uint64_t seq = WrSeq(wc.wr_id);
  const ibv_wc_opcode want = kind == kWrite || kind == kStatus || kind == kCanvas
                                 ? IBV_WC_RDMA_WRITE
                             : kind == kRead ? IBV_WC_RDMA_READ
                                             : IBV_WC_SEND;
  std::vector<Lane::Slot>* slots = kind < kNumKinds ? &lanes_[kind].slots : nullptr;
  if (slots == nullptr || slots->empty() || (*slots)[seq % slots->size()].seq_plus_1 != seq + 1 ||
      wc.opcode != want) {
    ++completion_errors_;
    Complain("unexpected completion: opcode %d, wr_id 0x%" PRIx64 " (%s seq %" PRIu64 ")",
             wc.opcode, wc.wr_id, KindName(kind), seq);
    return;
  }
  inflight_bytes_ -= (*slots)[seq % slots->size()].bytes;
  (*slots)[seq % slots->size()] = {};
  ++lanes_[kind].done;
  if (kind == kStatus && finished_ && seq == last_sent_.gen) final_done_ = true;
  if (kind == kRead) {
    const auto [off, len] = ReadSpan(seq);
    const uint8_t* dst = rx_->at(kRxReadOff + (seq % kReadDepth) * kMaxMsg);
    if (const size_t bad = FirstMismatch(dst, len, Key(remote_.seed, kRead, 0), off); bad < len) {
      ++reads_.corrupted;
      Complain("RDMA READ seq %" PRIu64 " of [%u, %u): byte %zu differs from the pattern", seq, off,
               off + len, off + bad);
    } else {
      ++reads_.ok;
    }
  }
}

void Integrity::OnRcRecv(const ibv_wc& wc) {
  const uint64_t slot = WrSeq(wc.wr_id);
  const uint8_t* p = rx_->at(kRxRcOff + slot * kMaxMsg);
  const bool with_imm = wc.wc_flags & IBV_WC_WITH_IMM;
  WroteMsg wrote{};
  std::memcpy(&wrote, p, sizeof(wrote));
  if (wc.opcode == IBV_WC_RECV && with_imm) {
    const uint64_t seq = ntohl(wc.imm_data);
    sends_in_.Arrive(seq, [&] {
      const std::string why = CheckFrame(p, wc.byte_len, VaryLen(kSend, seq, kMaxMsg), remote_.seed,
                                         kSend, seq, /*checksum=*/false);
      if (!why.empty()) Complain("SEND seq %" PRIu64 ": %s", seq, why.c_str());
      return why.empty();
    });
  } else if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && with_imm) {
    CheckRingSlot(ntohl(wc.imm_data));
  } else if (wc.opcode == IBV_WC_RECV && wc.byte_len == sizeof(wrote) &&
             wrote.magic == kWroteMagic) {
    CheckRingSlot(wrote.seq);
  } else {
    ++sends_in_.tally.corrupted;
    Complain("unexpected RC receive: opcode %d, %u bytes, flags 0x%x", wc.opcode, wc.byte_len,
             wc.wc_flags);
  }
  PostRecv(rc_.get(), kRcRecv, slot);
  ++rc_reposted_;
}

// The peer announced ring slot `seq`: check it, then poison it, so that a
// later announcement of this slot whose data never landed fails.
void Integrity::CheckRingSlot(uint64_t seq) {
  writes_in_.Arrive(seq, [&] {
    uint8_t* slot = ring_->at((seq % kRingSlots) * kMaxMsg);
    const uint32_t len = VaryLen(kWrite, seq, kMaxMsg);
    const std::string why = CheckFrame(slot, len, len, remote_.seed, kWrite, seq, true);
    std::memset(slot, 0xa5, kMaxMsg);
    if (!why.empty()) Complain("RDMA WRITE seq %" PRIu64 ": %s", seq, why.c_str());
    return why.empty();
  });
}

void Integrity::OnUdRecv(const ibv_wc& wc) {
  const uint64_t slot = WrSeq(wc.wr_id);
  NotePlace();
  const uint8_t* p = rx_->at(kRxUdOff + slot * kUdRecvSlot) + kGrhLen;
  FrameHeader h{};
  if (wc.byte_len < kGrhLen + sizeof(h)) {
    ++ud_in_.tally.corrupted;
    Complain("UD receive of %u bytes", wc.byte_len);
  } else {
    std::memcpy(&h, p, sizeof(h));
    if (h.seq < ud_place_.size()) {
      ud_place_[h.seq] = static_cast<uint32_t>(places_.size());
      ud_ordinal_[h.seq] = ud_arrivals_;
    }
    ++ud_arrivals_;
    ud_in_.Arrive(h.seq, [&] {
      std::string why = CheckFrame(p, wc.byte_len - kGrhLen, VaryLen(kUd, h.seq, kMaxUd),
                                   remote_.seed, kUd, h.seq, false);
      if (why.empty() && (!(wc.wc_flags & IBV_WC_WITH_IMM) || ntohl(wc.imm_data) != h.seq)) {
        why = "immediate data is not the seq";
      }
      if (why.empty() && wc.src_qp != remote_.ud_qpn)
        why = Sprintf("src_qp 0x%x is not the peer's UD QP 0x%x", wc.src_qp, remote_.ud_qpn);
      if (why.empty() && !(wc.wc_flags & IBV_WC_GRH)) why = "no GRH";
      if (!why.empty()) Complain("UD seq %" PRIu64 ": %s", h.seq, why.c_str());
      return why.empty();
    });
  }
  PostRecv(ud_.get(), kUdRecv, slot);
  ++ud_reposted_;
}

// A datagram is lost once it has been known to be sent (a later one arrived,
// or the peer's record counts it) for ud_lost_after_s of running time.
void Integrity::DeclareUdLosses() {
  const uint64_t known = std::min(ud_in_.total(), std::max(ud_in_.end(), peer_.ud_sent));
  if (ud_known_.empty() || known > ud_known_.back().first) ud_known_.emplace_back(known, now_);
  for (uint64_t m = ud_in_.first_missing(); m < ud_known_.back().first;
       m = ud_in_.first_missing()) {
    while (ud_known_.front().first <= m) ud_known_.pop_front();
    if (now_ - ud_known_.front().second < opt_.ud_lost_after_s) break;
    Complain("UD seq %" PRIu64 ": not received %.0f s after it was sent", m, opt_.ud_lost_after_s);
    ud_in_.DeclareLost(m);
  }
}

// ---------------------------------------------------------------------------
// Posting. Each kind posts while the pace allows it, a slot is free, few
// bytes are in flight and the peer has room: RC receives (credits), ring
// slots, UD receives.

ibv_send_wr MakeWr(Kind kind, uint64_t seq, ibv_wr_opcode opcode, ibv_sge* sge) {
  ibv_send_wr wr{};
  wr.wr_id = WrId(kind, seq);
  wr.sg_list = sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  return wr;
}

bool Integrity::PostSends() {
  bool posted = false;
  for (;;) {
    const uint64_t seq = lanes_[kSend].next;
    const uint32_t len = VaryLen(kSend, seq, kMaxMsg);
    if (!RcCredit() || !CanPost(kSend, len)) break;
    const size_t off = kTxSendOff + (seq % kSendSlots) * kMaxMsg;
    WriteFrame(tx_->at(off), len, seed_, kSend, seq, false);
    if (static_cast<int64_t>(seq) == opt_.inject_corruption) {
      tx_->at(off)[len - 1] ^= 1;
      read_->at(kReadRegion / 2)[0] ^= 1;  // the peer's later READs cover it
    }
    ibv_sge sge = tx_->Sge(off, len);
    ibv_send_wr wr = MakeWr(kSend, seq, IBV_WR_SEND_WITH_IMM, &sge);
    wr.imm_data = htonl(static_cast<uint32_t>(seq));
    if (!Post(rc_.get(), &wr, len)) break;
    ++rc_msgs_;
    posted = true;
  }
  return posted;
}

bool Integrity::PostWrites() {
  bool posted = false;
  for (;;) {
    const uint64_t seq = lanes_[kWrite].next;
    const size_t slot = seq % kRingSlots;
    const uint32_t len = VaryLen(kWrite, seq, kMaxMsg);
    // The ring slot must be checked by the peer, the announcing SEND's
    // source free.
    if (!RcCredit() || seq >= peer_.writes_handled + kRingSlots ||
        lanes_[kWrote].slots[slot].seq_plus_1 != 0 || !CanPost(kWrite, len)) {
      break;
    }
    const size_t off = kTxWriteOff + slot * kMaxMsg;
    WriteFrame(tx_->at(off), len, seed_, kWrite, seq, true);
    if (static_cast<int64_t>(seq) == opt_.inject_corruption) tx_->at(off)[sizeof(FrameHeader)] ^= 1;
    ibv_sge sge = tx_->Sge(off, len);
    ibv_send_wr wr = MakeWr(kWrite, seq, IBV_WR_RDMA_WRITE_WITH_IMM, &sge);
    wr.imm_data = htonl(static_cast<uint32_t>(seq));
    wr.wr.rdma = {remote_.ring_addr + slot * kMaxMsg, remote_.ring_rkey};
    // Odd seqs are plain WRITEs, announced by the SEND that follows on the
    // same QP: the responder executes it only after the WRITE.
    const size_t wrote_off = kTxWroteOff + slot * sizeof(WroteMsg);
    ibv_sge wrote_sge = tx_->Sge(wrote_off, sizeof(WroteMsg));
    ibv_send_wr wrote = MakeWr(kWrote, seq, IBV_WR_SEND, &wrote_sge);
    if (seq % 2 == 1) {
      const WroteMsg msg{kWroteMagic, seq};
      std::memcpy(tx_->at(wrote_off), &msg, sizeof(msg));
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.next = &wrote;
    }
    if (!Post(rc_.get(), &wr, len)) break;
    ++rc_msgs_;
    posted = true;
  }
  return posted;
}

bool Integrity::PostReads() {
  bool posted = false;
  for (;;) {
    const uint64_t seq = lanes_[kRead].next;
    const auto [off, len] = ReadSpan(seq);
    if (!CanPost(kRead, len)) break;
    const size_t dst = kRxReadOff + (seq % kReadDepth) * kMaxMsg;
    // Poisoned with the complement of what must arrive: the READ has to
    // write every byte for the check to pass.
    uint8_t* p = rx_->at(dst);
    FillPattern(p, len, Key(remote_.seed, kRead, 0), off);
    for (uint32_t i = 0; i < len; ++i) p[i] = static_cast<uint8_t>(~p[i]);
    ibv_sge sge = rx_->Sge(dst, len);
    ibv_send_wr wr = MakeWr(kRead, seq, IBV_WR_RDMA_READ, &sge);
    wr.wr.rdma = {remote_.read_addr + off, remote_.read_rkey};
    if (!Post(rc_.get(), &wr, len)) break;
    posted = true;
  }
  return posted;
}

bool Integrity::PostUd() {
  bool posted = false;
  NotePlace();  // which datagrams were sent from where
  // Only into receives the peer has posted: its initial window, every receive
  // it reposted, and those still posted for datagrams it gave up on.
  for (;;) {
    const uint64_t seq = lanes_[kUd].next;
    const uint32_t len = VaryLen(kUd, seq, kMaxUd);
    if (seq >= kUdRecvDepth + peer_.ud_reposted + peer_.ud_lost || !CanPost(kUd, len)) break;
    const size_t off = kTxUdOff + (seq % kUdRecvDepth) * kMaxUd;
    WriteFrame(tx_->at(off), len, seed_, kUd, seq, false);
    if (static_cast<int64_t>(seq) == opt_.inject_corruption) tx_->at(off)[len - 1] ^= 1;
    ibv_sge sge = tx_->Sge(off, len);
    ibv_send_wr wr = MakeWr(kUd, seq, IBV_WR_SEND_WITH_IMM, &sge);
    wr.imm_data = htonl(static_cast<uint32_t>(seq));
    wr.wr.ud = {ah_.get(), remote_.ud_qpn, kQkey};
    if (!Post(ud_.get(), &wr, len)) break;
    posted = true;
  }
  return posted;
}

// One cell of the peer's canvas per iteration, wherever CanvasSpotOf says.
bool Integrity::PostCanvas() {
  bool posted = false;
  if (remote_.canvas_bytes == 0) return false;
  for (;;) {
    const uint64_t seq = lanes_[kCanvas].next;
    if (!CanPost(kCanvas, kCanvasCell)) break;
    const size_t off = kTxCanvasOff + (seq % kCanvasSlots) * kCanvasCell;
    FillPattern(tx_->at(off), kCanvasCell, Key(seed_, kCanvas, seq), 0);
    if (static_cast<int64_t>(seq) == opt_.inject_corruption) tx_->at(off)[kCanvasCell / 2] ^= 1;
    const CanvasSpot spot = CanvasSpotOf(seq, remote_.canvas_bytes);
    ibv_sge sge = tx_->Sge(off, kCanvasCell);
    ibv_send_wr wr = MakeWr(kCanvas, seq, IBV_WR_RDMA_WRITE, &sge);
    wr.wr.rdma = {remote_.canvas_addr[spot.region] + spot.offset, remote_.canvas_rkey[spot.region]};
    if (!Post(rc_.get(), &wr, kCanvasCell)) break;
    posted = true;
  }
  return posted;
}

Tally Integrity::VerifyCanvas() {
  Tally t;
  if (opt_.canvas_mib == 0) return t;
  const size_t bytes = opt_.canvas_mib << 20;
  const size_t pages = bytes / kPage;
  const uint64_t cells = pages * kCanvasCellsPerPage;
  const uint64_t written = peer_.canvas_written;
  for (int r = 0; r < 2; ++r) {
    const uint64_t writes = (written + 1 - r) / 2;  // of the peer's, those into region r
    for (uint64_t k = 0; k < cells; ++k) {
      const size_t off = (k % pages) * kPage + (k / pages) * kCanvasCell;
      const uint8_t* cell = canvas_[r]->at(off);
      // The last of the region's writes that landed on cell k, if any.
      uint64_t key, seq = 0;
      size_t start = 0;
      if (k < writes) {
        seq = 2 * (k + (writes - 1 - k) / cells * cells) + r;
        key = Key(remote_.seed, kCanvas, seq);
      } else {
        key = Key(seed_, kCanvas, kSeqMask - r);
        start = off;
      }
      if (const size_t bad = FirstMismatch(cell, kCanvasCell, key, start); bad < kCanvasCell) {
        ++t.corrupted;
        Complain("canvas region %d (%s pages), page %zu, byte %zu: differs from %s", r,
                 r == 0 ? "4 KiB" : "huge", off / kPage, off % kPage + bad,
                 k < writes ? Sprintf("the peer's write %" PRIu64, seq).c_str()
                            : "its initial pattern (never written)");
      } else {
        ++t.ok;
      }
    }
  }
  return t;
}

// ---------------------------------------------------------------------------
// Coordination.

// Writes our record into the peer's mailbox when it changed. Once both
// directions are complete, the final record (kFinished) is the last WR this
// side posts: the peer may tear down as soon as it has seen it.
bool Integrity::PostStatus() {
  const bool done = TxDone() && RxDone();
  Status s{.gen = last_sent_.gen,
           .state = done ? kFinished : kRunning,
           .rc_reposted = rc_reposted_,
           .ud_reposted = ud_reposted_,
           .ud_lost = ud_in_.tally.lost,
           .sends_handled = sends_in_.handled(),
           .writes_handled = writes_in_.handled(),
           .ud_handled = ud_in_.handled(),
           .ud_sent = lanes_[kUd].done,
           .errors = Errors(),
           .canvas_written = lanes_[kCanvas].done,
           .last = iterations_,
           .checksum = last_sent_.checksum};
  const Lane::Slot& slot = lanes_[kStatus].slots[(s.gen + 1) % kStatusSlots];
  if (std::memcmp(&s, &last_sent_, sizeof(s)) == 0 || slot.seq_plus_1 != 0 ||
      (!done && now_ - last_status_at_ < kStatusIntervalS)) {
    return false;
  }
  ++s.gen;
  s.checksum = StatusChecksum(s);
  const size_t off = kTxStatusOff + (s.gen % kStatusSlots) * sizeof(Status);
  std::memcpy(tx_->at(off), &s, sizeof(s));
  ibv_sge sge = tx_->Sge(off, sizeof(s));
  ibv_send_wr wr = MakeWr(kStatus, s.gen, IBV_WR_RDMA_WRITE, &sge);
  wr.wr.rdma = {remote_.mailbox_addr, remote_.mailbox_rkey};
  if (!Post(rc_.get(), &wr, 0)) return false;
  last_sent_ = s;
  last_status_at_ = now_;
  finished_ = done;
  return true;
}

// Takes the peer's newest record if a newer one is complete in the mailbox. A
// record read while the peer's WRITE lands fails its checksum; the next turn
// reads it again.
bool Integrity::ReadMailbox() {
  Status s;
  const auto* src = reinterpret_cast<const volatile uint64_t*>(mailbox_->at(0));
  auto* dst = reinterpret_cast<uint64_t*>(&s);
  for (size_t i = 0; i < sizeof(Status) / 8; ++i) dst[i] = src[i];
  if (s.checksum != StatusChecksum(s) || s.gen <= peer_.gen) return false;
  peer_ = s;
  if (s.last < peer_iterations_) PeerStops(s.last);
  return true;
}

void Integrity::NotePlace() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
  const int pid = static_cast<int>(getpid());
  if (!places_.empty() && places_.back().host == host && places_.back().pid == pid) return;
  places_.push_back({host, pid, WallSeconds(), lanes_[kUd].next, ud_arrivals_});
  std::printf("integrity: running on %s as pid %d\n", host, pid);
}

void Integrity::PrintLive(bool force) {
  if (!force && now_ - last_live_ < 1.0) return;
  last_live_ = now_;
  NotePlace();
  std::printf("integrity: t=%.0fs sent=%" PRIu64 " recv=%" PRIu64 " writes=%" PRIu64 "/%" PRIu64
              " reads=%" PRIu64 " ud=%" PRIu64 "/%" PRIu64 " canvas=%" PRIu64 "/%" PRIu64
              " errors=%" PRIu64 "\n",
              now_, lanes_[kSend].done, sends_in_.tally.ok, lanes_[kWrite].done,
              writes_in_.tally.ok, reads_.ok, lanes_[kUd].done, ud_in_.tally.ok,
              lanes_[kCanvas].done, peer_.canvas_written, Errors());
  std::fflush(stdout);
}

void Integrity::Run() {
  start_wall_ = WallSeconds();
  NotePlace();
  now_ = last_progress_ = clock_.Now();
  while (fatal_.empty()) {
    now_ = clock_.Now();
    bool active = Poll();
    active |= ReadMailbox();
    if (active) last_progress_ = now_;
    if (final_done_ && peer_.state == kFinished) break;
    if (now_ - last_progress_ > kStallAfterS)
      Abort(Sprintf("no progress for %.0f s", kStallAfterS));
    DeclareUdLosses();
    if (!opt_.until_file.empty() && !stopped_ && now_ - until_checked_ >= 1.0) {
      until_checked_ = now_;
      if (access(opt_.until_file.c_str(), F_OK) == 0) Stop(opt_.until_file.c_str());
    }
    if (!finished_ && fatal_.empty()) {
      // Every kind gets its turn (no short-circuit).
      active |= PostSends() | PostWrites() | PostReads() | PostUd() | PostCanvas();
      active |= PostStatus();
    }
    PrintLive(false);
    // A sleep when idle leaves the (virtual) CPU to the kernel's rxe work,
    // which is what moves the packets. A millisecond: at the default pace
    // (50 iterations/s) nothing waits for it, and an emulated guest spends
    // far less time waking up.
    if (!active) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  end_wall_ = WallSeconds();
  NotePlace();
  PrintLive(true);
}

std::string JsonTally(const Tally& t) {
  return Sprintf("{\"ok\": %" PRIu64 ", \"lost\": %" PRIu64 ", \"duplicated\": %" PRIu64
                 ", \"corrupted\": %" PRIu64 ", \"out_of_order\": %" PRIu64 "}",
                 t.ok, t.lost, t.duplicated, t.corrupted, t.out_of_order);
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  }
  return out + "\"";
}

std::string Integrity::JsonPlaces() const {
  std::string out = "[";
  for (const Place& p : places_) {
    out += Sprintf("%s{\"host\": %s, \"pid\": %d, \"since_s\": %.3f, \"ud_sent_from\": %" PRIu64
                   ", \"ud_arrivals_before\": %" PRIu64 "}",
                   out.size() > 1 ? ", " : "", JsonString(p.host).c_str(), p.pid,
                   p.since - start_wall_, p.ud_sent_from, p.ud_arrivals_before);
  }
  return out + "]";
}

// The peer's datagrams that never arrived (the first 1000), each with the
// nearest ones that did on either side and whether this side ran at one
// place from the one's arrival to the other's. Together with the peer's
// places (where it sent each seq from) that tells a datagram the fabric
// dropped while both sides stayed put from one a move may have lost.
std::string Integrity::JsonUdMissing() const {
  std::string out = "[";
  uint64_t prev = ud_place_.size();  // none yet
  size_t listed = 0;
  for (uint64_t seq = 0; seq < ud_place_.size() && listed < 1000; ++seq) {
    if (ud_place_[seq] != 0) {
      prev = seq;
      continue;
    }
    uint64_t next = seq + 1;
    while (next < ud_place_.size() && ud_place_[next] == 0) ++next;
    const bool has_prev = prev < ud_place_.size(), has_next = next < ud_place_.size();
    // Completions a move held came out first at the new place: a prev
    // among the first kUdRecvDepth taken there may have arrived before it.
    const bool stayed =
        has_prev && has_next && ud_place_[prev] == ud_place_[next] &&
        (ud_place_[prev] == 1 ||
         ud_ordinal_[prev] >= places_[ud_place_[prev] - 1].ud_arrivals_before + kUdRecvDepth);
    out += Sprintf("%s{\"seq\": %" PRIu64 ", \"prev\": %s, \"next\": %s, \"receiver_stayed\": %s}",
                   listed > 0 ? ", " : "", seq, has_prev ? std::to_string(prev).c_str() : "null",
                   has_next ? std::to_string(next).c_str() : "null", stayed ? "true" : "false");
    ++listed;
  }
  return out + "]";
}

int Integrity::Report() {
  // Whatever never arrived is lost: named (the first few), so that the
  // sender's log places them in time.
  for (Stream* s : {&sends_in_, &writes_in_, &ud_in_}) {
    for (const uint64_t seq : s->Missing(16))
      Complain("%s seq %" PRIu64 ": never arrived", s->name(), seq);
    s->tally.lost += s->total() - s->handled();
  }
  Tally ballast;
  constexpr uint64_t kPageWords = 4096 / sizeof(uint64_t);
  for (uint64_t page = 0; page < ballast_.size(); page += kPageWords) {
    bool intact = true;
    for (uint64_t i = page; i < page + kPageWords; ++i) intact &= ballast_[i] == BallastWord(i);
    ++(intact ? ballast.ok : ballast.corrupted);
  }
  Tally canvas = VerifyCanvas();
  Tally sum;
  for (const Tally* t :
       {&sends_in_.tally, &writes_in_.tally, &reads_, &ud_in_.tally, &ballast, &canvas}) {
    sum.lost += t->lost;
    sum.duplicated += t->duplicated;
    sum.corrupted += t->corrupted;
    sum.out_of_order += t->out_of_order;
  }
  const bool peer_finished = peer_.state == kFinished;
  const bool ok = Errors() == 0 && ballast.corrupted == 0 && canvas.corrupted == 0 &&
                  peer_finished && peer_.errors == 0;
  const auto n = [](uint64_t v) { return std::to_string(v); };
  const std::pair<const char*, std::string> fields[] = {
      {"role", JsonString(opt_.server ? "server" : "client")},
      {"iterations", n(iterations_)},
      {"peer_iterations", n(peer_iterations_)},
      {"stopped_early", stopped_ ? "true" : "false"},
      {"rate", Sprintf("%g", opt_.rate)},
      {"sends", n(lanes_[kSend].done)},
      {"recvs", n(sends_in_.tally.ok)},
      {"writes", n(lanes_[kWrite].done)},
      {"writes_verified", n(writes_in_.tally.ok)},
      {"reads", n(lanes_[kRead].done)},
      {"reads_verified", n(reads_.ok)},
      {"ud_sent", n(lanes_[kUd].done)},
      {"ud_received", n(ud_in_.tally.ok)},
      {"ud_reordered", n(ud_in_.reordered)},  // allowed: not an error
      {"ballast_pages_verified", n(ballast.ok)},
      {"canvas_mib", n(opt_.canvas_mib)},
      {"canvas_writes", n(lanes_[kCanvas].done)},
      {"canvas_peer_writes", n(peer_.canvas_written)},
      {"canvas_bytes_verified", n(canvas.ok * kCanvasCell)},
      {"canvas_huge_kib", Sprintf("%ld", canvas_huge_kib_)},
      {"lost", n(sum.lost)},
      {"duplicated", n(sum.duplicated)},
      {"corrupted", n(sum.corrupted)},
      {"out_of_order", n(sum.out_of_order)},
      {"completion_errors", n(completion_errors_)},
      {"kinds",
       "{\"send\": " + JsonTally(sends_in_.tally) + ", \"write\": " + JsonTally(writes_in_.tally) +
           ", \"read\": " + JsonTally(reads_) + ", \"ud\": " + JsonTally(ud_in_.tally) +
           ", \"ballast\": " + JsonTally(ballast) + ", \"canvas\": " + JsonTally(canvas) + "}"},
      {"fatal", fatal_.empty() ? "null" : JsonString(fatal_)},
      {"peer_finished", peer_finished ? "true" : "false"},
      {"peer_errors", n(peer_.errors)},
      {"elapsed_s", Sprintf("%.3f", end_wall_ - start_wall_)},
      {"places", JsonPlaces()},
      {"ud_missing", JsonUdMissing()},
      {"ok", ok ? "true" : "false"},
  };
  std::string json = "{";
  for (const auto& [name, value] : fields) {
    json += Sprintf("%s\n  \"%s\": %s", json.size() > 1 ? "," : "", name, value.c_str());
  }
  json += "\n}\n";
  std::fputs(json.c_str(), stdout);
  std::fflush(stdout);
  if (!opt_.report.empty()) {
    FILE* f = std::fopen(opt_.report.c_str(), "w");
    if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "integrity: cannot write %s: %s\n", opt_.report.c_str(),
                   std::strerror(errno));
      return 1;
    }
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  program_name = "integrity";
  const Options opt = ParseArgs(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("integrity: role=%s pid=%d iterations=%" PRIu64 " rate=%g\n",
              opt.server ? "server" : "client", static_cast<int>(getpid()), opt.iterations,
              opt.rate);
  Integrity run(opt);
  run.Open();
  run.Connect();
  std::printf("integrity: connected; from here on no socket is open\n");
  run.Run();
  return run.Report();
}
