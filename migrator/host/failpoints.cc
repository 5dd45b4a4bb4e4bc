#include "migrator/host/failpoints.h"

#include <signal.h>

#include <cstdlib>
#include <set>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "migrator/host/log.h"

namespace rdmavirt::migrator {
namespace {

const std::set<std::string>& Points() {
  static const std::set<std::string>* points = [] {
    auto* s = new std::set<std::string>;
    if (const char* env = getenv("RDMAVIRT_FAILPOINTS"))
      for (absl::string_view p : absl::StrSplit(env, ',', absl::SkipWhitespace())) s->emplace(p);
    return s;
  }();
  return *points;
}

}  // namespace

void ReachFailpoint(absl::string_view point) {
  const std::set<std::string>& points = Points();
  if (points.empty() || !points.contains(std::string(point))) return;
  Log("failpoint %s reached: stopping (SIGSTOP)", point);
  raise(SIGSTOP);
  Log("failpoint %s: continued", point);
}

std::string FailpointsSet() { return absl::StrJoin(Points(), ","); }

}  // namespace rdmavirt::migrator
