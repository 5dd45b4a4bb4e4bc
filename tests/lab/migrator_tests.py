"""rdmavirt-migratord and rdmavirtctl on real lab hosts.

Every host runs a migrator (certificates from tools/rdmavirt-certs, mutual
TLS on port 7700) with its shim socket at a path of its own, so that the
other test groups' programs do not find a migrator and stay unmigratable.
The daemons stay up for the whole lab; each test starts them if needed
(migration_tests.py uses the same ones). A live move under traffic is in
migration_tests.py.
"""

import json
import os
import shutil
import subprocess
import time

from labtest import (BUILD, LAB, ROOT, check, lab_test, main, run_all, run_ok, until_script,
                     wait_listening, wait_until)

DAEMON = f"{BUILD}/migrator/rdmavirt-migratord"
CTL = f"{BUILD}/tools/rdmavirtctl/rdmavirtctl"
PROBE = f"{BUILD}/migrator/rdmavirt-criu-probe"
INTEGRITY = f"{BUILD}/tests/apps/integrity"
SOCK = "/run/rdmavirt-lab/migratord.sock"
SHIM = f"RDMAVIRT_SOCKET={SOCK} LD_PRELOAD={BUILD}/shim/librdmavirt.so "
PORT = 7700
CERTS = "/lab/migrator-certs"  # in the hosts; LAB.shared/migrator-certs here
LOGS = "/lab/migrator-logs"
REPORTS = "/lab/migrator-reports"


def shared(path):
    return os.path.join(LAB.shared, path[len("/lab/"):])


def make_certs():
    """A CA, each host's host.pem/host.key and cli.pem/cli.key in
    CERTS/hostN; a second CA's client in CERTS/other (must be refused). A
    host the lab gained later (Lab.resize) gets its own from the same CA."""
    d = shared(CERTS)
    hosts = LAB.hosts()
    if all(os.path.exists(os.path.join(d, f"host{n}", "host.key")) for n in range(1, hosts + 1)):
        return
    tool = os.path.join(ROOT, "tools", "rdmavirt-certs")
    if not os.path.exists(os.path.join(d, "done")):
        shutil.rmtree(d, ignore_errors=True)
        subprocess.run([tool, "--dir", os.path.join(d, "other-ca"), "lab", "1"],
                       check=True, capture_output=True)
        subprocess.run([tool, "--dir", os.path.join(d, "all"), "lab", str(hosts)],
                       check=True, capture_output=True)
    for n in range(1, hosts + 1):
        h = os.path.join(d, f"host{n}")
        if os.path.exists(os.path.join(h, "host.key")):
            continue
        if not os.path.exists(os.path.join(d, "all", f"host{n}.key")):
            # A host added later: signed by the CA the others trust.
            subprocess.run([tool, "--dir", os.path.join(d, "all"), "host", f"host{n}",
                            "--ip", f"10.77.0.{n}", "--ip", f"10.78.0.{n}", "--ip", "127.0.0.1"],
                           check=True, capture_output=True)
        os.makedirs(h, exist_ok=True)
        for src, dst in (("ca.pem", "ca.pem"), (f"host{n}.pem", "host.pem"),
                         (f"host{n}.key", "host.key"), ("cli.pem", "cli.pem"),
                         ("cli.key", "cli.key")):
            shutil.copy(os.path.join(d, "all", src), os.path.join(h, dst))
    o = os.path.join(d, "other")
    if not os.path.exists(os.path.join(o, "cli.key")):
        os.makedirs(o, exist_ok=True)
        shutil.copy(os.path.join(d, "all", "ca.pem"), os.path.join(o, "ca.pem"))
        for f in ("cli.pem", "cli.key"):
            shutil.copy(os.path.join(d, "other-ca", f), os.path.join(o, f))
    open(os.path.join(d, "done"), "w").close()


STATE = "/var/lib/rdmavirt-lab"


