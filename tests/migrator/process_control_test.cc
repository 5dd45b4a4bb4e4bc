// The real ProcessControl on real processes: a parent with a child and a
// grandchild, stopped, continued and killed as one tree.
#include "migrator/host/process_control.h"

#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdmavirt::migrator {
namespace {

using ::testing::UnorderedElementsAre;

char StateOf(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return 0;
  const size_t paren = line.rfind(')');
  return paren + 2 < line.size() ? line[paren + 2] : 0;
}

// Waits (bounded) for `pred`; false if it never held.
template <typename Pred>
bool WaitFor(Pred pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

// A parent (this test's child) that forks a child, which forks a
// grandchild; all sleep. The pids come back through a pipe.
struct Tree {
  pid_t parent = 0, child = 0, grandchild = 0;
};

Tree StartTree() {
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t parent = fork();
  if (parent == 0) {
    close(fds[0]);
    const pid_t child = fork();
    if (child == 0) {
      const pid_t grandchild = fork();
      if (grandchild == 0) {
        for (;;) pause();
      }
      pid_t both[2] = {getpid(), grandchild};
      if (write(fds[1], both, sizeof(both)) != sizeof(both)) _exit(1);
      for (;;) pause();
    }
    for (;;) pause();
  }
  close(fds[1]);
  Tree t;
  t.parent = parent;
  pid_t both[2];
  if (read(fds[0], both, sizeof(both)) == sizeof(both)) {
    t.child = both[0];
    t.grandchild = both[1];
  }
  close(fds[0]);
  return t;
}

TEST(ProcessControlTest, StopsContinuesAndKillsTheWholeTree) {
  std::unique_ptr<ProcessControl> pc = NewProcessControl();
  const Tree t = StartTree();
  ASSERT_GT(t.grandchild, 0);
  EXPECT_THAT(pc->Descendants(t.parent), UnorderedElementsAre(t.child, t.grandchild));
  EXPECT_THAT(pc->Descendants(t.child), UnorderedElementsAre(t.grandchild));
  EXPECT_TRUE(pc->Descendants(t.grandchild).empty());

  ASSERT_TRUE(pc->Stop(t.parent).ok());
  for (pid_t p : {t.parent, t.child, t.grandchild}) EXPECT_EQ(StateOf(p), 'T') << p;
  ASSERT_TRUE(pc->Continue(t.parent).ok());
  for (pid_t p : {t.parent, t.child, t.grandchild})
    EXPECT_TRUE(WaitFor([&] { return StateOf(p) == 'S'; })) << p << " " << StateOf(p);

  // Killed from the root: none of it stays (before, the child and the
  // grandchild went on under init).
  ASSERT_TRUE(pc->Kill(t.parent).ok());
  EXPECT_FALSE(pc->Exists(t.parent));
  for (pid_t p : {t.child, t.grandchild})
    EXPECT_TRUE(WaitFor([&] { return !pc->Exists(p); })) << p << " still runs";
  EXPECT_TRUE(pc->Kill(t.parent).ok());  // gone already: OK
}

}  // namespace
}  // namespace rdmavirt::migrator
