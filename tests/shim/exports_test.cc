// The classification of libibverbs' and librdmacm's exports (shim/abi/exports.h)
// against what is installed and what librdmavirt.so defines: an export
// nobody classified, or a version nobody looked at, fails here.
#include "shim/abi/exports.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>

#include <map>
#include <set>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace rdmavirt::shim {
namespace {

// The file the dynamic linker finds for `soname`.
std::string LibraryPath(const char* soname) {
  void* h = dlopen(soname, RTLD_LAZY | RTLD_LOCAL);
  if (h == nullptr) return "";
  link_map* map = nullptr;
  std::string path;
  if (dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr) path = map->l_name;
  dlclose(h);
  return path;
}

// `nm -D --defined-only` of a library: name -> its versions ("" when
// unversioned), version-definition entries left out.
std::map<std::string, std::set<std::string>> DefinedSymbols(const std::string& path) {
  std::map<std::string, std::set<std::string>> out;
  FILE* f = popen(("nm -D --defined-only '" + path + "'").c_str(), "r");
  if (f == nullptr) return out;
  char line[512];
  while (fgets(line, sizeof line, f) != nullptr) {
    std::istringstream in(line);
    std::string addr, type, sym;
    if (!(in >> addr >> type >> sym) || type == "A") continue;
    const size_t at = sym.find('@');
    std::string version;
    if (at != std::string::npos) version = sym.substr(sym.find_first_not_of('@', at));
    out[sym.substr(0, at)].insert(version);
  }
  pclose(f);
  return out;
}

std::set<std::string> Words(const char* s) {
  std::istringstream in(s);
  std::set<std::string> out;
  for (std::string w; in >> w;) out.insert(w);
  return out;
}

class ExportsTest : public testing::Test {
 protected:
  void SetUp() override {
    for (const char* soname : {"libibverbs.so.1", "librdmacm.so.1"}) {
      const std::string path = LibraryPath(soname);
      ASSERT_FALSE(path.empty()) << soname << " is not installed";
      auto syms = DefinedSymbols(path);
      ASSERT_GT(syms.size(), 20u) << "nm -D read nothing from " << path;
      for (auto& [name, versions] : syms) exports_[name] = versions;
    }
    shim_ = DefinedSymbols(RDMAVIRT_SHIM_PATH);
    ASSERT_TRUE(shim_.count("ibv_create_qp")) << "nm -D read nothing from " RDMAVIRT_SHIM_PATH;
  }

  std::map<std::string, std::set<std::string>> exports_;
  std::map<std::string, std::set<std::string>> shim_;
};

TEST_F(ExportsTest, EveryExportAndEveryVersionIsClassified) {
  for (const auto& [name, versions] : exports_) {
    const ExportRule* rule = FindExportRule(name);
    if (rule == nullptr) {
      ADD_FAILURE() << name
                    << " is exported by rdma-core and not classified in shim/abi/exports.cc";
      continue;
    }
    EXPECT_EQ(Words(rule->versions), versions)
        << name << ": the versions exported differ from those classified";
  }
}

TEST_F(ExportsTest, NoRuleForAnExportThatIsGone) {
  for (const ExportRule& r : ExportRules())
    EXPECT_TRUE(exports_.count(r.name)) << r.name << " is classified but no longer exported";
}

TEST_F(ExportsTest, TheShimDefinesExactlyWhatItClaims) {
  for (const ExportRule& r : ExportRules()) {
    if (ShimDefines(r))
      EXPECT_TRUE(shim_.count(r.name)) << r.name << " is classified as the shim's, not defined";
    else
      EXPECT_FALSE(shim_.count(r.name)) << r.name << " is classified as passed through, but the "
                                        << "shim defines it";
  }
}

TEST_F(ExportsTest, TheShimExportsNothingUnclassified) {
  // Besides the verbs, only the dl lookups that catch dlopen'ed libibverbs,
  // the write() that relays refused doorbells (shim/datapath/write_relay.h) and the
  // signal masks that keep the pause's probe signal open
  // (shim/datapath/thread_probe.h).
  const std::set<std::string> own = {"dlsym", "dlvsym", "write", "pthread_sigmask", "sigprocmask"};
  for (const auto& [name, versions] : shim_) {
    if (own.count(name)) continue;
    const ExportRule* rule = FindExportRule(name);
    EXPECT_TRUE(rule != nullptr && ShimDefines(*rule))
        << "librdmavirt.so exports " << name
        << ", which shim/abi/exports.cc does not list as its own";
    EXPECT_EQ(versions, std::set<std::string>{""})
        << name << ": the shim's verbs are unversioned, so they serve every version";
  }
}

TEST_F(ExportsTest, EveryRuleSaysWhy) {
  for (const ExportRule& r : ExportRules()) EXPECT_GT(std::string(r.why).size(), 8u) << r.name;
}

}  // namespace
}  // namespace rdmavirt::shim
