"""Who may make a migrator act, on real lab hosts.

A migrator acts for two kinds of caller: operators, through rdmavirtctl and
its client certificate (the Operator service), and other migrators, through
their host certificates (the Transfer service). Locally, processes under
the shim introduce themselves on the shim socket and are admitted by their
kernel credentials. These tests try each door with what must not open it:
a local user who is not root, certificates of another CA, an expired one,
a host's certificate where an operator's is needed, one without a role;
and check that nothing moved and the refusal said why.
"""

import json
import os
import shutil
import struct
import subprocess
import sys

from labtest import LAB, ROOT, check, lab_test, main, wait_until

import migrator_tests as migrators

CERTS = migrators.CERTS
CTL = migrators.CTL
DAEMON = migrators.DAEMON
UID = 4242  # no account: setpriv takes bare ids
AS_USER = f"setpriv --reuid {UID} --regid {UID} --clear-groups"


def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def field(num, wire, payload):
    if wire == 0:
        return varint(num << 3) + varint(payload)
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def hello_frame(pid, endpoint_id):
    """A shim's first message (control.proto: ShimToMigrator{hello}),
    framed as the shim frames it (4-byte little-endian length)."""
    hello = (field(1, 0, 1) + field(2, 0, pid) + field(3, 2, endpoint_id.encode()) +
             field(4, 0, 1) + field(5, 2, b"intruder"))
    msg = field(2, 2, hello)
    return struct.pack("<I", len(msg)) + msg


def moves_on(host):
    """The moves host`host`'s migrator has in flight and its newest ended
    one: unchanged when no move was started."""
    r = migrators.ctl(host, "--host 127.0.0.1 status --json")
    check(r.rc == 0, "status failed", r)
    s = json.loads(r.out)
    return ([m.get("migration_id") for m in s.get("in_flight", [])],
            [m.get("migration_id") for m in s.get("recent", [])[:1]])


def still_here(host, pid):
    r = LAB.run(host, f"grep -c librdmavirt /proc/{pid}/maps")
    check(r.rc == 0 and int(r.out.strip() or 0) > 0, f"process {pid} left host{host}", r)


def endpoint_of(host, pid):
    for e in migrators.ps(host):
        if e.get("pid") == pid:
            return e
    return None


@lab_test
def a_user_who_is_not_root_cannot_make_the_migrator_act():
    migrators.daemons_up()
    pid = migrators.idle_endpoint(1)
    try:
        endpoint = endpoint_of(1, pid)["endpoint_id"]
        before = moves_on(1)
        # The CLI: the operator's key is root's.
        r = LAB.run(1, f"{AS_USER} {CTL} --tls-dir {CERTS}/host1 --host 127.0.0.1 "
                       f"migrate {pid} --to 10.77.0.2")
        check(r.rc == 3, "the CLI of a user who is not root did not exit 3", r)
        check("cli.key: Permission denied" in r.err and "run as the user who owns them" in r.err,
              "the refusal does not say why", r)
        # A copy of the certificates elsewhere still needs the key.
        r = LAB.run(1, f"{AS_USER} cat {CERTS}/host1/cli.key")
        check(r.rc != 0, "a user who is not root read the operator's key", r)
        # The shim socket: a program of that user under the shim is not
        # admitted (only root's are, the migrator's own uid).
        user_prog = LAB.run(1, f"{AS_USER} setsid env {migrators.SHIM} ibv_rc_pingpong -d rxe0 "
                               f"-g 1 -p 18611 < /dev/null > /dev/null 2>&1 & echo $!")
        upid = int(user_prog.out.split()[-1])
        try:
            wait_until(1, f"grep -q 'refused pid {upid} uid {UID}' "
                          f"{migrators.LOGS}/host1.log", 60,
                       "the migrator refusing the user's program")
            check(endpoint_of(1, upid) is None, "the user's program was admitted")
            r = LAB.run(1, f"kill -0 {upid}")
            check(r.rc == 0, "the user's program did not keep running unmigratable", r)
        finally:
            LAB.run(1, f"kill -9 {upid}; true")
        # The shim socket, spoken to directly: a Hello for root's process
        # (its pid and endpoint id) from the user's own process.
        frame = hello_frame(pid, endpoint).hex()
        script = (f"import socket; s=socket.socket(socket.AF_UNIX); "
                  f"s.connect('{migrators.SOCK}'); s.sendall(bytes.fromhex('{frame}')); "
                  f"s.settimeout(20); d=s.recv(64); print('closed' if d==b'' else 'answered')")
        r = LAB.run(1, f"{AS_USER} python3 -c \"{script}\"")
        check(r.rc == 0 and r.out.strip() == "closed",
              "the migrator did not close a Hello that speaks for another's process", r)
        check(LAB.run(1, f"grep -q 'uid {UID}: its Hello speaks for pid {pid}' "
                         f"{migrators.LOGS}/host1.log").rc == 0,
              "the migrator did not log the impersonation")
        # Root's own endpoint is untouched: listed once, same id, still here.
        listed = [e for e in migrators.ps(1) if e.get("endpoint_id") == endpoint]
        check(len(listed) == 1 and listed[0]["pid"] == pid, "root's endpoint changed", listed)
        # The migrator's directories are not the user's to write.
        for d in ("/run/rdmavirt-lab", "/run/rdmavirt-lab/resume", migrators.STATE):
            r = LAB.run(1, f"{AS_USER} touch {d}/planted")
            check(r.rc != 0, f"a user who is not root could write to {d}", r)
        check(moves_on(1) == before, "a move was started")
        still_here(1, pid)
        check(LAB.run(2, f"test -e /proc/{pid}/maps && grep -q librdmavirt /proc/{pid}/maps"
                      ).rc != 0, "the process appeared on host2")
    finally:
        migrators.stop(1, pid)


