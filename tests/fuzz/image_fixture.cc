#include "tests/fuzz/image_fixture.h"

#include <filesystem>
#include <fstream>

#include "tests/fuzz/fuzz_util.h"

namespace rdmavirt::fuzz {

void WriteImageFixture(const std::string& dir) {
  const std::pair<const char*, std::string> files[] = {
      {"inventory.img", "abc"},
      {"empty.img", ""},
      {"core-42.img", std::string("\x4f\x00\x00\x00core of 42", 14)},
      {"pages-1.img", std::string(6000, 'p')},
      {"sub/fdinfo-2.img", "fd"},
  };
  for (const auto& [name, content] : files) {
    const std::filesystem::path p = std::filesystem::path(dir) / name;
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << content;
    Check(out.good(), "writing the image fixture");
  }
}

}  // namespace rdmavirt::fuzz
