// An MPI job that checks every byte it receives: a ring of sends,
// large point-to-point messages (eager and rendezvous sizes), Allreduce,
// Alltoall and, unless told not to, one-sided Put and Get. Every payload is
// a pattern of (sender, receiver, round, offset), so a lost, duplicated,
// reordered or corrupted message shows as a wrong byte. Rank 0 prints one
// JSON verdict:
//   {"verdict": "ok"|"corrupt", "ranks": N, "rounds": R, "bytes_verified": B,
//    "errors": E, "first_error": "...", "rma": true|false,
//    "hosts": ["host1", ...], "pids": [...], "shimmed_ranks": K, "seconds": S,
//    "longest_round_seconds": [L0, L1, ...]}
// hosts: where each rank ran at the end (a moved rank names its new host);
// shimmed_ranks: how many ranks have rdmavirt's shim mapped (LD_PRELOAD);
// longest_round_seconds: each rank's longest wait between the ends of two
// rounds (or from the start to the first), which holds any stop it saw;
// by the wall clock, since a moved rank's monotonic clock is its new
// host's (the lab's hosts keep their wall clocks in step).
// Exit status 0 when every byte matched, 1 otherwise, 2 for bad arguments.
//
//   mpi_verify [--rounds N] [--seconds S] [--until-file PATH] [--max-bytes B]
//              [--no-rma] [--progress DIR] [--corrupt-one-byte]
// --seconds runs rounds until that much time passed (at least --rounds);
// --until-file runs rounds (at least --rounds) until rank 0 finds PATH,
// within --seconds if also given;
// --progress DIR: each rank rewrites DIR/rank-R with "ROUND HOST PID" after
// every round (HOST: where it runs at that moment), so a test can see where
// each rank runs and that it advances.
// --corrupt-one-byte: rank 0 flips one received byte in the first round,
// to show that the check finds it (the verdict must be "corrupt").
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Options {
  int rounds = 5;
  double seconds = 0;
  size_t max_bytes = 1 << 20;
  bool rma = true;
  std::string progress;
  std::string until_file;
  bool corrupt_one_byte = false;
};

int rank = 0;
int size = 1;

// What every check adds to.
struct Tally {
  uint64_t bytes = 0;
  uint64_t errors = 0;
  std::string first;
};
Tally tally;

uint8_t Pattern(int from, int to, int round, size_t off) {
  const uint64_t x = (static_cast<uint64_t>(from) * 0x9e3779b1u) ^
                     (static_cast<uint64_t>(to) * 0x85ebca77u) ^
                     (static_cast<uint64_t>(round) * 0xc2b2ae3du) ^ (off * 0x27d4eb2fu);
  return static_cast<uint8_t>(x ^ (x >> 13) ^ (x >> 29));
}

// Tags stay under MPI_TAG_UB (at least 32767) however long the job runs.
int Tag(int round) { return round % 16000 * 2; }

void Fill(uint8_t* p, size_t n, int from, int to, int round) {
  for (size_t i = 0; i < n; ++i) p[i] = Pattern(from, to, round, i);
}

void Verify(const uint8_t* p, size_t n, int from, int to, int round, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    const uint8_t want = Pattern(from, to, round, i);
    if (p[i] == want) continue;
    if (tally.errors == 0) {
      char msg[200];
      std::snprintf(msg, sizeof msg, "%s round %d from %d to %d: byte %zu is 0x%02x, not 0x%02x",
                    what, round, from, to, i, p[i], want);
      tally.first = msg;
    }
    ++tally.errors;
  }
  tally.bytes += n;
}

void Check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  std::fprintf(stderr, "mpi_verify: rank %d: %s: %s\n", rank, call, text);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