def cert_dir(name, files):
    """CERTS/NAME holding `files` (dest: source, relative to CERTS)."""
    d = migrators.shared(f"{CERTS}/{name}")
    if os.path.isdir(d):
        return f"{CERTS}/{name}"
    os.makedirs(d + ".tmp", exist_ok=True)
    for dest, src in files.items():
        shutil.copy(migrators.shared(f"{CERTS}/{src}"), os.path.join(d + ".tmp", dest))
    os.rename(d + ".tmp", d)
    return f"{CERTS}/{name}"


def bad_certificates():
    """Directories of certificates that must be refused, signed by the lab's
    CA unless said otherwise."""
    all_dir = migrators.shared(f"{CERTS}/all")
    if not os.path.exists(os.path.join(all_dir, "expired.pem")):
        subprocess.run([os.path.join(ROOT, "tests/migrator/bad-certs.sh"), all_dir], check=True,
                       capture_output=True)
    return {
        "expired": cert_dir("expired", {"ca.pem": "all/ca.pem", "cli.pem": "all/expired.pem",
                                        "cli.key": "all/expired.key"}),
        "host": cert_dir("hostcert", {"ca.pem": "all/ca.pem", "cli.pem": "all/host3.pem",
                                      "cli.key": "all/host3.key"}),
        "noeku": cert_dir("noeku", {"ca.pem": "all/ca.pem", "cli.pem": "all/noeku.pem",
                                    "cli.key": "all/noeku.key"}),
        "foreign": f"{CERTS}/other",  # another CA's client; our CA
        "other-ca": cert_dir("other-ca-cli", {"ca.pem": "other-ca/ca.pem",
                                              "cli.pem": "other-ca/cli.pem",
                                              "cli.key": "other-ca/cli.key"}),
    }


@lab_test
def certificates_that_may_not_act_are_refused_with_clear_errors():
    migrators.daemons_up()
    dirs = bad_certificates()
    pid = migrators.idle_endpoint(1)
    try:
        before = moves_on(1)
        expect = {
            "expired": "cli.pem (CN=expired) expired on ",
            "host": "cli.pem (CN=host3) is a host's certificate; this needs the CLI's",
            "noeku": "CN=noeku has no extendedKeyUsage",
            "foreign": "is not signed by the CA in ca.pem",
            "other-ca": "it accepts connections, but the TLS handshake did not complete",
        }
        for name, text in expect.items():
            r = LAB.run(3, f"{CTL} --tls-dir {dirs[name]} --host 10.77.0.1:7700 "
                           f"migrate {pid} --to 10.77.0.2")
            check(r.rc == 3, f"the CLI with the {name} certificate did not exit 3", r)
            check(text in r.err, f"the refusal of the {name} certificate does not say why", r)
        # The migrator itself refuses them too, whatever the client checks:
        # its TLS handshake hangs up on the expired one and the other CA's,
        # and not on the CLI's own (the control). s_client ends as soon as
        # the migrator hangs up; the control's connection stays open for
        # the 10 s its input lasts (with 3 s, beside the other lab's tests,
        # the expired certificate's handshake was once taken for accepted).
        def handshake(d):
            r = LAB.run(3, f"(sleep 10) | timeout 30 openssl s_client -connect 10.77.0.1:7700 "
                           f"-alpn h2 -CAfile {CERTS}/host3/ca.pem -cert {d}/cli.pem "
                           f"-key {d}/cli.key 2>&1 | tr -cd '[:print:]\\n'; true")
            return "unexpected eof while reading" not in r.out, r
        for name in ("expired", "foreign"):
            accepted, r = handshake(dirs[name])
            check(not accepted, f"the migrator's handshake accepted the {name} certificate", r)
        accepted, r = handshake(f"{CERTS}/host3")
        check(accepted, "the migrator's handshake refused the CLI's own certificate", r)
        check(moves_on(1) == before, "a move was started")
        still_here(1, pid)
        # A migrator does not start with a certificate it may not serve with.
        refused_daemon = {
            "expired": (cert_dir("expired-host", {"ca.pem": "all/ca.pem",
                                                  "host.pem": "all/expiredhost.pem",
                                                  "host.key": "all/expiredhost.key"}),
                        "host.pem (CN=expiredhost) expired on "),
            "operator's": (cert_dir("cli-as-host", {"ca.pem": "all/ca.pem",
                                                     "host.pem": "all/cli.pem",
                                                     "host.key": "all/cli.key"}),
                           "host.pem (CN=cli) is an operator's certificate; this needs a "
                           "migrator's"),
        }
        for name, (tls, text) in refused_daemon.items():
            r = LAB.run(2, f"timeout 60 {DAEMON} --listen 127.0.0.1:7799 "
                           f"--socket /run/rdmavirt-lab/refused.sock --state-dir /tmp/refused "
                           f"--tls-dir {tls} --host-name host2 2>&1")
            check(r.rc == 1 and "cannot start" in r.out and text in r.out,
                  f"a migrator started with the {name} certificate, or did not say why", r)
    finally:
        migrators.stop(1, pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
