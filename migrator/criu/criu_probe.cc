// rdmavirt-criu-probe: runs one CriuDriver or image_dir operation and
// prints its result as one JSON object on stdout. For operators debugging
// CRIU on a host, and for the lab tests of the driver.
//
// Exit status: 0 done, 1 the operation failed (the JSON says how), 2 usage.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "migrator/criu/criu_driver.h"
#include "migrator/criu/image_dir.h"

namespace rdmavirt::migrator {
namespace {

constexpr char kUsage[] =
    "usage: rdmavirt-criu-probe [--log-dir DIR] COMMAND ARGS...\n"
    "  check                                   criu check + memory tracking\n"
    "  predump PID DIR [PARENT]                pre-dump (process keeps running)\n"
    "  dump PID DIR [PARENT] [--leave-running] final dump\n"
    "  restore DIR                             restore, detached; prints the pid\n"
    "  manifest DIR                            scan DIR, write DIR/manifest.pb\n"
    "  verify DIR                              check DIR against DIR/manifest.pb\n"
    "CRIU's logs go to --log-dir (default /var/log/rdmavirt/criu), a file per call.\n"
    "Prints one JSON object; exit 0 done, 1 failed, 2 usage.\n";

std::string Json(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out + "\"";
}

int Fail(const std::string& command, const absl::Status& s) {
  printf("{\"ok\": false, \"command\": %s, \"code\": %s, \"error\": %s}\n", Json(command).c_str(),
         Json(absl::StatusCodeToString(s.code())).c_str(), Json(std::string(s.message())).c_str());
  return 1;
}

int Usage(const std::string& why) {
  fprintf(stderr, "rdmavirt-criu-probe: %s\n%s", why.c_str(), kUsage);
  return 2;
}

std::string Absolute(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.lexically_normal().string();
}

bool ParsePid(const std::string& arg, pid_t* pid) {
  int v = 0;
  if (!absl::SimpleAtoi(arg, &v) || v <= 0) return false;
  *pid = v;
  return true;
}

// One command's words: the command, then its arguments.
using Words = std::vector<std::string>;

int CheckCommand(CriuDriver& criu, const Words& pos) {
  const std::string& cmd = pos[0];
  if (pos.size() != 1) return Usage("check takes no arguments");
  const absl::Status s = criu.Check();
  if (!s.ok()) return Fail(cmd, s);
  printf("{\"ok\": true, \"command\": \"check\", \"log_dir\": %s}\n", Json(criu.log_dir()).c_str());
  return 0;
}

int DumpCommand(CriuDriver& criu, const Words& pos, bool leave_running) {
  const std::string& cmd = pos[0];
  const size_t nargs = pos.size() - 1;
  if (nargs < 2 || nargs > 3) return Usage(cmd + " takes PID DIR [PARENT]");
  pid_t pid = 0;
  if (!ParsePid(pos[1], &pid)) return Usage("bad pid " + pos[1]);
  const std::string dir = Absolute(pos[2]);
  const std::string parent = nargs == 3 ? Absolute(pos[3]) : "";
  const absl::StatusOr<CriuResult> r = cmd == "predump"
                                           ? criu.PreDump(pid, dir, parent)
                                           : criu.Dump(pid, dir, parent, leave_running);
  if (!r.ok()) return Fail(cmd, r.status());
  printf(
      "{\"ok\": true, \"command\": %s, \"pid\": %d, \"dir\": %s, \"parent\": %s, "
      "\"leave_running\": %s, \"elapsed_us\": %llu, \"image_bytes\": %llu}\n",
      Json(cmd).c_str(), pid, Json(dir).c_str(), Json(parent).c_str(),
      cmd == "dump" && leave_running ? "true" : "false",
      static_cast<unsigned long long>(r->elapsed_us),
      static_cast<unsigned long long>(r->image_bytes));
  return 0;
}

int RestoreCommand(CriuDriver& criu, const Words& pos) {
  const std::string& cmd = pos[0];
  if (pos.size() != 2) return Usage("restore takes DIR");
  const std::string dir = Absolute(pos[1]);
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<pid_t> pid = criu.Restore(dir);
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  if (!pid.ok()) return Fail(cmd, pid.status());
  printf(
      "{\"ok\": true, \"command\": \"restore\", \"dir\": %s, \"pid\": %d, "
      "\"elapsed_us\": %lld}\n",
      Json(dir).c_str(), *pid, static_cast<long long>(us));
  return 0;
}

int ManifestCommand(const Words& pos) {
  const std::string& cmd = pos[0];
  if (pos.size() != 2) return Usage("manifest takes DIR");
  const std::string dir = Absolute(pos[1]);
  absl::StatusOr<std::vector<v1::ImageFile>> files = ScanImages(dir);
  if (!files.ok()) return Fail(cmd, files.status());
  v1::Manifest m;
  m.set_format_version(kManifestFormatVersion);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  m.set_source_host(host);
  uint64_t total = 0;
  std::string list;
  for (v1::ImageFile& f : *files) {
    total += f.size();
    absl::StrAppend(&list, list.empty() ? "" : ", ", "{\"name\": ", Json(f.name()),
                    ", \"size\": ", f.size(), ", \"digest\": \"", Hex(f.digest()), "\"}");
    *m.add_files() = std::move(f);
  }
  if (absl::Status s = WriteManifest(dir, m); !s.ok()) return Fail(cmd, s);
  printf(
      "{\"ok\": true, \"command\": \"manifest\", \"dir\": %s, \"bytes\": %llu, "
      "\"files\": [%s]}\n",
      Json(dir).c_str(), static_cast<unsigned long long>(total), list.c_str());
  return 0;
}

int VerifyCommand(const Words& pos) {
  const std::string& cmd = pos[0];
  if (pos.size() != 2) return Usage("verify takes DIR");
  const std::string dir = Absolute(pos[1]);
  const absl::StatusOr<v1::Manifest> m = ReadManifest(dir);
  if (!m.ok()) return Fail(cmd, m.status());
  if (absl::Status s = VerifyImages(dir, *m); !s.ok()) return Fail(cmd, s);
  uint64_t total = 0;
  for (const v1::ImageFile& f : m->files()) total += f.size();
  printf(
      "{\"ok\": true, \"command\": \"verify\", \"dir\": %s, \"files\": %d, "
      "\"bytes\": %llu}\n",
      Json(dir).c_str(), m->files_size(), static_cast<unsigned long long>(total));
  return 0;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string log_dir = "/var/log/rdmavirt/criu";
  bool leave_running = false;
  Words pos;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      fputs(kUsage, stdout);
      return 0;
    } else if (args[i] == "--log-dir") {
      if (++i == args.size()) return Usage("--log-dir needs a directory");
      log_dir = args[i];
    } else if (args[i] == "--leave-running") {
      leave_running = true;
    } else if (args[i].rfind("--", 0) == 0) {
      return Usage("unknown option " + args[i]);
    } else {
      pos.push_back(args[i]);
    }
  }
  if (pos.empty()) return Usage("no command");
  const std::string cmd = pos[0];
  if (leave_running && cmd != "dump") return Usage("--leave-running is for dump only");
  CriuDriver criu(Absolute(log_dir));
  if (cmd == "check") return CheckCommand(criu, pos);
  if (cmd == "predump" || cmd == "dump") return DumpCommand(criu, pos, leave_running);
  if (cmd == "restore") return RestoreCommand(criu, pos);
  if (cmd == "manifest") return ManifestCommand(pos);
  if (cmd == "verify") return VerifyCommand(pos);
  return Usage("unknown command " + cmd);
}

}  // namespace
}  // namespace rdmavirt::migrator

int main(int argc, char** argv) { return rdmavirt::migrator::Main(argc, argv); }