def daemon_command(n, env="", state_dir=STATE):
    """The shell command that starts host n's migrator in the background."""
    return (f"mkdir -p {LOGS} && setsid env {env} {DAEMON} --listen 0.0.0.0:{PORT} "
            f"--socket {SOCK} --state-dir {state_dir} --tls-dir {CERTS}/host{n} "
            f"--host-name host{n} >> {LOGS}/host{n}.log 2>&1 < /dev/null &")


def start_daemon(n, env="", state_dir=STATE, wait=True):
    """Starts host n's migrator (`env`: VAR=value ... for it); with `wait`,
    returns once it listens."""
    run_ok(n, daemon_command(n, env, state_dir))
    if wait:
        wait_listening(n, PORT, 150)


def kill_daemon(n):
    """SIGKILL of host n's migrator, as a crash; returns once its port is free."""
    LAB.run(n, "pkill -9 -x rdmavirt-migrat; true")
    wait_until(n, f"! ss -Hltn 'sport = :{PORT}' | grep -q .", 30, "the migrator's port freed")


def daemons_up():
    """Every host's migrator listening: started where it is not, on all
    hosts at once."""
    make_certs()
    listening = f"ss -Hltn 'sport = :{PORT}' | grep -q ."
    results = run_all({n: f"{listening} && exit 0; {daemon_command(n)}\n"
                          f"{until_script(listening, 150)}"
                       for n in range(1, LAB.hosts() + 1)}, 170)
    for n, r in results.items():
        check(r.rc == 0, f"host{n}: the migrator does not listen on port {PORT}", r)


def ctl(host, args, timeout=300, tls=None):
    return LAB.run(host, f"{CTL} --tls-dir {tls or f'{CERTS}/host{host}'} {args}", timeout)


def start(host, cmd):
    """Starts `cmd` as a session leader (CRIU dumps such a process tree) with
    no terminal or socket; returns its pid."""
    r = run_ok(host, f"setsid {cmd} < /dev/null > /dev/null 2>&1 & echo $!")
    return int(r.out.split()[-1])


def stop(host, pid):
    LAB.run(host, f"kill -9 {pid} 2>/dev/null; true")


def ps(host):
    r = ctl(host, "--host 127.0.0.1 ps --json")
    check(r.rc == 0, "ps failed", r)
    return json.loads(r.out).get("endpoints", [])


