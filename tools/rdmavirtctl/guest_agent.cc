#include "tools/rdmavirtctl/guest_agent.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace rdmavirt::ctl {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// One command to the guest agent; its "return" value.
absl::StatusOr<Value> Agent(virDomainPtr d, const std::string& json, int timeout_s) {
  char* r = lv->virDomainQemuAgentCommand(d, json.c_str(), timeout_s, 0);
  if (r == nullptr) return absl::UnavailableError(LibvirtError("the guest agent"));
  std::string text(r);
  free(r);
  Struct reply;
  if (!google::protobuf::util::JsonStringToMessage(text, &reply).ok())
    return absl::InternalError(absl::StrCat("the guest agent answered ", text));
  auto it = reply.fields().find("return");
  if (it == reply.fields().end())
    return absl::InternalError(absl::StrCat("the guest agent answered ", text));
  return it->second;
}

struct ExecResult {
  int exitcode = -1;
  std::string out, err;
};

// Runs PATH ARGS in the guest (guest-exec) and waits for it to end.
absl::StatusOr<ExecResult> GuestExec(virDomainPtr d, const std::string& path,
                                     const std::vector<std::string>& args, absl::Duration timeout) {
  std::string argv;
  for (const std::string& a : args) absl::StrAppend(&argv, argv.empty() ? "" : ",", JsonQuote(a));
  absl::StatusOr<Value> started =
      Agent(d,
            absl::StrCat(R"({"execute":"guest-exec","arguments":{"path":)", JsonQuote(path),
                         R"(,"arg":[)", argv, R"(],"capture-output":true}})"),
            10);
  if (!started.ok()) return started.status();
  auto pid_it = started->struct_value().fields().find("pid");
  if (pid_it == started->struct_value().fields().end())
    return absl::InternalError("guest-exec gave no pid");
  const int pid = static_cast<int>(pid_it->second.number_value());
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<Value> st = Agent(
        d, absl::StrCat(R"({"execute":"guest-exec-status","arguments":{"pid":)", pid, "}}"), 10);
    if (!st.ok()) return st.status();
    const auto& f = st->struct_value().fields();
    auto exited = f.find("exited");
    if (exited != f.end() && exited->second.bool_value()) {
      ExecResult r;
      if (auto c = f.find("exitcode"); c != f.end()) r.exitcode = c->second.number_value();
      if (auto c = f.find("signal"); c != f.end())
        r.exitcode = 128 + static_cast<int>(c->second.number_value());
      if (auto o = f.find("out-data"); o != f.end())
        absl::Base64Unescape(o->second.string_value(), &r.out);
      if (auto e = f.find("err-data"); e != f.end())
        absl::Base64Unescape(e->second.string_value(), &r.err);
      return r;
    }
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(absl::StrCat(path, " in the guest did not finish within ",
                                                      absl::FormatDuration(timeout)));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace

absl::StatusOr<v1::GuestReport> GuestStep(virDomainPtr d, const std::string& guest_command,
                                          const std::vector<std::string>& args) {
  absl::StatusOr<ExecResult> r = GuestExec(d, guest_command, args, absl::Minutes(3));
  if (!r.ok()) return r.status();
  v1::GuestReport report;
  const bool parsed =
      !r->out.empty() && google::protobuf::util::JsonStringToMessage(r->out, &report).ok();
  if (r->exitcode != 0 || !parsed) {
    std::string why = r->err.empty() ? r->out : r->err;
    while (!why.empty() && why.back() == '\n') why.pop_back();
    if (parsed && !report.error().empty()) why = report.error();
    return absl::AbortedError(absl::StrCat("`", guest_command, " ", args[0],
                                           "` in the guest exited ", r->exitcode, ": ", why));
  }
  return report;
}

std::string GuestAddress(virDomainPtr d, const std::string& mac) {
  virDomainInterfacePtr* ifaces = nullptr;
  const int n =
      lv->virDomainInterfaceAddresses(d, &ifaces, VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT, 0);
  std::string out;
  for (int i = 0; i < n; ++i) {
    if (ifaces[i]->hwaddr != nullptr && absl::EqualsIgnoreCase(ifaces[i]->hwaddr, mac)) {
      for (unsigned j = 0; j < ifaces[i]->naddrs; ++j)
        if (ifaces[i]->addrs[j].type == VIR_IP_ADDR_TYPE_IPV4 && out.empty())
          out = absl::StrCat(ifaces[i]->addrs[j].addr, "/", ifaces[i]->addrs[j].prefix);
    }
    lv->virDomainInterfaceFree(ifaces[i]);
  }
  free(ifaces);
  return out;
}

absl::Status WaitAgent(virDomainPtr d, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<Value> r = Agent(d, R"({"execute":"guest-ping"})", 5);
    if (r.ok()) return absl::OkStatus();
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(absl::StrCat("the guest agent did not answer within ",
                                                      absl::FormatDuration(timeout), ": ",
                                                      r.status().message()));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

uint64_t LongestBlackout(const v1::GuestReport& r) {
  uint64_t m = 0;
  for (const v1::MigrationReport& e : r.endpoints())
    m = std::max<uint64_t>(m, e.breakdown().blackout_us());
  return m;
}

}  // namespace rdmavirt::ctl
