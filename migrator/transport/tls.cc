#include "migrator/transport/tls.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace rdmavirt::migrator {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path) {
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    const int err = errno;
    if (err == ENOENT || err == 0)
      return absl::FailedPreconditionError(absl::StrCat("cannot read ", path,
                                                        ": no such file (make certificates with "
                                                        "tools/rdmavirt-certs)"));
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot read ", path, ": ", strerror(err),
        err == EACCES ? " (keys are readable by their owner only: run as the user who owns "
                        "them, root for a host's)"
                      : ""));
  }
  std::stringstream s;
  s << in.rdbuf();
  if (!absl::StrContains(s.str(), "-----BEGIN "))
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a PEM file"));
  return s.str();
}

}  // namespace

absl::StatusOr<TlsFiles> LoadTls(const std::string& dir, const std::string& cert,
                                 const std::string& key) {
  TlsFiles f;
  absl::StatusOr<std::string> s = ReadPem(dir + "/ca.pem");
  if (!s.ok()) return s.status();
  f.ca = *std::move(s);
  s = ReadPem(dir + "/" + cert);
  if (!s.ok()) return s.status();
  f.cert = *std::move(s);
  s = ReadPem(dir + "/" + key);
  if (!s.ok()) return s.status();
  f.key = *std::move(s);
  return f;
}

std::shared_ptr<grpc::ServerCredentials> MutualTlsServerCredentials(const TlsFiles& files) {
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = files.ca;
  o.pem_key_cert_pairs.push_back({files.key, files.cert});
  return grpc::SslServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> MutualTlsChannelCredentials(const TlsFiles& files) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = files.ca;
  o.pem_private_key = files.key;
  o.pem_cert_chain = files.cert;
  return grpc::SslCredentials(o);
}

}  // namespace rdmavirt::migrator
