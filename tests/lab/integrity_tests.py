"""Integrity of RDMA traffic between two lab hosts.

tests/apps/integrity checks every byte of the SENDs, RDMA WRITEs, RDMA READs
and UD datagrams it exchanges in both directions and counts what is lost,
duplicated, corrupted or out of order. These tests run it natively, under
the shim, across a pause, and once with corruption injected, to show that
its checks can fail.
"""

import json
import os
import sys

from labtest import (BUILD, LAB, check, lab_test, main, run_ok, wait_listening,
                     wait_until)

PROG = f"{BUILD}/tests/apps/integrity"
SHIM = f"RDMAVIRT_ID_MODE=offset LD_PRELOAD={BUILD}/shim/librdmavirt.so "
PORT = 18800
REPORTS = "/lab/integrity-reports"  # in the hosts; under LAB.shared here
# The newest count of completed SENDs in the live line of the integrity
# process on a host.
SENT = ("$(grep -o 'sent=[0-9]*' /proc/$(pgrep -x integrity)/fd/1 2>/dev/null"
        " | tail -1 | cut -d= -f2)")


class Side:
    def __init__(self, result, report):
        self.result, self.report = result, report

    def __repr__(self):
        return f"{self.result!r}\n  report={self.report!r}"


def run_pair(name, server_args="", client_args="", env="", during=None, timeout=300):
    """Runs the server on host1 and the client on host2; calls during() once
    the client has completed 200 SENDs. Returns (server, client) Sides."""
    run_ok(1, f"mkdir -p {REPORTS} && rm -f {REPORTS}/{name}-*.json")
    cmd = f"{env}{PROG} --port {PORT} --report {REPORTS}/{name}-"
    server = LAB.submit(1, f"{cmd}server.json --server {server_args}", timeout)
    client = None
    try:
        wait_listening(1, PORT)
        client = LAB.submit(2, f"{cmd}client.json --connect host1 {client_args}", timeout)
        if during is not None:
            wait_until(2, f"[ \"{SENT}\" -ge 200 ] 2>/dev/null", 120, "the client's progress")
            during()
        c = LAB.wait(2, client, timeout + 15)
        s = LAB.wait(1, server, timeout + 15)
    except BaseException:
        LAB.kill(1, server)
        if client is not None:
            LAB.kill(2, client)
        raise
    return Side(s, load_report(f"{name}-server")), Side(c, load_report(f"{name}-client"))


