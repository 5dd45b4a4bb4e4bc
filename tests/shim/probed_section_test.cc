// The probed path's section of the built librdmavirt.so (shim/thread_probe.h):
// the pause counts a thread with a frame in that section as inside a post
// or poll, so no function there may leave it by a jump (a tail call, which
// takes its frame away) while the call is not over: every direct branch
// out of the section lands in one of the gate's entries
// (PostSendNotProbed, PollCqGated), which raise the thread's mark and
// check the pause again. A compiler that turns one more
// call into a tail call fails here instead of opening a race.
#include <stdio.h>
#include <stdlib.h>

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

struct Section {
  unsigned long lo = ~0ul;
  unsigned long hi = 0;
  std::vector<std::string> functions;
  std::vector<Branch> branches;
  std::vector<std::string> unparsed;  // branches to a named target not understood
};

Section Disassemble(const std::string& lib) {
  Section s;
  const std::string cmd = "objdump -d --no-show-raw-insn -C -j rdmavirt_probed_path '" + lib + "'";
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
      s.functions.push_back(m[2]);
      s.lo = std::min(s.lo, std::stoul(m[1], nullptr, 16));
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
      s.unparsed.push_back(line);
  }
  pclose(f);
  return s;
}

TEST(ProbedSectionTest, NoJumpLeavesTheSectionButIntoTheGate) {
  const Section s = Disassemble(RDMAVIRT_SHIM_PATH);
  ASSERT_FALSE(s.functions.empty()) << "no rdmavirt_probed_path section in " << RDMAVIRT_SHIM_PATH;
  // The entries and the translating functions they jump into.
  for (const char* want : {"::PostSendProbed(", "::PollCqProbed(", "::PostOneTranslated(",
                           "::PostChainTranslated(", "::PollTranslatedSlow("}) {
    bool found = false;
    for (const std::string& f : s.functions) found = found || f.find(want) != std::string::npos;
    EXPECT_TRUE(found) << want << " is not in the probed path's section";
  }
  int inside = 0;
  for (const Branch& b : s.branches) {
    if (b.to >= s.lo && b.to < s.hi) {
      ++inside;
      continue;
    }
    const bool gate = b.target.find("PostSendNotProbed(") != std::string::npos ||
                      b.target.find("PollCqGated(") != std::string::npos;
    EXPECT_TRUE(gate) << "a jump out of the probed path's section, not into the gate:\n" << b.line;
  }
  EXPECT_GT(inside, 0) << "no branch parsed: objdump's output changed?";
  for (const std::string& line : s.unparsed) ADD_FAILURE() << "a branch not understood:\n" << line;
}

}  // namespace
