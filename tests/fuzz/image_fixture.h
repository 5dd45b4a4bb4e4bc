// A checkpoint directory as CRIU leaves one, with fixed contents: what the
// image fuzz targets verify manifests against and send, and what their
// seeds' manifests (ScanImages of the same files) list. Thread-safe.
#ifndef RDMAVIRT_TESTS_FUZZ_IMAGE_FIXTURE_H_
#define RDMAVIRT_TESTS_FUZZ_IMAGE_FIXTURE_H_

#include <string>

namespace rdmavirt::fuzz {

// Writes the files into `dir` (created if missing). Fail()s on an error.
void WriteImageFixture(const std::string& dir);

}  // namespace rdmavirt::fuzz

#endif  // RDMAVIRT_TESTS_FUZZ_IMAGE_FIXTURE_H_
