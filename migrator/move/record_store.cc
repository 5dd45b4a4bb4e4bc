#include "migrator/move/record_store.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "migrator/host/log.h"

namespace rdmavirt::migrator {

absl::Status WriteFileAtomically(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("creating ", tmp, ": ", strerror(errno)));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat("writing ", tmp, ": ", strerror(err)));
    }
    done += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0 || close(fd) != 0)
    return absl::UnavailableError(absl::StrCat("syncing ", tmp, ": ", strerror(errno)));
  if (rename(tmp.c_str(), path.c_str()) != 0)
    return absl::UnavailableError(absl::StrCat("renaming ", tmp, ": ", strerror(errno)));
  // The rename itself survives a crash once the directory is synced.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::Status WriteRecord(const std::string& dir, const v1::MigrationRecord& record) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating ", dir, ": ", ec.message()));
  return WriteFileAtomically(dir + "/" + kRecordFile, record.SerializeAsString());
}

absl::StatusOr<v1::MigrationRecord> ReadRecord(const std::string& dir) {
  const std::string path = dir + "/" + kRecordFile;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no record in ", dir));
  std::stringstream buf;
  buf << in.rdbuf();
  v1::MigrationRecord record;
  if (!record.ParseFromString(buf.str()))
    return absl::DataLossError(absl::StrCat(path, " does not parse as a MigrationRecord"));
  return record;
}

std::vector<std::pair<std::string, v1::MigrationRecord>> ListRecords(const std::string& parent) {
  std::vector<std::pair<std::string, v1::MigrationRecord>> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    if (!entry.is_directory()) continue;
    absl::StatusOr<v1::MigrationRecord> r = ReadRecord(entry.path().string());
    if (absl::IsNotFound(r.status())) continue;
    if (!r.ok()) {
      Log("state: skipping %s: %s", entry.path().string(), r.status().ToString());
      continue;
    }
    out.emplace_back(entry.path().string(), *std::move(r));
  }
  return out;
}

}  // namespace rdmavirt::migrator
