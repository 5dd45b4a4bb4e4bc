#!/usr/bin/env bash
# bad-certs.sh DIR: certificates that must be refused, signed by the CA in
# DIR (made by `tools/rdmavirt-certs --dir DIR ...`), for the tests of who
# may act:
#   DIR/expired.pem, .key   an operator's (clientAuth), expired yesterday
#   DIR/expiredhost.pem, .key  a host's (serverAuth, clientAuth), expired
#   DIR/noeku.pem, .key     no extendedKeyUsage at all
# (rdmavirt-certs refuses to make either: it verifies what it signs.)
set -euo pipefail
dir=$1
[[ -f $dir/ca.pem && -f $dir/ca.key ]] || { echo "bad-certs.sh: no CA in $dir" >&2; exit 1; }

sign() { # sign NAME DAYS EXTENSIONS
  local name=$1 days=$2 ext=$3
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/$name.key" 2> /dev/null
  chmod 600 "$dir/$name.key"
  openssl req -new -key "$dir/$name.key" -subj "/CN=$name" -out "$dir/$name.csr" 2> /dev/null
  printf '%s\n' "$ext" > "$dir/$name.ext"
  # -days -1: not after = yesterday (OpenSSL takes no earlier start date).
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
    -extfile "$dir/$name.ext" -out "$dir/$name.pem" 2> /dev/null
  rm -f "$dir/$name.csr" "$dir/$name.ext"
}

sign expired -1 "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
sign expiredhost -1 "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth"
sign noeku 30 "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature"
