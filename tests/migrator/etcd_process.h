// A real etcd (Debian's etcd-server) for the tests of the inventory: one
// member on 127.0.0.1, free ports, a fresh data directory, killed with the
// object. The tests wait for it with their own calls (etcd is up within a
// fraction of a second; the inventory's calls wait for a connection).
#ifndef RDMAVIRT_TESTS_MIGRATOR_ETCD_PROCESS_H_
#define RDMAVIRT_TESTS_MIGRATOR_ETCD_PROCESS_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rdmavirt::migrator::testing {

constexpr char kEtcd[] = "/usr/bin/etcd";

inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(a.sin_port);
}

// One etcd member, killed with the test.
class Etcd {
 public:
  // `tls_dir`: serve https with host1's certificate and require clients'.
  // `client_port` 0: a free one.
  explicit Etcd(const std::string& tls_dir = "", int client_port = 0) {
    dir_ = absl::StrCat(::testing::TempDir(), "/etcd-", getpid(), "-", ++count_);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    const int client = client_port != 0 ? client_port : FreePort(), peer = FreePort();
    const std::string scheme = tls_dir.empty() ? "http" : "https";
    url_ = absl::StrCat(scheme, "://127.0.0.1:", client);
    const std::string peer_url = absl::StrCat("http://127.0.0.1:", peer);
    std::vector<std::string> args = {kEtcd,
                                     "--name",
                                     "t",
                                     "--data-dir",
                                     dir_ + "/data",
                                     "--listen-client-urls",
                                     url_,
                                     "--advertise-client-urls",
                                     url_,
                                     "--listen-peer-urls",
                                     peer_url,
                                     "--initial-advertise-peer-urls",
                                     peer_url,
                                     "--initial-cluster",
                                     "t=" + peer_url};
    if (!tls_dir.empty())
      for (const std::string& a :
           {"--cert-file=" + tls_dir + "/host1.pem", "--key-file=" + tls_dir + "/host1.key",
            "--trusted-ca-file=" + tls_dir + "/ca.pem", std::string("--client-cert-auth")})
        args.push_back(a);
    const std::string log = dir_ + "/etcd.log";
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(kEtcd, argv.data());
      _exit(127);
    }
  }
  // Its data directory (over 100 MiB) goes with it, kept only when the
  // test failed (its log is there).
  ~Etcd() {
    Kill();
    if (!::testing::Test::HasFailure()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }
  const std::string& url() const { return url_; }
  int port() const { return std::stoi(url_.substr(url_.rfind(':') + 1)); }
  std::string log() const { return dir_ + "/etcd.log"; }

 private:
  static inline int count_ = 0;
  std::string dir_, url_;
  pid_t pid_ = 0;
};

}  // namespace rdmavirt::migrator::testing

#endif  // RDMAVIRT_TESTS_MIGRATOR_ETCD_PROCESS_H_
