// Certificates for the tests of TLS and of who may act: a CA with host1
// and cli from tools/rdmavirt-certs (`lab 1`), and the certificates that
// must be refused from tests/migrator/bad-certs.sh (expired, expiredhost,
// noeku), in a fresh directory under the test's temporary directory, which
// the test deletes when it is done (RemoveTestCerts).
#ifndef RDMAVIRT_TESTS_MIGRATOR_TEST_CERTS_H_
#define RDMAVIRT_TESTS_MIGRATOR_TEST_CERTS_H_

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rdmavirt::migrator::testing {

// The directory; `name` makes it unique within the test binary.
inline std::string MakeTestCerts(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/certs-", getpid(), "-", name);
  std::filesystem::remove_all(dir);
  const std::string cmd =
      absl::StrCat(RDMAVIRT_SOURCE_DIR, "/tools/rdmavirt-certs --dir ", dir, " lab 1 && ",
                   RDMAVIRT_SOURCE_DIR, "/tests/migrator/bad-certs.sh ", dir, " > /dev/null 2>&1");
  EXPECT_EQ(system(cmd.c_str()), 0) << cmd;
  return dir;
}

// Deletes a directory MakeTestCerts made (each test process makes its
// own: left behind, they pile up in the temporary directory).
inline void RemoveTestCerts(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  EXPECT_FALSE(ec) << "removing " << dir << ": " << ec.message();
}

}  // namespace rdmavirt::migrator::testing

#endif  // RDMAVIRT_TESTS_MIGRATOR_TEST_CERTS_H_
