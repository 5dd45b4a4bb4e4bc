"""Transparency of the shim: unmodified verbs programs between two lab
hosts behave the same natively and with librdmavirt.so preloaded, in
offset mode (virtual identities differ from physical ones from the start,
so every translation is exercised)."""

import json
import re
import sys

from labtest import (BUILD, LAB, ROOT, Failure, check, lab_test, main, server_client,
                     wait_listening, wait_until)

SHIM = f"LD_PRELOAD={BUILD}/shim/librdmavirt.so RDMAVIRT_ID_MODE=offset "
# Default mode: identities equal the hardware's until a move, so the shim's
# untranslated fast path runs.
SHIM_DEFAULT = f"LD_PRELOAD={BUILD}/shim/librdmavirt.so "
COVERAGE = f"{BUILD}/tests/apps/verbs_coverage"


def both(server_cmd, client_cmd, port, shim_env=SHIM, **kw):
    """Runs a server/client pair natively, then under the shim."""
    native = server_client(server_cmd, client_cmd, port, **kw)
    shim = server_client(shim_env + server_cmd, shim_env + client_cmd, port, **kw)
    for name, (s, c) in (("native", native), ("shim", shim)):
        check(s.rc == 0 and c.rc == 0, f"{name} run failed", s, c)
    return native, shim


def qpns(text):
    return re.findall(r"QPN (0x[0-9a-f]+)", text)


def pingpong_test(prog, iters=100):
    def test():
        cmd = f"{prog} -d rxe0 -g 1 -n {iters}"
        (ns, nc), (ss, sc) = both(cmd, cmd + " host1", 18515)
        for out in (nc.out, sc.out):
            check(f"{iters} iters in" in out, "iterations not reported", nc, sc)
        # The shim showed virtual QPNs (with the offset marker), natively not.
        check(all(int(q, 16) & 0x800000 for q in qpns(sc.out)) and qpns(sc.out),
              "shim run did not show virtual QPNs", sc)
        check(not any(int(q, 16) & 0x800000 for q in qpns(nc.out)),
              "native run shows marked QPNs", nc)
        check(sc.err == nc.err, "stderr differs with the shim", nc, sc)
    test.__name__ = prog.replace("ibv_", "")
    lab_test(test)


for p in ("ibv_rc_pingpong", "ibv_uc_pingpong", "ibv_ud_pingpong", "ibv_srq_pingpong"):
    pingpong_test(p)


def perftest_test(prog, iters):
    # Under the shim only: perftest's output is timing, nothing to compare
    # with a native run (smoke_tests runs perftest natively).
    def test():
        cmd = f"{prog} -d rxe0 -x 1 -F -n {iters}"
        s, c = server_client(SHIM + cmd, SHIM + cmd + " host1", 18515)
        check(s.rc == 0 and c.rc == 0, "shim run failed", s, c)
        check(re.search(r"^\s*\d+\s+" + str(iters) + r"\s", c.out, re.M),
              "no result line", c)
        check("0x80" in c.out, "shim run did not show virtual QPNs", c)
    test.__name__ = re.sub(r"\W+", "_", prog.replace(" -", " ")).strip("_")
    lab_test(test)


# Each program, then UD and completion events (ib_send_bw -e waits on a
# completion channel).
for p, n in (("ib_send_bw", 200), ("ib_write_bw", 200), ("ib_read_bw", 200),
             ("ib_atomic_bw", 200), ("ib_send_lat", 100), ("ib_write_lat", 100),
             ("ib_read_lat", 100), ("ib_atomic_lat", 100), ("ib_send_lat -c UD", 100),
             ("ib_send_bw -e", 200)):
    perftest_test(p, n)


def cm_pair(server_cmd, client_cmd, ready="rdma res show cm_id | grep -q LISTEN",
            what="a CM listener"):
    """librdmacm programs listen on no TCP port: the client starts once
    `ready` (a command on host1) succeeds, by default once the server's CM
    listener is there."""
    job = LAB.submit(1, server_cmd, 90)
    try:
        wait_until(1, ready, 30, what)
        c = LAB.run(2, client_cmd, 90)
    except BaseException:
        LAB.kill(1, job)
        raise
    return LAB.wait(1, job, 105), c


