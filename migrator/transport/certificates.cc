#include "migrator/transport/certificates.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <ctime>
#include <memory>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/auth_context.h"

namespace rdmavirt::migrator {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Store = std::unique_ptr<X509_STORE, StoreFree>;
using StoreCtx = std::unique_ptr<X509_STORE_CTX, StoreCtxFree>;

Bio ReadOnly(absl::string_view text) {
  return Bio(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// The reason of OpenSSL's last failure; the error queue is left empty.
std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no PEM certificate found";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

absl::Time TimeOf(const ASN1_TIME* t) {
  struct tm tm = {};
  if (t == nullptr || ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTM(tm, absl::UTCTimeZone());
}

std::string Day(absl::Time t) {
  return absl::FormatTime("%Y-%m-%d %H:%M UTC", t, absl::UTCTimeZone());
}

std::string NameText(const X509_NAME* name) {
  Bio out(BIO_new(BIO_s_mem()));
  if (out == nullptr || X509_NAME_print_ex(out.get(), name, 0, XN_FLAG_RFC2253) < 0) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(out.get(), &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string("(empty subject)");
}

const char* HowToMake(CertRole role) {
  return role == CertRole::kHost
             ? "a migrator's: extendedKeyUsage serverAuth and clientAuth, made by "
               "`rdmavirt-certs host NAME`"
             : "the CLI's: extendedKeyUsage clientAuth only, made by `rdmavirt-certs client NAME`";
}

// Every certificate in `pem`, in a store to verify against.
absl::StatusOr<Store> CaStore(absl::string_view pem) {
  Store store(X509_STORE_new());
  if (store == nullptr) return absl::ResourceExhaustedError("X509_STORE_new");
  Bio in = ReadOnly(pem);
  int n = 0;
  while (Cert ca{PEM_read_bio_X509(in.get(), nullptr, nullptr, nullptr)}) {
    if (X509_STORE_add_cert(store.get(), ca.get()) != 1) break;
    ++n;
  }
  ERR_clear_error();  // the end of the file reads as an error
  if (n == 0) return absl::InvalidArgumentError("ca.pem holds no certificate");
  return store;
}

// Whether `cert` chains to a certificate of `ca` and is valid at `now`;
// the error says which.
absl::Status Verify(X509* cert, absl::string_view ca, absl::Time now, const CertInfo& info) {
  absl::StatusOr<Store> store = CaStore(ca);
  if (!store.ok()) return store.status();
  StoreCtx ctx(X509_STORE_CTX_new());
  if (ctx == nullptr || X509_STORE_CTX_init(ctx.get(), store->get(), cert, nullptr) != 1)
    return absl::ResourceExhaustedError("X509_STORE_CTX_init");
  X509_VERIFY_PARAM_set_time(X509_STORE_CTX_get0_param(ctx.get()), absl::ToTimeT(now));
  if (X509_verify_cert(ctx.get()) == 1) return absl::OkStatus();
  const int err = X509_STORE_CTX_get_error(ctx.get());
  const int depth = X509_STORE_CTX_get_error_depth(ctx.get());
  ERR_clear_error();
  switch (err) {
    case X509_V_ERR_CERT_HAS_EXPIRED:
      if (depth == 0)
        return absl::InvalidArgumentError(absl::StrCat("expired on ", Day(info.not_after)));
      return absl::InvalidArgumentError("is signed by a CA certificate (ca.pem) that expired");
    case X509_V_ERR_CERT_NOT_YET_VALID:
      if (depth == 0)
        return absl::InvalidArgumentError(absl::StrCat("is not valid before ", Day(info.not_before),
                                                       " (is this host's clock right?)"));
      return absl::InvalidArgumentError(
          "is signed by a CA certificate (ca.pem) that is not valid yet (is this host's clock "
          "right?)");
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT:
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
    case X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE:
    case X509_V_ERR_CERT_SIGNATURE_FAILURE:
    case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
      return absl::InvalidArgumentError(absl::StrCat(
          "is not signed by the CA in ca.pem (its issuer: ", NameText(X509_get_issuer_name(cert)),
          ")"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("does not verify against ca.pem: ", X509_verify_cert_error_string(err)));
  }
}

}  // namespace

const char* RoleName(CertRole role) { return role == CertRole::kHost ? "host" : "operator"; }

absl::StatusOr<CertInfo> InspectCertificate(absl::string_view pem) {
  Bio in = ReadOnly(pem);
  Cert cert(PEM_read_bio_X509(in.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("not a PEM certificate: ", OpenSslError()));
  CertInfo info;
  info.subject = NameText(X509_get_subject_name(cert.get()));
  info.not_before = TimeOf(X509_get0_notBefore(cert.get()));
  info.not_after = TimeOf(X509_get0_notAfter(cert.get()));
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int md_len = 0;
  if (X509_digest(cert.get(), EVP_sha256(), md, &md_len) == 1)
    info.sha256 =
        absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(md), md_len));
  const uint32_t flags = X509_get_extension_flags(cert.get());
  if ((flags & EXFLAG_INVALID) != 0)
    return absl::InvalidArgumentError(absl::StrCat(info.subject, ": malformed extensions"));
  if ((flags & EXFLAG_XKUSAGE) == 0)
    return absl::InvalidArgumentError(absl::StrCat(
        info.subject, " has no extendedKeyUsage, so it is neither a host's nor an operator's"));
  const uint32_t eku = X509_get_extended_key_usage(cert.get());
  if ((eku & XKU_SSL_CLIENT) == 0)
    return absl::InvalidArgumentError(
        absl::StrCat(info.subject, " may not be used by a client (no clientAuth)"));
  info.role = (eku & XKU_SSL_SERVER) != 0 ? CertRole::kHost : CertRole::kOperator;
  return info;
}

absl::Status CheckOwnCertificate(const TlsFiles& files, absl::string_view cert_path, CertRole role,
                                 absl::Time now) {
  auto refuse = [&](absl::string_view why) {
    return absl::FailedPreconditionError(absl::StrCat(cert_path, " ", why));
  };
  absl::StatusOr<CertInfo> info = InspectCertificate(files.cert);
  if (!info.ok()) return refuse(absl::StrCat("cannot be used: ", info.status().message()));
  if (info->role != role)
    return refuse(absl::StrCat("(", info->subject, ") is ",
                               info->role == CertRole::kHost ? "a host's" : "an operator's",
                               " certificate; this needs ", HowToMake(role)));
  Bio in = ReadOnly(files.key);
  Key key(PEM_read_bio_PrivateKey(in.get(), nullptr, nullptr, nullptr));
  if (key == nullptr)
    return refuse(absl::StrCat("has a key that does not parse: ", OpenSslError()));
  Bio cert_in = ReadOnly(files.cert);
  Cert cert(PEM_read_bio_X509(cert_in.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr || X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return refuse("does not belong to the key beside it");
  }
  absl::Status chain = Verify(cert.get(), files.ca, now, *info);
  if (!chain.ok())
    return refuse(absl::StrCat("(", info->subject, ") ", chain.message(), "; this needs ",
                               HowToMake(role), " with the deployment's CA"));
  return absl::OkStatus();
}

absl::StatusOr<CertInfo> CallerCertificate(const grpc::ServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return absl::UnauthenticatedError("the caller presented no certificate");
  const std::vector<grpc::string_ref> pem = auth->FindPropertyValues("x509_pem_cert");
  if (pem.empty()) return absl::UnauthenticatedError("the caller presented no certificate");
  return InspectCertificate(absl::string_view(pem[0].data(), pem[0].size()));
}

}  // namespace rdmavirt::migrator
