// ShimServer over a real Unix socket, with a fake shim client in the test
// process (its pid is ours, so SO_PEERCRED matches a Hello that says so),
// or in a child in a pid namespace of its own.
#include "migrator/transport/shim_server.h"

#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "migrator/transport/frame.h"

namespace rdmavirt::migrator {
namespace {

using ::testing::HasSubstr;

class ShimServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/shim_server_test-", getpid());
    std::filesystem::remove_all(dir_);
    ShimServer::Options o;
    o.socket_path = dir_ + "/migratord.sock";
    o.hello_timeout = absl::Milliseconds(500);
    absl::StatusOr<std::unique_ptr<ShimServer>> s = ShimServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  int Connect() {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string path = dir_ + "/migratord.sock";
    memcpy(a.sun_path, path.c_str(), path.size() + 1);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  }

  static std::string Hello(int pid, v1::ControlVersion version = v1::CONTROL_VERSION_V1,
                           v1::EndpointPhase phase = v1::ENDPOINT_PHASE_RUNNING) {
    v1::ShimToMigrator m;
    m.mutable_hello()->set_version(version);
    m.mutable_hello()->set_pid(pid);
    m.mutable_hello()->set_endpoint_id("ep-test");
    m.mutable_hello()->set_phase(phase);
    m.mutable_hello()->set_program("fake");
    return m.SerializeAsString();
  }

  // True when the server closed the connection (a read sees EOF).
  static bool ClosedByServer(int fd) {
    timeval tv{3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char c;
    return recv(fd, &c, 1, 0) == 0;
  }

  bool WaitConnected(bool want) {
    for (int i = 0; i < 300; ++i) {
      if (!server_->Connected().empty() == want) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  void ExpectRefused(int fd) {
    EXPECT_TRUE(ClosedByServer(fd));
    EXPECT_TRUE(server_->Connected().empty());
    EXPECT_GE(server_->refused(), 1);
    close(fd);
  }

  std::string dir_;
  std::unique_ptr<ShimServer> server_;
};

TEST_F(ShimServerTest, AdmitsAHelloAndCarriesRequests) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, Hello(getpid())).ok());
  ASSERT_TRUE(WaitConnected(true));
  EXPECT_EQ(server_->Connected()[0].endpoint_id, "ep-test");
  std::thread shim([fd] {
    absl::StatusOr<std::string> f = ReadFrame(fd);
    ASSERT_TRUE(f.ok());
    v1::MigratorToShim req;
    ASSERT_TRUE(req.ParseFromString(*f));
    EXPECT_TRUE(req.has_describe());
    EXPECT_GT(req.request_id(), 0u);
    v1::ShimToMigrator rep;
    rep.set_request_id(req.request_id());
    rep.mutable_reply()->mutable_summary()->set_pid(getpid());
    ASSERT_TRUE(WriteFrame(fd, rep.SerializeAsString()).ok());
  });
  v1::MigratorToShim req;
  req.mutable_describe();
  absl::StatusOr<v1::Reply> r = server_->Call(getpid(), req, absl::Seconds(5));
  shim.join();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->summary().pid(), getpid());
  close(fd);
  EXPECT_TRUE(WaitConnected(false));
}

TEST_F(ShimServerTest, TheListedPhaseFollowsTheRepliesNotJustTheHello) {
  // A restored process says RELEASED in its Hello, then runs again: its
  // peers' migrations must find it among the running ones.
  const int fd = Connect();
  ASSERT_TRUE(
      WriteFrame(fd, Hello(getpid(), v1::CONTROL_VERSION_V1, v1::ENDPOINT_PHASE_RELEASED)).ok());
  ASSERT_TRUE(WaitConnected(true));
  EXPECT_EQ(server_->Connected()[0].phase, v1::ENDPOINT_PHASE_RELEASED);
  std::thread shim([fd] {
    absl::StatusOr<std::string> f = ReadFrame(fd);
    ASSERT_TRUE(f.ok());
    v1::MigratorToShim req;
    ASSERT_TRUE(req.ParseFromString(*f));
    v1::ShimToMigrator rep;
    rep.set_request_id(req.request_id());
    rep.mutable_reply()->mutable_summary()->set_phase(v1::ENDPOINT_PHASE_RUNNING);
    ASSERT_TRUE(WriteFrame(fd, rep.SerializeAsString()).ok());
  });
  v1::MigratorToShim req;
  req.mutable_restore();
  ASSERT_TRUE(server_->Call(getpid(), req, absl::Seconds(5)).ok());
  shim.join();
  EXPECT_EQ(server_->Connected()[0].phase, v1::ENDPOINT_PHASE_RUNNING);
  close(fd);
}