def cm_test(name, server_cmd, client_cmd, same_output):
    def test():
        ns, nc = cm_pair(server_cmd, client_cmd)
        ss, sc = cm_pair(SHIM + server_cmd, SHIM + client_cmd)
        for r in (ns, nc, ss, sc):
            check(r.rc == 0, f"{name} failed", ns, nc, ss, sc)
        if same_output:
            check(ns.out == ss.out and nc.out == sc.out, "output differs with the shim",
                  ns, ss, nc, sc)
        # Their stderr races with teardown (rping may or may not print its
        # DISCONNECT event), so only require that the shim added nothing.
        check("rdmavirt" not in ss.err + sc.err, "the shim wrote to stderr", ss, sc)
    test.__name__ = name
    lab_test(test)


cm_test("rping", "rping -s -a 10.77.0.1 -C 20 -v", "rping -c -a 10.77.0.1 -C 20 -v", True)
cm_test("udaddy", "udaddy -b 10.77.0.1", "udaddy -s 10.77.0.1 -b 10.77.0.2", True)
cm_test("rdma_server_client", "rdma_server", "rdma_client -s 10.77.0.1", True)
# Four RC connections at once, and rsockets' I/O stream.
cm_test("ucmatose_four_connections", "ucmatose -c 4 -C 20", "ucmatose -s 10.77.0.1 -c 4 -C 20",
        True)
cm_test("riostream", "riostream -S 4096 -C 100", "riostream -S 4096 -C 100 -s 10.77.0.1", False)


@lab_test
def rsockets_rstream():
    # librdmacm's rsockets: sockets over verbs, inside librdmacm (the
    # export table passes it through: it reaches verbs only through the
    # names the shim defines).
    cmd = "rstream -T v -S 4096 -C 200"
    for env in ("", SHIM_DEFAULT, SHIM):
        s, c = cm_pair(env + cmd, env + cmd + " -s 10.77.0.1")
        for r in (s, c):
            check(r.rc == 0 and re.search(r"^custom\s+4k\s+200\s", r.out, re.M),
                  f"rstream failed ({env.strip() or 'native'})", s, c)
        check("rdmavirt" not in s.err + c.err, "the shim wrote to stderr", s, c)


@lab_test
def dlopen_dlvsym_reaches_the_shim():
    # NCCL's way of loading libibverbs: handle lookups must land in the shim.
    prog = f"{BUILD}/tests/apps/dlopen_verbs"
    native = LAB.run(1, prog)
    shim = LAB.run(1, SHIM + prog)
    check(native.rc == 0 and shim.rc == 0, "dlopen_verbs failed", native, shim)
    check("gid[1] ::ffff:10.77.0.1" in native.out, "native GID unexpected", native)
    check("gid[1] ::ffff:10.77.128.1" in shim.out, "the shim's virtual GID not seen", shim)
    for r in (native, shim):
        check("rtld_next agrees with rtld_default: yes" in r.out, "RTLD_NEXT broken", r)


@lab_test
def registered_pages_are_marked_soft_dirty_at_a_release():
    # The unit tests of DirtyPages (all pages, and all but those the
    # destination holds unchanged), on the lab's kernel: the machine's own
    # may not track soft-dirty bits (the tests then skip themselves).
    r = LAB.run(1, f"{BUILD}/tests/shim_test --gtest_filter='DirtyPagesTest.*'")
    check(r.rc == 0, "DirtyPagesTest failed on a lab host", r)
    check("[  PASSED  ] 2 tests" in r.out and "SKIPPED" not in r.out,
          "DirtyPagesTest did not run on a lab host", r)


@lab_test
def verbs_coverage_identical():
    # Every opcode, inline and immediate data, SRQ, UD with GRH, completion
    # channels, ibv_wr_*, and the error completions of bad lkeys and rkeys:
    # the transcripts must be byte-for-byte the same.
    (ns, nc), (ss, sc) = both(COVERAGE, COVERAGE + " host1", 18700, timeout=240)
    check(ns.out == ss.out, "server transcript differs with the shim", ns, ss)
    check(nc.out == sc.out, "client transcript differs with the shim", nc, sc)
    check("checks passed" in ss.out and "checks passed" in sc.out, "no verdict", ss, sc)
    check(ss.err == "" and sc.err == "", "the shim wrote to stderr", ss, sc)