def load_report(name):
    try:
        with open(os.path.join(LAB.shared, "integrity-reports", name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check_clean(server, client, iterations):
    """Both sides ok, and every kind of traffic counted in full each way."""
    for side in (server, client):
        r = side.report
        check(side.result.rc == 0 and r is not None and r["ok"], "integrity failed",
              server, client)
        for key in ("sends", "recvs", "writes_verified", "reads_verified", "ud_sent",
                    "ud_received"):
            check(r[key] == iterations, f"{r['role']}: {key} is {r[key]}", side)
        for key in ("lost", "duplicated", "corrupted", "out_of_order", "completion_errors",
                    "peer_errors"):
            check(r[key] == 0, f"{r['role']}: {key} is {r[key]}", side)


@lab_test
def natively_between_hosts():
    def no_sockets():
        # CRIU must find no socket to restore: the TCP exchange is over and
        # closed once RDMA traffic flows.
        for host in (1, 2):
            r = run_ok(host, "ls -l /proc/$(pgrep -x integrity)/fd")
            check("uverbs" in r.out and "socket:" not in r.out,
                  f"host{host}: integrity holds a socket while running", r)

    # Long enough (16 s at 50/s, looked at after 4 s) that both sides still
    # run when looked at, however slow the lab's job spool is.
    server, client = run_pair("native", "--iterations 800", "--iterations 800",
                              during=no_sockets)
    check_clean(server, client, 800)


@lab_test
def under_the_shim_offset_mode():
    def shim_loaded():
        for host in (1, 2):
            run_ok(host, "grep -q librdmavirt.so /proc/$(pgrep -x integrity)/maps")

    server, client = run_pair("shim", "--iterations 800", "--iterations 800", env=SHIM,
                              during=shim_loaded)
    check_clean(server, client, 800)


@lab_test
def survives_a_pause():
    # The client is frozen mid-run for 10 s; the server keeps going until
    # its windows fill, then waits. Nothing may be lost or repeated.
    def pause_client():
        r = run_ok(2, "p=$(pgrep -x integrity); kill -STOP $p; sleep 1; "
                      "grep State /proc/$p/status; sleep 9; kill -CONT $p", 60)
        check("stopped" in r.out, "the client was not stopped", r)

    server, client = run_pair("pause", during=pause_client)
    check_clean(server, client, 1000)
    check(server.report["elapsed_s"] >= 10, "the pause did not fall within the run", server)


@lab_test
def stops_early_once_its_until_file_appears():
    # Sized for half an hour; the client is told to stop once it has sent
    # 200 SENDs, and the server learns of it from the client's record only.
    # Both end within minutes, every message sent until then counted.
    stop = f"{REPORTS}/until-stop"
    run_ok(1, f"mkdir -p {REPORTS} && rm -f {stop}")
    server, client = run_pair("until", "--iterations 90000 --canvas 1",
                              f"--iterations 90000 --canvas 1 --until-file {stop}",
                              during=lambda: run_ok(2, f"touch {stop}"))
    for side, peer in ((server, client), (client, server)):
        r = side.report
        check(side.result.rc == 0 and r is not None and r["ok"], "integrity failed",
              server, client)
        check(r["stopped_early"] and 200 <= r["iterations"] < 90000,
              f"{r['role']} did not stop early", side)
        check(r["peer_iterations"] == peer.report["iterations"],
              f"{r['role']} expected another count than its peer sent", server, client)
        for key in ("sends", "writes", "reads", "reads_verified", "ud_sent"):
            check(r[key] == r["iterations"], f"{r['role']}: {key} is {r[key]}", side)
        for key in ("recvs", "writes_verified", "ud_received"):
            check(r[key] == r["peer_iterations"], f"{r['role']}: {key} is {r[key]}", side)
        check(r["canvas_bytes_verified"] > 0 and r["canvas_peer_writes"] ==
              peer.report["canvas_writes"], f"{r['role']}: canvas", side)
        check(not r["ud_missing"], f"{r['role']}: datagrams past the peer's end are missing",
              side)
        for key in ("lost", "duplicated", "corrupted", "out_of_order", "completion_errors",
                    "peer_errors"):
            check(r[key] == 0, f"{r['role']}: {key} is {r[key]}", side)
    check(client.report["elapsed_s"] < 300, "the run did not end early", client)


@lab_test
def detects_injected_corruption():
    # The client flips one byte of its SEND, ring slot, datagram and canvas
    # cell of seq 100, and one byte of the region the server reads: the
    # server must see each, and both sides must fail.
    server, client = run_pair("corrupt", "--iterations 400 --canvas 1",
                              "--iterations 400 --canvas 1 --inject-corruption 100")
    s, c = server.report, client.report
    check(s is not None and c is not None, "a report is missing", server, client)
    check(server.result.rc != 0 and client.result.rc != 0, "a side exited 0", server, client)
    check(not s["ok"] and not c["ok"], "a report says ok", server, client)
    kinds = s["kinds"]
    check(kinds["send"]["corrupted"] == 1 and kinds["write"]["corrupted"] == 1
          and kinds["ud"]["corrupted"] == 1 and kinds["read"]["corrupted"] >= 1
          and kinds["canvas"]["corrupted"] == 1, "the server did not see each corruption", server)
    check(s["corrupted"] > 0 and s["lost"] == 0 and s["duplicated"] == 0,
          "unexpected counts", server)
    # The canvas is checked after the run: the client cannot learn of it.
    check(c["corrupted"] == 0 and c["peer_errors"] == s["corrupted"] - 1,
          "the client did not learn of the server's errors", client)
    check("canvas region 1 (huge pages), page" in server.result.err or
          "canvas region 0 (4 KiB pages), page" in server.result.err,
          "no description of the canvas corruption on stderr", server)
    check("byte" in server.result.err and "differs from the pattern" in server.result.err,
          "no description of the corruption on stderr", server)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
