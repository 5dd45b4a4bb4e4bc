// The write relay (shim/datapath/write_relay.h) over a pipe: a write handed to it
// from another thread lands, under the opener's credentials, unless the
// thread's identity differs from the opener's.
#include "shim/datapath/write_relay.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <thread>

namespace rdmavirt::shim {
namespace {

class WriteRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(pipe2(fds_, O_CLOEXEC), 0);
    std::string why;
    relay_ = WriteRelay::Create(fds_[1], &why);
    if (relay_ == nullptr) GTEST_SKIP() << "no io_uring here: " << why;
    ASSERT_TRUE(PublishRelay(relay_.get()));
  }
  void TearDown() override {
    if (relay_ != nullptr) WithdrawRelay(relay_.get());
    close(fds_[0]);
    close(fds_[1]);
  }

  // What the pipe holds now (the relay left its write end nonblocking; the
  // read end is made so too).
  std::string Drain() {
    fcntl(fds_[0], F_SETFL, O_NONBLOCK);
    char buf[64];
    const ssize_t n = read(fds_[0], buf, sizeof(buf));
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

  // On a new thread, which first runs `before` (a change of its own
  // credentials), then hands `text` to the relay; what the relay returned
  // and the errno it left.
  template <typename F>
  std::pair<ssize_t, int> RelayFromThread(F before, const std::string& text) {
    std::pair<ssize_t, int> out{0, 0};
    std::thread([&] {
      before();
      out.first = RelayRefusedWrite(fds_[1], text.data(), text.size());
      out.second = errno;
    }).join();
    return out;
  }

  int fds_[2] = {-1, -1};
  std::unique_ptr<WriteRelay> relay_;
};

TEST_F(WriteRelayTest, AnotherThreadWithTheSameIdentityWritesThroughIt) {
  // As CRIU's restore does to each thread: credentials set again to what
  // they were, which gives the thread a credential object of its own.
  const auto reset_capabilities = [] {
    __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2] = {};
    ASSERT_EQ(syscall(SYS_capget, &hdr, data), 0);
    ASSERT_EQ(syscall(SYS_capset, &hdr, data), 0);
  };
  const auto [n, err] = RelayFromThread(reset_capabilities, "doorbell");
  EXPECT_EQ(n, 8) << strerror(err);
  EXPECT_EQ(Drain(), "doorbell");
}

TEST_F(WriteRelayTest, AThreadThatChangedItsIdentityStaysRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "changing a thread's group needs root";
  // The raw call changes this thread's credentials only (glibc's setresgid
  // would change every thread's).
  const auto change_group = [] { ASSERT_EQ(syscall(SYS_setresgid, -1, 4242, -1), 0); };
  const auto [n, err] = RelayFromThread(change_group, "doorbell");
  EXPECT_EQ(n, -1);
  EXPECT_EQ(err, EACCES);
  EXPECT_EQ(Drain(), "");
}

TEST_F(WriteRelayTest, AnFdWithoutARelayIsRefusedAsTheKernelRefusedIt) {
  WithdrawRelay(relay_.get());
  errno = 0;
  EXPECT_EQ(RelayRefusedWrite(fds_[1], "x", 1), -1);
  EXPECT_EQ(errno, EACCES);
  EXPECT_EQ(Drain(), "");
  ASSERT_TRUE(PublishRelay(relay_.get()));
}

TEST_F(WriteRelayTest, ThePublishedTableHoldsAtMostItsSize) {
  std::vector<std::unique_ptr<WriteRelay>> more;
  int published = 1;  // the fixture's
  for (int i = 0; i < kMaxRelays + 2; ++i) {
    std::string why;
    more.push_back(WriteRelay::Create(fds_[1], &why));
    ASSERT_NE(more.back(), nullptr) << why;
    if (PublishRelay(more.back().get())) ++published;
  }
  EXPECT_EQ(published, kMaxRelays);
  for (auto& r : more) WithdrawRelay(r.get());
}

}  // namespace
}  // namespace rdmavirt::shim