@lab_test
def verbs_coverage_identical_default_mode():
    # The same, through the shim's fast path (nothing translated until a move).
    (ns, nc), (ss, sc) = both(COVERAGE, COVERAGE + " host1", 18700, shim_env=SHIM_DEFAULT,
                              timeout=240)
    check(ns.out == ss.out and nc.out == sc.out, "transcript differs with the shim", ns, ss,
          nc, sc)
    check(ss.err == "" and sc.err == "", "the shim wrote to stderr", ss, sc)


# The runs every_mode makes: natively, under the shim in default and
# offset modes, and migratable (a migrator socket configured, none
# running: every queue gated).
MODES = {
    "native": "",
    "default": SHIM_DEFAULT,
    "offset": SHIM,
    "migratable": "RDMAVIRT_SOCKET=/tmp/no-migrator.sock " + SHIM_DEFAULT,
}


def every_mode(cmd, timeout):
    """`cmd` on host1 in every mode of MODES: their results by mode."""
    return {mode: LAB.run(1, env + cmd, timeout) for mode, env in MODES.items()}


RARE = f"{BUILD}/tests/apps/verbs_rare"


@lab_test
def rare_verbs_same_natively_and_under_the_shim_in_every_mode():
    # The crash class: exports a shim must not hand a shadow object to
    # (GID types, ibv_query_qp_data_in_order, L2 resolution), extended
    # queries and CQs, resize, rereg, refusals, completion and async
    # events, fork. Default mode, offset mode, and a migratable process
    # (a migrator socket configured, none running: every queue gated).
    runs = every_mode(RARE, 120)
    native = runs["native"]
    check(native.rc == 0 and "all checks passed" in native.out, "native run failed", native)
    for mode, r in runs.items():
        check(r.rc == 0, f"{mode}: exit {r.rc}", native, r)
        check(r.out == native.out, f"{mode}: transcript differs from the native one", native, r)
        check(r.err == "", f"{mode}: wrote to stderr", r)


PYVERBS = f"python3 {ROOT}/tests/lab/pyverbs_outcomes.py rxe0"


