// The probed path's section of the built librdmavirt.so (shim/datapath/thread_probe.h):
// the pause counts a thread with a frame in that section as inside a post
// or poll, so no function there may leave it by a jump (a tail call, which
// takes its frame away) while the call is not over: every direct branch
// out of the section lands in one of the gate's entries
// (PostSendNotProbed, PostRecvNotMarked, PollCqGated), which raise the
// thread's mark and check the pause again. A compiler that turns one more
// call into a tail call fails here instead of opening a race.
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

struct Branch {
  unsigned long from;
  unsigned long to;
  std::string target;  // the symbol objdump names, without the offset
  std::string line;
};

struct Function {
  unsigned long start;
  std::string name;
};

struct Section {
  unsigned long lo = ~0ul;
  unsigned long hi = 0;
  std::vector<Function> functions;
  std::vector<Branch> branches;
  std::vector<Branch> unparsed;  // branches to a named target not understood (from, line)
};

// Disassembles the section, or only [start, stop) of it when stop is not 0.
Section Disassemble(const std::string& lib, unsigned long start = 0, unsigned long stop = 0) {
  Section s;
  std::string cmd = "objdump -d --no-show-raw-insn -C -j rdmavirt_probed_path";
  if (stop != 0)
    cmd += " --start-address=" + std::to_string(start) + " --stop-address=" + std::to_string(stop);
  cmd += " '" + lib + "'";
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return s;
  const std::regex fn(R"(^([0-9a-f]+) <(.*)>:$)");
  const std::regex insn(R"(^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$)");
  const std::regex direct(R"(^([0-9a-f]+) <(.*?)(\+0x[0-9a-f]+)?>$)");
  char buf[4096];
  while (fgets(buf, sizeof buf, f) != nullptr) {
    std::string line(buf);
    if (!line.empty() && line.back() == '\n') line.pop_back();
    std::smatch m;
    if (std::regex_match(line, m, fn)) {
      const unsigned long at = std::stoul(m[1], nullptr, 16);
      s.functions.push_back({at, m[2]});
      s.lo = std::min(s.lo, at);
      continue;
    }
    if (!std::regex_match(line, m, insn)) continue;
    const unsigned long at = std::stoul(m[1], nullptr, 16);
    s.hi = std::max(s.hi, at + 1);
    const std::string op = m[2];
    const std::string args = m[3];
    if (op[0] != 'j') continue;  // jmp, jcc
    std::smatch d;
    if (std::regex_match(args, d, direct))
      s.branches.push_back({at, std::stoul(d[1], nullptr, 16), d[2], line});
    else if (args.find('<') != std::string::npos)
      s.unparsed.push_back({at, 0, "", line});
  }
  pclose(f);
  return s;
}

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define RDMAVIRT_SANITIZED 1
#endif
#endif

// UBSan's function check (clang's -fsanitize=function, in the sanitized
// build) starts each function with a jump over 6 bytes of data: a linear
// disassembly reads that data as instructions and loses step with the
// code after it. In that build only, a function that starts with a jump
// to its 9th byte is disassembled again from there (anywhere else, such
// a jump would be code, and its data none).
#ifdef RDMAVIRT_SANITIZED
constexpr unsigned long kPrologueBytes = 8;
#else
constexpr unsigned long kPrologueBytes = 0;  // never matches: no jump goes to its own start
#endif

Section DisassembleSkippingPrologueData(const std::string& lib) {
  Section s = Disassemble(lib);
  if (kPrologueBytes == 0) return s;
  for (size_t i = 0; i < s.functions.size(); ++i) {
    const unsigned long start = s.functions[i].start;
    const unsigned long stop = i + 1 < s.functions.size() ? s.functions[i + 1].start : s.hi;
    const auto first = std::find_if(s.branches.begin(), s.branches.end(),
                                    [&](const Branch& b) { return b.from == start; });
    if (first == s.branches.end() || first->line.find("jmp") == std::string::npos ||
        first->to != start + kPrologueBytes || first->to >= stop)
      continue;
    const unsigned long code = first->to;
    auto in_data = [&](const Branch& b) { return b.from >= start && b.from < stop; };
    s.branches.erase(std::remove_if(s.branches.begin(), s.branches.end(), in_data),
                     s.branches.end());
    s.unparsed.erase(std::remove_if(s.unparsed.begin(), s.unparsed.end(), in_data),
                     s.unparsed.end());
    const Section again = Disassemble(lib, code, stop);
    s.branches.insert(s.branches.end(), again.branches.begin(), again.branches.end());
    s.unparsed.insert(s.unparsed.end(), again.unparsed.begin(), again.unparsed.end());
  }
  return s;
}

TEST(ProbedSectionTest, NoJumpLeavesTheSectionButIntoTheGate) {
  const Section s = DisassembleSkippingPrologueData(RDMAVIRT_SHIM_PATH);
  ASSERT_FALSE(s.functions.empty()) << "no rdmavirt_probed_path section in " << RDMAVIRT_SHIM_PATH;
  // The entries and the translating functions they jump into.
  for (const char* want :
       {"::PostSendProbed(", "::PollCqProbed(", "::PostOneTranslated(", "::PostChainTranslated(",
        "::PollTranslatedSlow(", "::PostRecvProbed(", "::PostSrqRecvProbed(",
        "::PostRecvTranslatedProbed(", "::PostSrqRecvTranslatedProbed("}) {
    bool found = false;
    for (const Function& f : s.functions) found = found || f.name.find(want) != std::string::npos;
    EXPECT_TRUE(found) << want << " is not in the probed path's section";
  }
  int inside = 0;
  for (const Branch& b : s.branches) {
    if (b.to >= s.lo && b.to < s.hi) {
      ++inside;
      continue;
    }
    const bool gate = b.target.find("PostSendNotProbed(") != std::string::npos ||
                      b.target.find("PostRecvNotMarked<") != std::string::npos ||
                      b.target.find("PollCqGated(") != std::string::npos;
    EXPECT_TRUE(gate) << "a jump out of the probed path's section, not into the gate:\n" << b.line;
  }
  EXPECT_GT(inside, 0) << "no branch parsed: objdump's output changed?";
  for (const Branch& b : s.unparsed) ADD_FAILURE() << "a branch not understood:\n" << b.line;
}

}  // namespace