TEST_F(ShimServerTest, RefusesAnOversizedFrame) {
  const int fd = Connect();
  const uint32_t n = kMaxFrame + 1;
  const unsigned char len[4] = {static_cast<unsigned char>(n), static_cast<unsigned char>(n >> 8),
                                static_cast<unsigned char>(n >> 16),
                                static_cast<unsigned char>(n >> 24)};
  ASSERT_EQ(send(fd, len, 4, MSG_NOSIGNAL), 4);
  ExpectRefused(fd);
}

TEST_F(ShimServerTest, RefusesATruncatedFrame) {
  const int fd = Connect();
  const std::string hello = Hello(getpid());
  std::string frame = {static_cast<char>(hello.size()), 0, 0, 0};
  frame += hello.substr(0, hello.size() / 2);
  ASSERT_EQ(send(fd, frame.data(), frame.size(), MSG_NOSIGNAL), static_cast<ssize_t>(frame.size()));
  shutdown(fd, SHUT_WR);
  ExpectRefused(fd);
}

TEST_F(ShimServerTest, RefusesASilentClient) {
  const int fd = Connect();
  ExpectRefused(fd);  // no Hello within the hello timeout
}

TEST_F(ShimServerTest, RefusesGarbage) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, std::string("\xff\xff\xff\xff\x0f garbage", 13)).ok());
  ExpectRefused(fd);
}

TEST_F(ShimServerTest, RefusesAMessageThatIsNotAHello) {
  const int fd = Connect();
  v1::ShimToMigrator m;
  m.set_request_id(7);
  m.mutable_reply()->set_code(0);
  ASSERT_TRUE(WriteFrame(fd, m.SerializeAsString()).ok());
  ExpectRefused(fd);
}

TEST_F(ShimServerTest, RefusesAWrongVersion) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, Hello(getpid(), static_cast<v1::ControlVersion>(2))).ok());
  ExpectRefused(fd);
}

TEST_F(ShimServerTest, RefusesAHelloForAnotherPid) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, Hello(getpid() + 1)).ok());
  ExpectRefused(fd);
}

TEST_F(ShimServerTest, RefusesAHelloForPidOneFromThisNamespace) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, Hello(1)).ok());
  ExpectRefused(fd);
}

// A shim in a pid namespace of its own (a container's) says Hello with its
// pid there; the server admits it, knows it by its pid here, and gives
// that pid in the summaries it replies with.
TEST_F(ShimServerTest, AdmitsAShimInItsOwnPidNamespaceAndKnowsItByItsPidHere) {
  int pids[2];
  ASSERT_EQ(pipe(pids), 0);
  const std::string hello = Hello(1);  // the first process of a new namespace
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pids[0]);
    if (unshare(CLONE_NEWPID) != 0) _exit(2);  // not allowed here: skipped below
    const pid_t shim = fork();
    if (shim == 0) {
      const int fd = Connect();
      if (!WriteFrame(fd, hello).ok()) _exit(1);
      absl::StatusOr<std::string> f = ReadFrame(fd);
      v1::MigratorToShim req;
      if (!f.ok() || !req.ParseFromString(*f)) _exit(1);
      v1::ShimToMigrator rep;
      rep.set_request_id(req.request_id());
      rep.mutable_reply()->mutable_summary()->set_pid(getpid());
      if (!WriteFrame(fd, rep.SerializeAsString()).ok()) _exit(1);
      char c;
      while (read(fd, &c, 1) > 0) {
      }
      _exit(getpid() == 1 ? 0 : 3);
    }
    if (write(pids[1], &shim, sizeof(shim)) != sizeof(shim)) _exit(1);
    int status = 0;
    waitpid(shim, &status, 0);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
  }
  close(pids[1]);
  pid_t shim = 0;
  const bool got = read(pids[0], &shim, sizeof(shim)) == sizeof(shim);
  close(pids[0]);
  if (!got) {
    int status = 0;
    waitpid(child, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 2) GTEST_SKIP() << "no CLONE_NEWPID here";
    FAIL() << "the child in a new pid namespace failed";
  }
  ASSERT_TRUE(WaitConnected(true));
  EXPECT_EQ(server_->Connected()[0].pid, shim);
  v1::MigratorToShim req;
  req.mutable_describe();
  absl::StatusOr<v1::Reply> r = server_->Call(shim, req, absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->summary().pid(), shim)
      << "the summary gives the pid the shim sees, not its pid here";
  server_.reset();  // closes the connection: the shim ends
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST_F(ShimServerTest, CallFailsCleanlyWhenTheShimDisappears) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, Hello(getpid())).ok());
  ASSERT_TRUE(WaitConnected(true));
  v1::MigratorToShim req;
  req.mutable_describe();
  // No answer at all.
  absl::StatusOr<v1::Reply> r = server_->Call(getpid(), req, absl::Milliseconds(200));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  // That request is still unread; read here, so that the shim below takes
  // the next one and not that one (else it could leave before the next
  // call starts, which then finds no shim at all).
  ASSERT_TRUE(ReadFrame(fd).ok());
  // Gone in the middle of a request.
  std::thread shim([fd] {
    (void)ReadFrame(fd);
    close(fd);
  });
  r = server_->Call(getpid(), req, absl::Seconds(5));
  shim.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  // Once the server has seen it go, it is not found.
  ASSERT_TRUE(server_->WaitClosed(getpid(), absl::Seconds(5)).ok());
  EXPECT_EQ(server_->Call(getpid(), req, absl::Seconds(1)).status().code(),
            absl::StatusCode::kNotFound);
}