// Each rank sends to the next and receives from the previous, at every
// size from 1 byte to max_bytes (powers of 4): eager and rendezvous.
void Ring(const Options& o, int round, std::vector<uint8_t>& out, std::vector<uint8_t>& in) {
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;
  for (size_t n = 1; n <= o.max_bytes; n *= 4) {
    Fill(out.data(), n, rank, next, round);
    std::memset(in.data(), 0, n);
    Check(MPI_Sendrecv(out.data(), static_cast<int>(n), MPI_BYTE, next, Tag(round), in.data(),
                       static_cast<int>(n), MPI_BYTE, prev, Tag(round), MPI_COMM_WORLD,
                       MPI_STATUS_IGNORE),
          "MPI_Sendrecv");
    if (o.corrupt_one_byte && rank == 0 && round == 0 && n == o.max_bytes) in[n / 2] ^= 0x40;
    Verify(in.data(), n, prev, rank, round, "ring");
  }
}

// Several messages in flight between every pair at once: MPI keeps their
// order per (source, tag), so each must land in its own posted buffer.
void Burst(int round, std::vector<uint8_t>& out, std::vector<uint8_t>& in) {
  constexpr int kMessages = 8;
  constexpr size_t kBytes = 4096;
  std::vector<MPI_Request> reqs;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    for (int m = 0; m < kMessages; ++m) {
      uint8_t* r = in.data() + (static_cast<size_t>(peer) * kMessages + m) * kBytes;
      reqs.emplace_back();
      Check(MPI_Irecv(r, kBytes, MPI_BYTE, peer, Tag(round) + 1, MPI_COMM_WORLD, &reqs.back()),
            "MPI_Irecv");
    }
  }
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    for (int m = 0; m < kMessages; ++m) {
      uint8_t* s = out.data() + (static_cast<size_t>(peer) * kMessages + m) * kBytes;
      Fill(s, kBytes, rank, peer, round * kMessages + m);
      reqs.emplace_back();
      Check(MPI_Isend(s, kBytes, MPI_BYTE, peer, Tag(round) + 1, MPI_COMM_WORLD, &reqs.back()),
            "MPI_Isend");
    }
  }
  Check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE),
        "MPI_Waitall");
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    for (int m = 0; m < kMessages; ++m) {
      const uint8_t* r = in.data() + (static_cast<size_t>(peer) * kMessages + m) * kBytes;
      Verify(r, kBytes, peer, rank, round * kMessages + m, "burst");
    }
  }
}

void Allreduce(int round) {
  constexpr int kCount = 4096;
  std::vector<int64_t> mine(kCount), sum(kCount);
  for (int i = 0; i < kCount; ++i) mine[i] = (int64_t{rank} + 1) * (i + 1) + round;
  Check(MPI_Allreduce(mine.data(), sum.data(), kCount, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD),
        "MPI_Allreduce");
  const int64_t ranks_sum = int64_t{size} * (size + 1) / 2;
  for (int i = 0; i < kCount; ++i) {
    const int64_t want = ranks_sum * (i + 1) + int64_t{size} * round;
    if (sum[i] != want && tally.errors++ == 0) {
      tally.first = "allreduce round " + std::to_string(round) + " element " + std::to_string(i) +
                    " is " + std::to_string(sum[i]) + ", not " + std::to_string(want);
    }
  }
  tally.bytes += kCount * sizeof(int64_t);
}

void Alltoall(int round, std::vector<uint8_t>& out, std::vector<uint8_t>& in) {
  constexpr size_t kBlock = 16384;
  for (int peer = 0; peer < size; ++peer) Fill(&out[peer * kBlock], kBlock, rank, peer, round);
  std::memset(in.data(), 0, kBlock * size);
  Check(MPI_Alltoall(out.data(), kBlock, MPI_BYTE, in.data(), kBlock, MPI_BYTE, MPI_COMM_WORLD),
        "MPI_Alltoall");
  for (int peer = 0; peer < size; ++peer)
    Verify(&in[peer * kBlock], kBlock, peer, rank, round, "alltoall");
}