def pyverbs_outcomes(name, r):
    check(r.rc == 0, f"{name}: the pyverbs suite did not run to its end (exit {r.rc})", r)
    try:
        return json.loads(r.out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise Failure(f"{name}: no outcomes printed\n  {r!r}")


def refused_memory_window(test_id, outcome):
    # The shim refuses ibv_alloc_mw (EOPNOTSUPP, docs/shim.md): the suite
    # skips its memory-window tests for it, and nothing else.
    return ("mw" in test_id.rsplit(".", 1)[-1].lower() and outcome.startswith("skip:")
            and re.search(r"(?i)\bMW\b|memory window", outcome) is not None)


@lab_test
def pyverbs_suite_same_natively_and_under_the_shim_in_every_mode():
    # rdma-core's own test suite (python3-pyverbs): every test has the same
    # outcome under the shim as natively (default, offset and migratable),
    # but the memory-window ones, which it skips for the shim's refusal. It
    # found two bugs: ibv_resize_cq below the completions a CQ holds went
    # through (the markers' slack; test_resize_cq), and a UD QP's send
    # completions took its receives' records, so datagrams kept their
    # physical GRH (the shim then says so on stderr; test_cq_events_ud).
    runs = every_mode(PYVERBS, 300)
    native = pyverbs_outcomes("native", runs["native"])
    passed = [t for t, o in native.items() if o == "ok"]
    check(len(passed) >= 80, f"natively only {len(passed)} tests passed", runs["native"])
    for mode, r in runs.items():
        if mode == "native":
            continue
        got = pyverbs_outcomes(mode, r)
        check(set(got) == set(native), f"{mode}: another set of tests ran", r)
        differ = {t: (native[t], got[t]) for t in native
                  if got[t] != native[t] and not refused_memory_window(t, got[t])}
        check(not differ, f"{mode}: outcomes differ from the native ones: {differ}", r)
        check("receive journal" not in r.err, f"{mode}: a UD receive was not found", r)


def gids_masked(text):
    # Offset mode shows other GID values by design; everything else stays.
    return re.sub(r"(GID\[\s*\d+\]:\s*)\S+,", r"\1<gid>,", text)


@lab_test
def ibv_devinfo_verbose_same_under_the_shim():
    # rdma-core's own tool: GID types (the private ibv_query_gid_type) and
    # the empty entries of the GID table, which it leaves out.
    cmd = "ibv_devinfo -v"
    native = LAB.run(1, cmd)
    check(native.rc == 0 and "GID[  1]" in native.out, "native ibv_devinfo failed", native)
    default = LAB.run(1, SHIM_DEFAULT + cmd)
    check(default.rc == 0 and default.out == native.out and default.err == "",
          "default mode: ibv_devinfo -v differs", native, default)
    offset = LAB.run(1, SHIM + cmd)
    check(offset.rc == 0 and offset.err == "", "offset mode: ibv_devinfo -v failed", offset)
    check(gids_masked(offset.out) == gids_masked(native.out),
          "offset mode: ibv_devinfo -v differs beyond the GID values", native, offset)
    check("::ffff:10.77.128.1" in offset.out, "offset mode did not show the virtual GID", offset)


# qperf's RDMA tests that pass natively on rxe0 once connected through the
# RDMA CM (-cm1; its UC and UD tests address by LID and fail natively).
QPERF_TESTS = ("rc_lat", "rc_bw", "rc_rdma_write_lat", "rc_rdma_read_bw", "ver_rc_fetch_add")
QPERF_PORT = 19765


@lab_test
def qperf_same_natively_and_under_the_shim_in_every_mode():
    # qperf waits for completion events and ends each test with SIGALRM,
    # whose handler has no SA_RESTART: its waiter must return EINTR then.
    # Under the shim it waited on, and the peer timed out ("failed to
    # receive results"), in about one run of rc_rdma_write_lat in two.
    for mode, env in MODES.items():
        server = LAB.submit(1, env + "qperf", 300)
        try:
            wait_listening(1, QPERF_PORT)
            for t in QPERF_TESTS:
                r = LAB.run(2, env + f"qperf host1 -cm1 -t 1 {t}", 60)
                check(r.rc == 0 and re.search(r"^\s+(latency|bw|msg_rate)\s+=\s+[\d.]+ ", r.out, re.M)
                      and r.err == "", f"{mode}: qperf {t} failed", r)
        finally:
            LAB.run(2, "qperf host1 quit", 20)
            s = LAB.wait(1, server, 30)
        check(s.rc == 0 and s.err == "", f"{mode}: the qperf server failed", s)


@lab_test
def libfabric_verbs_pingpong_same_natively_and_under_the_shim_in_every_mode():
    # libfabric's verbs provider (Debian's 1.17): RC endpoints connected
    # through the RDMA CM, and UD datagrams with address handles; -c checks
    # every message's bytes.
    for ep in ("msg", "dgram"):
        cmd = f"fi_pingpong -p verbs -e {ep} -I 100 -S 64 -c"
        for mode, env in MODES.items():
            s, c = server_client(env + cmd, env + cmd + " host1", 47592, timeout=90)
            for side in (s, c):
                check(side.rc == 0 and side.err == "", f"{ep}, {mode}: fi_pingpong failed", s, c)
            check(re.search(r"^64\s+100\s+=100\s", c.out, re.M), f"{ep}, {mode}: not 100 of 100", c)


MCKEY = "mckey -m 239.1.130.3 -C 10"


@lab_test
def mckey_multicast_same_natively_and_under_the_shim_in_every_mode():
    # librdmacm's multicast join, a UD QP attached to the group and sends
    # to the group's GID and QPN (0xffffff): neither is an endpoint's, and
    # the group's third octet has the bit offset mode marks in unicast
    # GIDs. Before, in offset mode the sender's datagrams went to QPN
    # 0x7fffff and the group's receiver never got one.
    for mode, env in MODES.items():
        LAB.run(1, "rm -f /tmp/mckey.out")
        s, c = cm_pair(f"set -o pipefail; {env}stdbuf -oL {MCKEY} -b 10.77.0.1 | tee /tmp/mckey.out",
                       f"{env}{MCKEY} -b 10.77.0.2 -s", ready="grep -q receiving /tmp/mckey.out",
                       what="mckey's receiver in the group")
        check(c.rc == 0 and "return status 0" in c.out, f"{mode}: the sender failed", c)
        check(s.rc == 0 and "data transfers complete" in s.out and "return status 0" in s.out,
              f"{mode}: the receiver did not get the sender's 10 datagrams", s, c)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
