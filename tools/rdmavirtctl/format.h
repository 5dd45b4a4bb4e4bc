// How rdmavirtctl shows things to a person: tables, sizes, durations and
// the summary of a move. Pure functions of the protos.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_FORMAT_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_FORMAT_H_

#include <cstdint>
#include <string>

#include "rdmavirt/v1/migrator.pb.h"

namespace rdmavirt::ctl {

std::string Bytes(uint64_t n);    // "12.3 MiB"
std::string Micros(uint64_t us);  // "812 ms", "5.21 s", "40 us"
std::string EndpointTable(const v1::ListEndpointsResponse& list);
std::string HostText(const v1::HostInfo& host);
std::string StatusText(const v1::StatusResponse& status);
// The inventory's hosts, one line each.
std::string HostsTable(const v1::ListHostsResponse& hosts);
// The summary printed after migrate, checkpoint and restore.
std::string ReportText(const v1::MigrationReport& report);
// The endpoints a guest suspended or resumed.
std::string GuestReportText(const v1::GuestReport& report);
// One line of progress for stderr.
std::string ProgressLine(const v1::Progress& p);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_FORMAT_H_