// Put into the next rank's window, Get from the previous one's.
void OneSided(int round, MPI_Win win, uint8_t* base, size_t bytes, std::vector<uint8_t>& tmp) {
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;
  // The window's first half receives Puts; its second half is read by Gets.
  uint8_t* put_area = base;
  uint8_t* get_area = base + bytes;
  Check(MPI_Win_fence(0, win), "MPI_Win_fence");
  std::memset(put_area, 0, bytes);
  Fill(get_area, bytes, rank, -1, round);
  Fill(tmp.data(), bytes, rank, next, round + 7);
  Check(MPI_Win_fence(0, win), "MPI_Win_fence");
  Check(MPI_Put(tmp.data(), static_cast<int>(bytes), MPI_BYTE, next, 0, static_cast<int>(bytes),
                MPI_BYTE, win),
        "MPI_Put");
  Check(MPI_Win_fence(0, win), "MPI_Win_fence");
  Verify(put_area, bytes, prev, rank, round + 7, "put");
  std::vector<uint8_t> got(bytes);
  Check(MPI_Get(got.data(), static_cast<int>(bytes), MPI_BYTE, prev, bytes, static_cast<int>(bytes),
                MPI_BYTE, win),
        "MPI_Get");
  Check(MPI_Win_fence(0, win), "MPI_Win_fence");
  Verify(got.data(), bytes, prev, -1, round, "get");
}

double WallSeconds() {
  timespec t{};
  clock_gettime(CLOCK_REALTIME, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Whether rdmavirt's shim is mapped into this process.
bool Shimmed() {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return false;
  char line[512];
  bool found = false;
  while (!found && std::fgets(line, sizeof line, f) != nullptr)
    found = std::strstr(line, "librdmavirt") != nullptr;
  std::fclose(f);
  return found;
}

void WriteProgress(const Options& o, int round) {
  if (o.progress.empty()) return;
  // Where the rank runs now, not where it started: a moved rank names its
  // new host from its first round there.
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "unknown");
  const std::string path = o.progress + "/rank-" + std::to_string(rank);
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return;
  std::fprintf(f, "%d %s %d\n", round, host, static_cast<int>(getpid()));
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());
}

int ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--rounds" && has_value) {
      o->rounds = std::atoi(argv[++i]);
    } else if (a == "--seconds" && has_value) {
      o->seconds = std::atof(argv[++i]);
    } else if (a == "--max-bytes" && has_value) {
      o->max_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--no-rma") {
      o->rma = false;
    } else if (a == "--corrupt-one-byte") {
      o->corrupt_one_byte = true;
    } else if (a == "--progress" && has_value) {
      o->progress = argv[++i];
    } else if (a == "--until-file" && has_value) {
      o->until_file = argv[++i];
    } else {
      return -1;
    }
  }
  if (o->rounds < 1 || o->max_bytes < 1 || o->max_bytes > (64u << 20) || o->seconds < 0) return -1;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (ParseArgs(argc, argv, &o) != 0) {
    std::fprintf(stderr,
                 "usage: mpi_verify [--rounds N>=1] [--seconds S] [--until-file PATH] "
                 "[--max-bytes 1..64Mi] [--no-rma] [--progress DIR] [--corrupt-one-byte]\n");
    return 2;
  }
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_len = 0;
  MPI_Get_processor_name(host, &host_len);

  const size_t burst = static_cast<size_t>(size) * 8 * 4096;
  const size_t a2a = static_cast<size_t>(size) * 16384;
  constexpr size_t kRmaBytes = 65536;
  std::vector<uint8_t> out(std::max({o.max_bytes, burst, a2a, kRmaBytes}));
  std::vector<uint8_t> in(out.size());
  uint8_t* win_base = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  if (o.rma) {
    Check(MPI_Alloc_mem(2 * kRmaBytes, MPI_INFO_NULL, &win_base), "MPI_Alloc_mem");
    Check(MPI_Win_create(win_base, 2 * kRmaBytes, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win),
          "MPI_Win_create");
  }

  const double start = MPI_Wtime();
  double round_end = WallSeconds();
  double longest_round = 0;
  int round = 0;
  for (;; ++round) {
    // Every rank takes the same decision: rank 0's clock (or file) decides.
    const double elapsed = MPI_Wtime() - start;
    int go =
        round < o.rounds || (o.until_file.empty() ? elapsed < o.seconds
                                                  : (o.seconds == 0 || elapsed < o.seconds) &&
                                                        access(o.until_file.c_str(), F_OK) != 0);
    Check(MPI_Bcast(&go, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
    if (!go) break;
    Ring(o, round, out, in);
    Burst(round, out, in);
    Allreduce(round);
    Alltoall(round, out, in);
    if (o.rma) OneSided(round, win, win_base, kRmaBytes, in);
    WriteProgress(o, round + 1);
    const double now = WallSeconds();
    longest_round = std::max(longest_round, now - round_end);
    round_end = now;
  }
  const double seconds = MPI_Wtime() - start;
  if (o.rma) {
    MPI_Win_free(&win);
    MPI_Free_mem(win_base);
  }

  uint64_t mine[3] = {tally.bytes, tally.errors, Shimmed() ? 1u : 0u};
  uint64_t all[3] = {0, 0, 0};
  MPI_Reduce(mine, all, 3, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  // The first error of the lowest rank that saw one, and every rank's host.
  int has_error = tally.errors > 0 ? rank : size;
  int first_rank = size;
  MPI_Allreduce(&has_error, &first_rank, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  char first[256] = {};
  if (first_rank == rank) std::snprintf(first, sizeof first, "%s", tally.first.c_str());
  if (first_rank < size && first_rank != 0) {
    if (rank == first_rank) MPI_Send(first, sizeof first, MPI_CHAR, 0, 9, MPI_COMM_WORLD);
    if (rank == 0)
      MPI_Recv(first, sizeof first, MPI_CHAR, first_rank, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  // Where this rank runs now: a moved rank is elsewhere than it started.
  if (gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "unknown");
  std::vector<char> hosts(static_cast<size_t>(size) * MPI_MAX_PROCESSOR_NAME);
  MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
             0, MPI_COMM_WORLD);
  const int pid = static_cast<int>(getpid());
  std::vector<int> pids(static_cast<size_t>(size));
  MPI_Gather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<double> longest(static_cast<size_t>(size));
  MPI_Gather(&longest_round, 1, MPI_DOUBLE, longest.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  const bool ok = all[1] == 0;
  if (rank == 0) {
    std::string list;
    std::string pid_list;
    std::string longest_list;
    for (int r = 0; r < size; ++r) {
      if (r > 0) list += ", ", pid_list += ", ", longest_list += ", ";
      list += "\"" + std::string(&hosts[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME]) + "\"";
      pid_list += std::to_string(pids[r]);
      char l[32];
      std::snprintf(l, sizeof l, "%.3f", longest[r]);
      longest_list += l;
    }
    std::printf("{\"verdict\": \"%s\", \"ranks\": %d, \"rounds\": %d, \"bytes_verified\": %" PRIu64
                ", \"errors\": %" PRIu64
                ", \"first_error\": \"%s\", \"rma\": %s, \"hosts\": [%s], "
                "\"pids\": [%s], \"shimmed_ranks\": %" PRIu64
                ", \"seconds\": %.3f, \"longest_round_seconds\": [%s]}\n",
                ok ? "ok" : "corrupt", size, round, all[0], all[1], first, o.rma ? "true" : "false",
                list.c_str(), pid_list.c_str(), all[2], seconds, longest_list.c_str());
    std::fflush(stdout);
  }
  int verdict = ok ? 0 : 1;
  MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return verdict;
}
