#include "tests/fuzz/fuzz_util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

namespace rdmavirt::fuzz {
namespace {

int g_report_fd = STDERR_FILENO;
bool g_trace = false;

}  // namespace

std::vector<std::string_view> SplitMessages(const uint8_t* data, size_t size, size_t max) {
  std::vector<std::string_view> out;
  const char* p = reinterpret_cast<const char*>(data);
  while (size > 0 && out.size() < max) {
    uint32_t n = 0;
    const size_t header = std::min<size_t>(size, 4);
    for (size_t i = 0; i < header; ++i) n |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
    p += header;
    size -= header;
    const size_t take = std::min<size_t>(n, size);
    out.emplace_back(p, take);
    p += take;
    size -= take;
  }
  return out;
}

std::string JoinMessages(const std::vector<std::string>& messages) {
  std::string out;
  for (const std::string& m : messages) {
    const uint32_t n = static_cast<uint32_t>(m.size());
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(n >> (8 * i)));
    out += m;
  }
  return out;
}

void InitTarget() {
  const int fd = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 100);
  if (fd >= 0) g_report_fd = fd;
  g_trace = getenv("RDMAVIRT_FUZZ_TRACE") != nullptr;
  if (!g_trace) setenv("RDMAVIRT_LOG", "quiet", 1);
}

bool Tracing() { return g_trace; }

void Trace(std::string_view what) {
  if (!g_trace) return;
  std::string line(what);
  line.push_back('\n');
  (void)!write(g_report_fd, line.data(), line.size());
}

void Fail(std::string_view what) {
  std::string line = "rdmavirt fuzz: property failed: ";
  line.append(what);
  line.push_back('\n');
  (void)!write(g_report_fd, line.data(), line.size());
  abort();
}

ScratchDir::ScratchDir(std::string_view name) {
  const char* tmp = getenv("TMPDIR");
  std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                     "/rdmavirt-fuzz-" + std::string(name) + ".XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) Fail("mkdtemp: cannot make a scratch directory");
  path_ = tmpl;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<std::string> ScratchDir::List(int* symlinks) const {
  std::vector<std::string> out;
  if (symlinks != nullptr) *symlinks = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(path_, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    out.push_back(std::filesystem::relative(it->path(), path_, ec).string());
    if (symlinks != nullptr && it->is_symlink(ec)) ++*symlinks;
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace rdmavirt::fuzz