def under_shim(host, pid, timeout=60):
    """Waits until the migrator of `host` lists `pid`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(e.get("pid") == pid for e in ps(host)):
            return
        time.sleep(1)
    check(False, f"host{host}: process {pid} never showed up under the shim")


def idle_endpoint(host):
    """A shimmed process holding an RDMA device and waiting (an
    ibv_rc_pingpong server waiting for its client)."""
    pid = start(host, f"env {SHIM} ibv_rc_pingpong -d rxe0 -g 1 -p 18600")
    under_shim(host, pid)
    return pid


@lab_test
def host_info_over_mutual_tls():
    daemons_up()
    r = ctl(1, "--host 10.77.0.2 host --json")
    check(r.rc == 0, "rdmavirtctl host failed", r)
    info = json.loads(r.out)
    check(info["hostname"] == "host2", "wrong host", r)
    check(info.get("criu_ok") is True, "CRIU not usable on host2", r)
    check(any(d["name"] == "rxe0" and any(p["state"] == "ACTIVE" for p in d["ports"])
              for d in info.get("devices", [])), "no ACTIVE rxe0 on host2", r)
    r = ctl(1, "--host 10.77.0.2 ps")
    check(r.rc == 0 and "PID" in r.out or "no process" in r.out, "ps failed", r)
    # A client certificate of another CA, or none, gets nowhere.
    r = ctl(1, "--host 10.77.0.2 host", tls=f"{CERTS}/other")
    check(r.rc == 3 and "is not signed by the CA in ca.pem" in r.err,
          "a foreign client was let in, or not told why", r)
    r = LAB.run(1, f"mkdir -p /tmp/nocert && cp {CERTS}/host1/ca.pem /tmp/nocert/ && "
                   f"{CTL} --tls-dir /tmp/nocert --host 10.77.0.2 host")
    check(r.rc == 3, "a client without a certificate was let in", r)
    r = ctl(1, "--host 10.77.0.9 host", timeout=60)
    check(r.rc == 3, "an unreachable host is not exit code 3", r)
    r = ctl(1, "migrate notapid --to 10.77.0.2")
    check(r.rc == 2 and "not a process id" in r.err, "bad PID accepted", r)
    r = ctl(1, "migrate 12 --to 'bad host'")
    check(r.rc == 2, "bad host accepted", r)


@lab_test
def migrate_a_process_not_under_the_shim():
    daemons_up()
    pid = start(1, "sleep 300")
    try:
        r = ctl(1, f"migrate {pid} --to 10.77.0.2")
        check(r.rc == 1, "migrate of a plain process did not exit 1", r)
        check(f"process {pid} is not under the rdmavirt shim" in r.err, "unclear error", r)
        r = ctl(1, "migrate 999999 --to 10.77.0.2")
        check(r.rc == 1 and "NOT_FOUND" in r.err, "a missing process is not NOT_FOUND", r)
    finally:
        stop(1, pid)


@lab_test
def migrate_to_an_unreachable_host_or_one_without_rdma_is_refused():
    daemons_up()
    pid = idle_endpoint(1)
    try:
        r = ctl(1, f"migrate {pid} --to 10.77.0.9")
        check(r.rc == 1, "migrate to an unreachable host did not exit 1", r)
        check("unreachable" in r.err and "nothing was quiesced" in r.err, "unclear error", r)
        e = next(e for e in ps(1) if e["pid"] == pid)
        check(not e.get("suspended") and e.get("phase") == "ENDPOINT_PHASE_RUNNING",
              "the endpoint was touched", e)
        run_ok(1, f"kill -0 {pid}")
        # The same endpoint, toward a host whose RDMA device is gone.
        run_ok(2, "rdma link delete rxe0")
        try:
            r = ctl(1, f"migrate {pid} --to 10.77.0.2")
            check(r.rc == 1 and "FAILED_PRECONDITION" in r.err and "no RDMA device" in r.err,
                  "a destination without RDMA was not refused", r)
            e = next(e for e in ps(1) if e["pid"] == pid)
            check(not e.get("suspended") and e.get("phase") == "ENDPOINT_PHASE_RUNNING",
                  "the endpoint was touched", e)
        finally:
            run_ok(2, "rdma link add rxe0 type rxe netdev eth0")
    finally:
        stop(1, pid)
    wait_until(2, "ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE", 30, "rxe0 back on host2")


@lab_test
def restore_of_a_corrupted_checkpoint_is_refused():
    daemons_up()
    d = "/var/tmp/corrupt-ckpt"
    # A real CRIU dump of a plain process, with its manifest, then damaged.
    pid = start(1, "sleep 600")
    try:
        run_ok(1, f"rm -rf {d} && {PROBE} --log-dir /tmp/criu-probe dump {pid} {d} && "
                  f"{PROBE} manifest {d} && {PROBE} verify {d}", 120)
    finally:
        stop(1, pid)
    run_ok(1, f"f=$(ls {d}/pages-*.img | head -1); "
              f"printf 'XXXX' | dd of=$f bs=1 seek=100 conv=notrunc 2>/dev/null")
    before = run_ok(1, "pgrep -c sleep || true").out.strip()
    r = ctl(1, f"restore --dir {d}")
    check(r.rc == 1 and "DATA_LOSS" in r.err, "a corrupted checkpoint was not refused", r)
    run_ok(1, f"f=$(ls {d}/pages-*.img | head -1); truncate -s 10 $f")
    r = ctl(1, f"restore --dir {d}")
    check(r.rc == 1 and "DATA_LOSS" in r.err, "a truncated checkpoint was not refused", r)
    r = ctl(1, f"restore --dir {d} --on 10.77.0.2")
    check(r.rc == 1 and "DATA_LOSS" in r.err, "a corrupted checkpoint was sent", r)
    after = run_ok(1, "pgrep -c sleep || true").out.strip()
    check(before == after, f"a process was created ({before} -> {after} sleeps)")


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv))
