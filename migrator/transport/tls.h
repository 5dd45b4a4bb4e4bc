// Mutual TLS between migrators, and between the CLI and a migrator: every
// party presents a certificate signed by the deployment's CA
// (tools/rdmavirt-certs makes them) and checks the other's. Free functions.
#ifndef RDMAVIRT_MIGRATOR_TRANSPORT_TLS_H_
#define RDMAVIRT_MIGRATOR_TRANSPORT_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace rdmavirt::migrator {

// PEM contents.
struct TlsFiles {
  std::string ca;
  std::string cert;
  std::string key;
};

// Reads DIR/ca.pem, DIR/CERT and DIR/KEY. FAILED_PRECONDITION naming the
// file that is missing, unreadable or not PEM.
absl::StatusOr<TlsFiles> LoadTls(const std::string& dir, const std::string& cert,
                                 const std::string& key);

// A server that requires a client certificate signed by the CA.
std::shared_ptr<grpc::ServerCredentials> MutualTlsServerCredentials(const TlsFiles& files);

// A client that presents its certificate and checks the server's.
std::shared_ptr<grpc::ChannelCredentials> MutualTlsChannelCredentials(const TlsFiles& files);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_TRANSPORT_TLS_H_
