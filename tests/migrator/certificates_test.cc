// Certificates' roles and the checks a party makes of its own certificate,
// on real certificates from tools/rdmavirt-certs and tests/migrator/bad-certs.sh.
#include "migrator/transport/certificates.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "migrator/transport/tls.h"
#include "tests/migrator/test_certs.h"

namespace rdmavirt::migrator {
namespace {

using ::testing::HasSubstr;

class CertificatesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeTestCerts("certificates-a"));
    other_ = new std::string(testing::MakeTestCerts("certificates-b"));
  }
  static void TearDownTestSuite() {
    testing::RemoveTestCerts(*dir_);
    testing::RemoveTestCerts(*other_);
    delete dir_;
    delete other_;
  }
  static TlsFiles Files(const std::string& dir, const std::string& name) {
    absl::StatusOr<TlsFiles> f = LoadTls(dir, name + ".pem", name + ".key");
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? *f : TlsFiles();
  }
  static std::string* dir_;
  static std::string* other_;
};
std::string* CertificatesTest::dir_;
std::string* CertificatesTest::other_;

TEST_F(CertificatesTest, HostsAndOperatorsAreToldApartByExtendedKeyUsage) {
  absl::StatusOr<CertInfo> host = InspectCertificate(Files(*dir_, "host1").cert);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->role, CertRole::kHost);
  EXPECT_EQ(host->subject, "CN=host1");
  absl::StatusOr<CertInfo> cli = InspectCertificate(Files(*dir_, "cli").cert);
  ASSERT_TRUE(cli.ok()) << cli.status();
  EXPECT_EQ(cli->role, CertRole::kOperator);
  EXPECT_LT(cli->not_before, absl::Now());
  EXPECT_GT(cli->not_after, absl::Now() + absl::Hours(24 * 800));
}

TEST_F(CertificatesTest, ACertificateWithoutExtendedKeyUsageHasNoRole) {
  absl::StatusOr<CertInfo> c = InspectCertificate(Files(*dir_, "noeku").cert);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("CN=noeku has no extendedKeyUsage"));
}

TEST_F(CertificatesTest, WhatIsNotACertificateIsRefused) {
  EXPECT_EQ(InspectCertificate("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InspectCertificate("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InspectCertificate(Files(*dir_, "cli").key).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CertificatesTest, GoodCertificatesPassTheirOwnersCheck) {
  EXPECT_TRUE(
      CheckOwnCertificate(Files(*dir_, "host1"), "host1.pem", CertRole::kHost, absl::Now()).ok());
  EXPECT_TRUE(
      CheckOwnCertificate(Files(*dir_, "cli"), "cli.pem", CertRole::kOperator, absl::Now()).ok());
}

TEST_F(CertificatesTest, AHostCertificateIsNoOperatorsAndTheOtherWayRound) {
  absl::Status s =
      CheckOwnCertificate(Files(*dir_, "host1"), "d/cli.pem", CertRole::kOperator, absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("d/cli.pem (CN=host1) is a host's certificate"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("rdmavirt-certs client NAME"));
  s = CheckOwnCertificate(Files(*dir_, "cli"), "d/host.pem", CertRole::kHost, absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("(CN=cli) is an operator's certificate"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("rdmavirt-certs host NAME"));
}

TEST_F(CertificatesTest, AnExpiredCertificateSaysWhenItExpired) {
  TlsFiles f = Files(*dir_, "expired");
  absl::Status s = CheckOwnCertificate(f, "d/cli.pem", CertRole::kOperator, absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  const std::string yesterday =
      absl::FormatTime("%Y-%m-%d", absl::Now() - absl::Hours(24), absl::UTCTimeZone());
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("(CN=expired) expired on ", yesterday)));
}

TEST_F(CertificatesTest, CertificatesNotYetValidBlameTheClock) {
  // Two days ago neither the CA nor its certificates had been made.
  absl::Status s = CheckOwnCertificate(Files(*dir_, "cli"), "d/cli.pem", CertRole::kOperator,
                                       absl::Now() - absl::Hours(24 * 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not valid"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("is this host's clock right?"));
}

TEST_F(CertificatesTest, ACertificateOfAnotherCaIsNamedSo) {
  TlsFiles f = Files(*other_, "cli");
  f.ca = Files(*dir_, "cli").ca;
  absl::Status s = CheckOwnCertificate(f, "d/cli.pem", CertRole::kOperator, absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("is not signed by the CA in ca.pem"));
}

TEST_F(CertificatesTest, AKeyOfAnotherCertificateIsRefused) {
  TlsFiles f = Files(*dir_, "cli");
  f.key = Files(*dir_, "host1").key;
  absl::Status s = CheckOwnCertificate(f, "d/cli.pem", CertRole::kOperator, absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not belong to the key beside it"));
}

}  // namespace
}  // namespace rdmavirt::migrator
