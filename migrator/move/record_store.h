// Migration records in the state directory: each move's MigrationRecord
// (protos/rdmavirt/v1/migrator.proto) in DIR/ID/record.pb, replaced
// atomically (write, fsync, rename) at every phase change, so that a
// migrator restarted at any point finds either the previous or the new
// record, never a torn one. Free functions, no shared state.
#ifndef RDMAVIRT_MIGRATOR_MOVE_RECORD_STORE_H_
#define RDMAVIRT_MIGRATOR_MOVE_RECORD_STORE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rdmavirt/v1/migrator.pb.h"

namespace rdmavirt::migrator {

inline constexpr char kRecordFile[] = "record.pb";

// Writes `record` as DIR/record.pb (creating DIR). UNAVAILABLE on I/O errors.
absl::Status WriteRecord(const std::string& dir, const v1::MigrationRecord& record);

// NOT_FOUND without a record; DATA_LOSS when it does not parse.
absl::StatusOr<v1::MigrationRecord> ReadRecord(const std::string& dir);

// The records under PARENT/*/record.pb with their directories, in no
// particular order; unreadable ones are logged and skipped.
std::vector<std::pair<std::string, v1::MigrationRecord>> ListRecords(const std::string& parent);

// Writes `data` to PATH atomically (temporary file, fsync, rename).
absl::Status WriteFileAtomically(const std::string& path, const std::string& data);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_MOVE_RECORD_STORE_H_
