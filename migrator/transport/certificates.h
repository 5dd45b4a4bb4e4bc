// Who a certificate of the deployment lets act. A migrator's certificate is
// a host's (extendedKeyUsage serverAuth and clientAuth: it serves with it
// and dials other migrators); the CLI's is an operator's (clientAuth
// alone). The Transfer service admits hosts only and the Operator service
// operators only: an operator's key cannot push images or restore a
// process on a host, and a host's key cannot start moves on other hosts.
//
// Each party also checks its own certificate before it uses it, so that an
// expired one or one of another CA is named with what to do, instead of a
// TLS handshake that fails without saying why. Free functions, safe from
// any thread.
#ifndef RDMAVIRT_MIGRATOR_TRANSPORT_CERTIFICATES_H_
#define RDMAVIRT_MIGRATOR_TRANSPORT_CERTIFICATES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "migrator/transport/tls.h"

namespace rdmavirt::migrator {

enum class CertRole { kHost, kOperator };

// "host" or "operator".
const char* RoleName(CertRole role);

struct CertInfo {
  std::string subject;  // "CN=host1"
  CertRole role = CertRole::kOperator;
  absl::Time not_before;
  absl::Time not_after;
  std::string sha256;  // of the DER, lowercase hex (what `openssl x509 -fingerprint -sha256` shows)
};

// Parses the first certificate of `pem`. INVALID_ARGUMENT when it does not
// parse, or when its extendedKeyUsage makes it neither a host's nor an
// operator's (none at all, or no clientAuth).
absl::StatusOr<CertInfo> InspectCertificate(absl::string_view pem);

// Checks the certificate a party is about to present (files.cert, read
// from `cert_path`): it is `role`'s, its key is files.key, it is signed by
// a certificate of files.ca and valid at `now`. FAILED_PRECONDITION naming
// `cert_path`, what is wrong and how to make a good one.
absl::Status CheckOwnCertificate(const TlsFiles& files, absl::string_view cert_path, CertRole role,
                                 absl::Time now);

// The role of a caller authenticated by mutual TLS, from the certificate it
// presented. UNAUTHENTICATED when it presented none (a channel without
// TLS); INVALID_ARGUMENT as InspectCertificate.
absl::StatusOr<CertInfo> CallerCertificate(const grpc::ServerContext& context);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_TRANSPORT_CERTIFICATES_H_