// release -> the shim closes -> marker -> it comes back RELEASED.
TEST_F(ShimServerTest, ReleasedShimComesBackThroughTheResumeMarker) {
  const int fd = Connect();
  ASSERT_TRUE(WriteFrame(fd, Hello(getpid())).ok());
  ASSERT_TRUE(WaitConnected(true));
  const std::string marker = absl::StrCat(dir_, "/resume/", ResumeMarkerName(getpid()));
  std::thread shim([&, fd] {
    absl::StatusOr<std::string> f = ReadFrame(fd);
    ASSERT_TRUE(f.ok());
    v1::MigratorToShim req;
    ASSERT_TRUE(req.ParseFromString(*f));
    v1::ShimToMigrator rep;
    rep.set_request_id(req.request_id());
    rep.mutable_reply();
    ASSERT_TRUE(WriteFrame(fd, rep.SerializeAsString()).ok());
    close(fd);
    struct stat st;
    while (stat(marker.c_str(), &st) != 0) absl::SleepFor(absl::Milliseconds(10));
    const int again = Connect();
    ASSERT_TRUE(
        WriteFrame(again, Hello(getpid(), v1::CONTROL_VERSION_V1, v1::ENDPOINT_PHASE_RELEASED))
            .ok());
    char c;
    (void)recv(again, &c, 1, 0);  // until the server closes
    close(again);
  });
  v1::MigratorToShim rel;
  rel.mutable_release();
  ASSERT_TRUE(server_->Call(getpid(), rel, absl::Seconds(5)).ok());
  EXPECT_TRUE(server_->WaitClosed(getpid(), absl::Seconds(5)).ok());
  EXPECT_EQ(server_->WaitHello(getpid(), v1::ENDPOINT_PHASE_RELEASED, absl::Milliseconds(100))
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(server_->SetResumeMarker(getpid(), true).ok());
  absl::StatusOr<ShimInfo> back =
      server_->WaitHello(getpid(), v1::ENDPOINT_PHASE_RELEASED, absl::Seconds(5));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(server_->SetResumeMarker(getpid(), false).ok());
  struct stat st;
  EXPECT_NE(stat(marker.c_str(), &st), 0);
  server_.reset();  // closes the connection; the fake shim ends
  shim.join();
}

TEST(ShimServerStartTest, RefusesASecondServerOnALiveSocket) {
  // A directory of its own: one named after the pid could be left from an
  // earlier run whose pid this one reuses.
  std::string dir = absl::StrCat(::testing::TempDir(), "/shim_server_twice-XXXXXX");
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  ShimServer::Options o;
  o.socket_path = dir + "/s.sock";
  {
    absl::StatusOr<std::unique_ptr<ShimServer>> a = ShimServer::Start(o);
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<std::unique_ptr<ShimServer>> b = ShimServer::Start(o);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("another migrator"));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace rdmavirt::migrator
