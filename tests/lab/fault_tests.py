"""Faults in the middle of a move, on real lab hosts.

The integrity workload runs between P (host1) and Q (host3) under the shim,
a migrator on every host; P is moved to host2 while a fault strikes: a
migrator killed at a known step (RDMAVIRT_FAILPOINTS stops it there, the
test SIGKILLs it and starts it again, as systemd would), CRIU failing on the
destination, the destination's state directory full. Each test ends with
the move done or rolled back, exactly one copy of P (the other host checked
too), P and Q making progress again, and the workload's own verdict:
nothing lost, duplicated, corrupted or out of order.
"""

import json
import os
import re
import sys
import time

from labtest import LAB, check, lab_test, main, run_all, run_ok, wait_until

import migration_tests as mt
import migrator_tests as migrators

CTL = mt.CTL


def migrate_job(src, pid, dest, wait=False, options=""):
    """rdmavirtctl migrate in the background on host`src`; LAB.wait it."""
    return LAB.submit(src, f"{CTL} --host {mt.ip(src)}:{mt.PORT} --tls-dir "
                           f"{migrators.CERTS}/host{src} --json migrate {pid} --to {mt.ip(dest)}"
                           f"{' --wait' if wait else ''} {options}", 900)


def report_of(result):
    try:
        return json.loads(result.out) if result.out.strip() else None
    except json.JSONDecodeError:
        return None


def stopped_at_failpoint(host, point):
    """Until host`host`'s migrator has stopped itself at `point`."""
    wait_until(host, "grep -q '^State:.*stopped' /proc/$(pgrep -x rdmavirt-migrat)/status", 300,
               f"the migrator stopped at {point}")


def stopped_or_done(host, job, timeout=300, job_host=None):
    """Until host`host`'s migrator stopped at a failpoint (True) or `job`
    (its move, on host`job_host`, default `host`) ended (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if LAB.done(job_host or host, job):
            return False
        if LAB.run(host, "grep -q '^State:.*stopped' "
                         "/proc/$(pgrep -x rdmavirt-migrat)/status").rc == 0:
            return True
        time.sleep(0.5)
    check(False, f"host{host}: the move neither ended nor reached the next failpoint")


def crash_and_restart(host):
    """SIGKILL of the stopped migrator; a fresh one (no failpoint) started."""
    migrators.kill_daemon(host)
    migrators.start_daemon(host)
    mt.ensure_daemons()


def exactly_one_copy(pid, where, elsewhere, what, comm="integrity"):
    """`pid` runs on host`where` under the shim and on no host of
    `elsewhere` (no process `comm` there with that pid)."""
    maps = LAB.run(where, f"cat /proc/{pid}/maps")
    check(maps.rc == 0 and "librdmavirt" in maps.out, f"{what} does not run on host{where}")
    for h in elsewhere:
        r = LAB.run(h, f"cat /proc/{pid}/comm 2>/dev/null")
        check(r.out.strip() != comm, f"a copy of {what} on host{h}")


def images_deleted(host, state_dir, report):
    """No image file of the move left in host`host`'s arrivals (earlier
    moves' directories are not this test's business)."""
    mid = report.get("migration_id")
    check(mid, "the report has no migration id", report)
    wait_until(host, f"! ls {state_dir}/incoming/{mid}/*/* > /dev/null 2>&1", 60,
               f"host{host}'s images of move {mid} deleted")


def progresses(name, by=100, timeout=120):
    """P's SENDs advance by `by`: both sides make progress (each SEND needs
    Q's receive and its answer)."""
    mt.wait_sent(name, mt.sent_by_p(name) + by, timeout)


def verdict(name, p_hosts):
    mt.nothing_lost(name, p_hosts, ["host3"])


def cleanup(name, pids):
    # The workload gone; no failpoint stays behind for the next test (exit
    # 3: this host's migrator runs with one).
    results = run_all({h: f"kill {' '.join(str(p) for p in pids)} 2>/dev/null; "
                          "tr '\\0' '\\n' < /proc/$(pgrep -x rdmavirt-migrat)/environ "
                          "| grep -q RDMAVIRT_FAILPOINTS && exit 3; exit 0"
                       for h in (1, 2, 3)})
    for h, r in results.items():
        if r.rc == 3:
            migrators.kill_daemon(h)
    mt.ensure_daemons()


def pair_with_failpoints(name, host, points):
    """host`host`'s migrator restarted with RDMAVIRT_FAILPOINTS=`points`,
    the others up; the workload started (Q on host3, P on host1) and
    flowing. Returns (q, p)."""
    mt.ensure_daemons()
    migrators.kill_daemon(host)
    migrators.start_daemon(host, f"RDMAVIRT_FAILPOINTS={points}")
    mt.ensure_daemons()
    q, p = mt.start_pair(name, 2000)
    return q, p


@lab_test
@mt.logs_on_failure("srckill")
def the_source_migrator_killed_after_the_final_dump_rolls_back_on_its_restart():
    q, p = pair_with_failpoints("srckill", 1, "phase:transfer")
    try:
        mt.wait_sent("srckill", 200)
        job = migrate_job(1, p, 2, wait=True)
        stopped_at_failpoint(1, "phase:transfer")
        crash_and_restart(1)
        r = LAB.wait(1, job, 900)
        rep = report_of(r)
        check("went away during move" in r.err, "the CLI did not say the daemon went away", r)
        check(r.rc == 1 and rep is not None and rep.get("rolled_back") is True,
              "not rolled back (rdmavirtctl --wait's outcome)", r)
        print("outcome:", rep.get("error"), flush=True)
        exactly_one_copy(p, 1, (2,), "P")
        images_deleted(2, mt.STATE, rep)
        progresses("srckill")
        verdict("srckill", ["host1"])
    finally:
        cleanup("srckill", (p, q))


def killed_then_asked_again(name, host, point):
    """P moves host1 -> host2 while host`host`'s migrator is killed at
    `point` (after P runs on host2) and started again: the source asks
    again and the move finishes, one copy of P and of Q."""
    q, p = pair_with_failpoints(name, host, point)
    try:
        mt.wait_sent(name, 200)
        job = migrate_job(1, p, 2)
        if not stopped_or_done(host, job, job_host=1):
            r = LAB.wait(1, job, 60)
            check(False, f"the move ended before host{host}'s migrator reached {point}", r)
        crash_and_restart(host)
        r = LAB.wait(1, job, 900)
        rep = report_of(r)
        check(r.rc == 0 and rep is not None and rep.get("ok") is True,
              f"the move did not finish once host{host} came back", r)
        exactly_one_copy(p, 2, (1,), "P")
        exactly_one_copy(q, 3, (1, 2), "Q")
        progresses(name)
        verdict(name, ["host1", "host2"])
    finally:
        cleanup(name, (p, q))


@lab_test
@mt.logs_on_failure("destkill")
def the_destination_migrator_killed_before_the_resume_is_asked_again():
    killed_then_asked_again("destkill", 2, "serve:resume")


@lab_test
@mt.logs_on_failure("peerkill")
def a_peer_host_migrator_killed_before_the_re_point_is_asked_again():
    killed_then_asked_again("peerkill", 3, "serve:reconnect")


def outcome_on(host, kind, timeout=600):
    """The report of host`host`'s newest `kind` once nothing is in flight
    there (a restarted migrator's recovery ended it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = migrators.ctl(host, f"--host {mt.ip(host)}:{mt.PORT} status --json")
        if r.rc == 0:
            s = json.loads(r.out)
            recent = [m for m in s.get("recent", []) if m.get("kind") == kind]
            if not s.get("in_flight") and recent:
                return recent[0]
        time.sleep(1)
    check(False, f"host{host}: no {kind} ended within {timeout}s")


@lab_test
@mt.logs_on_failure("rstkill")
def the_source_migrator_killed_while_a_restore_elsewhere_re_points_finishes_it():
    """A restore on another host runs a move's steps: its source's migrator
    killed once the process runs (paused) on the destination finishes the
    restore when it starts again, as it finishes a move."""
    mt.ensure_daemons()
    q, p = mt.start_pair("rstkill", 2000)
    ckpt = "/var/lib/rdmavirt-lab/ckpt-rstkill"
    try:
        mt.wait_sent("rstkill", 200)
        r, rep = mt.ctl(1, f"checkpoint {p} --dir {ckpt}")
        check(r.rc == 0 and rep and rep.get("ok"), "checkpoint of P", r)
        migrators.kill_daemon(1)
        migrators.start_daemon(1, "RDMAVIRT_FAILPOINTS=phase:reconnect")
        job = LAB.submit(1, f"{CTL} --host {mt.ip(1)}:{mt.PORT} --tls-dir "
                            f"{migrators.CERTS}/host1 --json restore --dir {ckpt} "
                            f"--on {mt.ip(2)}", 900)
        stopped_at_failpoint(1, "phase:reconnect")
        crash_and_restart(1)
        r = LAB.wait(1, job, 900)
        check(r.rc == 3 and "went away during move" in r.err,
              "the CLI did not say the daemon went away", r)
        rep = outcome_on(1, "restore")
        check(rep.get("ok") is True, "the restore was not finished by the restarted migrator", rep)
        exactly_one_copy(p, 2, (1,), "P")
        exactly_one_copy(q, 3, (1, 2), "Q")
        progresses("rstkill")
        verdict("rstkill", ["host1", "host2"])
    finally:
        LAB.run(1, f"rm -rf {ckpt}")
        cleanup("rstkill", (p, q))


FABRIC = "10.77.0.0/24"
CUT_S = 5  # how long each cut lasts


def cut(host, on):
    """Every packet between host`host` and the other hosts dropped (RoCE
    and gRPC alike: both go through the IP stack), or no longer."""
    op = "-I" if on else "-D"
    r = LAB.run(host, f"iptables {op} INPUT -s {FABRIC} -j DROP && "
                      f"iptables {op} OUTPUT -d {FABRIC} -j DROP")
    if on:
        check(r.rc == 0, f"host{host}: cutting the fabric", r)


def cut_while_continuing(stopped_host, cut_host):
    """The stopped migrator goes on while host`cut_host` is cut off."""
    cut(cut_host, True)
    try:
        run_ok(stopped_host, "kill -CONT $(pgrep -x rdmavirt-migrat)")
        time.sleep(CUT_S)  # the fault's length, not a wait for a condition
    finally:
        cut(cut_host, False)


def cut_through_move(src, pid, dest, peer):
    """`pid` moved host`src` -> host`dest` by a migrator stopped at
    phase:transfer and phase:reconnect: the destination cut off as the
    final dump's transfer starts, then the peer's host as the peers are
    re-pointed (unless the transfer failed: rolled back). The report."""
    job = migrate_job(src, pid, dest)
    stopped_at_failpoint(src, "phase:transfer")
    cut_while_continuing(src, dest)
    if stopped_or_done(src, job):
        cut_while_continuing(src, peer)
    r = LAB.wait(src, job, 900)
    rep = report_of(r)
    check(rep is not None and (rep.get("ok") is True or rep.get("rolled_back") is True),
          "neither done nor rolled back", r)
    print("outcome:", "done" if rep.get("ok") else f"rolled back: {rep.get('error')}", flush=True)
    return rep


@lab_test
@mt.logs_on_failure("cut")
def a_fabric_cut_during_the_transfer_and_the_reconnect_ends_in_one_copy():
    q, p = pair_with_failpoints("cut", 1, "phase:transfer,phase:reconnect")
    try:
        mt.wait_sent("cut", 200)
        rep = cut_through_move(1, p, 2, 3)
        if rep.get("ok"):
            # The cuts were real: each step they struck waited them out.
            b = rep["breakdown"]
            for step in ("transfer_us", "reconnect_us"):
                check(int(b.get(step, 0)) >= CUT_S * 0.8e6, f"{step} shorter than the cut", b)
        dest, other = (2, 1) if rep.get("ok") else (1, 2)
        exactly_one_copy(p, dest, (other,), "P")
        exactly_one_copy(q, 3, (1, 2), "Q")
        progresses("cut")
        verdict("cut", ["host1", "host2"] if rep.get("ok") else ["host1"])
    finally:
        for h in (2, 3):
            cut(h, False)
        cleanup("cut", (p, q))


@lab_test
@mt.logs_on_failure("criufail")
def criu_failing_on_the_destination_rolls_back():
    mt.ensure_daemons()
    # 50 iterations a second: enough for the failed move and the checks
    # after it, and no idle wait for the workload's end.
    q, p = mt.start_pair("criufail", 2000)
    holder = None
    # Each host hands out pids from a range of its own (tools/lab/guest/
    # stage2): host2's counter is put back there afterwards, or its next
    # processes would take pids of host1's range, which the next tests'
    # moves from host1 need free on host2.
    own_range = int(run_ok(2, "cat /proc/sys/kernel/ns_last_pid").out.split()[-1])
    try:
        mt.wait_sent("criufail", 200)
        # P's pid is taken on host2: CRIU restores a process with its own
        # pid, and fails there.
        for _ in range(20):
            # The write, then the very next fork of this shell.
            r = run_ok(2, f"echo {p - 1} > /proc/sys/kernel/ns_last_pid; "
                          "setsid sleep 900 < /dev/null > /dev/null 2>&1 & echo $!")
            holder = int(r.out.split()[-1])
            if holder == p:
                break
            LAB.run(2, f"kill {holder}")
        check(holder == p, f"could not take pid {p} on host2")
        r = LAB.wait(1, migrate_job(1, p, 2), 900)
        rep = report_of(r)
        check(r.rc == 1 and rep is not None and rep.get("rolled_back") is True,
              "not rolled back", r)
        print("outcome:", rep.get("error"), flush=True)
        check(re.search(r"restor", rep.get("error", "")), "not a restore failure", rep)
        exactly_one_copy(p, 1, (2,), "P")
        progresses("criufail")
        verdict("criufail", ["host1"])
    finally:
        kill = f"kill {holder} 2>/dev/null; " if holder is not None else ""
        LAB.run(2, f"{kill}echo {own_range} > /proc/sys/kernel/ns_last_pid")
        cleanup("criufail", (p, q))


def at_once(host, commands):
    """`commands` (name -> rdmavirtctl arguments) run at the same moment on
    host`host`, against its migrator; name -> (exit status, JSON, stderr)."""
    base = f"{CTL} --host {mt.ip(host)}:{mt.PORT} --tls-dir {migrators.CERTS}/host{host} --json"
    out = f"{mt.WORK}/at-once"
    script = f"rm -rf {out}; mkdir -p {out}\n" + "".join(
        f"({base} {args} > {out}/{name}.json 2> {out}/{name}.err; echo $? > {out}/{name}.rc) &\n"
        for name, args in commands.items()) + "wait\n" + "".join(
        f"echo {name} $(cat {out}/{name}.rc)\n" for name in commands)
    run_ok(host, script, 900)
    d = os.path.join(LAB.shared, out[len("/lab/"):])
    results = {}
    for name in commands:
        with open(os.path.join(d, f"{name}.rc")) as f:
            rc = int(f.read())
        with open(os.path.join(d, f"{name}.json")) as f:
            text = f.read()
        with open(os.path.join(d, f"{name}.err")) as f:
            err = f.read()
        try:
            rep = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            rep = None
        results[name] = (rc, rep, err)
        print(f"{name}: exit {rc}; {(rep or {}).get('error', '')[:200]}", flush=True)
    return results


def where_is(pid, comm="integrity"):
    """The hosts where `pid` runs as `comm`."""
    return [h for h in (1, 2, 3)
            if LAB.run(h, f"cat /proc/{pid}/comm 2>/dev/null").out.strip() == comm]


@lab_test
@mt.logs_on_failure("race")
def two_moves_of_one_process_and_a_drain_racing_a_move_end_in_one_copy():
    """P (host1) is asked at the same moment to move to host2 and to
    host3: one move takes it, the other is refused, and P runs on exactly
    one host. Then, from there, a drain of its host and a move of P race:
    again one copy, nothing hangs, the drain waits for the move and leaves
    nothing behind, and the workload loses nothing."""
    mt.ensure_daemons()
    q, p = mt.start_pair("race", 100000)
    try:
        mt.wait_sent("race", 200)
        r = at_once(1, {"to2": f"migrate {p} --to {mt.ip(2)} --max-precopy 1",
                        "to3": f"migrate {p} --to {mt.ip(3)} --max-precopy 1"})
        took = [n for n, (rc, rep, _) in r.items() if rc == 0 and rep and rep.get("ok")]
        check(len(took) == 1, "not exactly one of the two moves took P", r)
        other = r["to3" if took == ["to2"] else "to2"]
        said = (other[1] or {}).get("error", "") + other[2]
        check(other[0] != 0 and not (other[1] or {}).get("ok") and
              re.search(r"already moving|being moved|nothing was quiesced", said),
              "the other move was not refused, or not for the move in flight", other)
        check(where_is(p) == [2 if took == ["to2"] else 3], "P is not on the host of the move",
              where_is(p))
        progresses("race")
        here = where_is(p)[0]
        there = [h for h in (1, 2, 3) if h != here]
        r = at_once(here, {"drain": f"drain --connect none --to-migrator {mt.ip(there[0])} "
                                    "--max-precopy 1",
                           "move": f"migrate {p} --to {mt.ip(there[1])} --max-precopy 1"})
        hosts = where_is(p)
        check(len(hosts) == 1, "P does not run on exactly one host", hosts, r)
        moved = [n for n, (rc, rep, _) in r.items() if rc == 0 and rep and rep.get("ok")]
        print(f"P: host{here} -> host{hosts[0]}; succeeded: {moved}", flush=True)
        check(hosts[0] != here or not moved, "a command said it moved P, which stayed", r)
        # The drain waits for the racing move's end: P (and Q, if paused as
        # its peer on this host) went with one of the two, nothing stayed.
        drc, drep, _ = r["drain"]
        check(drc == 0 and drep is not None and not drep.get("stayed"),
              "the drain left something on the host", r["drain"])
        check(hosts[0] != here, "P is still on the drained host", hosts, r)
        progresses("race")
        path = ["host1", f"host{here}"] + ([f"host{hosts[0]}"] if hosts[0] != here else [])
        # Q is on host3: drained with P if P was there (the drain's host).
        mt.nothing_lost("race", path, ["host3"] + ([f"host{there[0]}"] if here == 3 else []))
    finally:
        cleanup("race", (p, q))


@lab_test
@mt.logs_on_failure("nospace")
def a_full_destination_state_directory_rolls_back():
    mt.ensure_daemons()
    small = "/var/lib/rdmavirt-lab-small"
    # 2 MiB: P's final dump (about 3 MiB) cannot fit.
    migrators.kill_daemon(2)
    run_ok(2, f"mkdir -p {small} && (mountpoint -q {small} || "
              f"mount -t tmpfs -o size=2m tmpfs {small})")
    migrators.start_daemon(2, state_dir=small)
    mt.ensure_daemons()
    q, p = mt.start_pair("nospace", 1500)  # the move fails within seconds
    try:
        mt.wait_sent("nospace", 200)
        r = LAB.wait(1, migrate_job(1, p, 2), 900)
        rep = report_of(r)
        check(r.rc == 1 and rep is not None and rep.get("rolled_back") is True,
              "not rolled back", r)
        print("outcome:", rep.get("error"), flush=True)
        check("space" in rep.get("error", "").lower(), "the report does not say no space", rep)
        exactly_one_copy(p, 1, (2,), "P")
        images_deleted(2, small, rep)
        progresses("nospace")
        verdict("nospace", ["host1"])
    finally:
        migrators.kill_daemon(2)
        LAB.run(2, f"umount {small}; rmdir {small}; true")
        cleanup("nospace", (p, q))


# Post-copy against real CRIU. The client of qp_holder (4 RC QPs to its
# server on host3) holds 128 MiB of plain memory that it rewrites as fast as
# it runs: after the one pre-copy round nearly all of it is dirty again, and
# its pages come to the destination after the restore (CRIU's lazy-pages
# daemon there, the source's CRIU serving them), for seconds on TCG hosts:
# long enough for a fault to strike in the middle.
PC_PORT = 18960
PC_MOVE = "--postcopy --max-precopy 1"
# Fixed-string patterns that do not match the shell that runs them.
LAZY_DAEMON = "'[c]riu lazy-pages'"
PAGE_SERVER = "'[c]riu dump'"


def postcopy_client(name):
    """qp_holder's server on host3 and its client on host1, writing;
    the client's pid."""
    prog = f"{mt.BUILD}/tests/apps/qp_holder"
    run_ok(1, f"mkdir -p {mt.WORK} && rm -f {mt.WORK}/{name}-*")
    stop_postcopy_client()
    args = f"--qps 4 --port {PC_PORT} --seconds 3600"
    run_ok(3, f"(setsid env {mt.SHIM}{prog} --server {args} > {mt.WORK}/{name}-q.out 2>&1 "
              f"< /dev/null &)")
    mt.wait_listening(3, PC_PORT)
    run_ok(1, f"(setsid env {mt.SHIM}{prog} --connect {mt.ip(3)} {args} --heap-mib 128 "
              f"--dirty-mib-s 1024 > {mt.WORK}/{name}-p.out 2>&1 < /dev/null &)")
    wait_until(1, f"grep -q 'writes by thread: [1-9]' {mt.WORK}/{name}-p.out", 120,
               "the client wrote")
    return mt.pid_of(1, f"qp_holder .*--connect.*--port {PC_PORT}")


def stop_postcopy_client():
    run_all({h: f"pkill -f 'qp_holder .*--port {PC_PORT}'; true" for h in (1, 2, 3)})


def postcopy_client_verdict(name, host, pid):
    """The client keeps writing on host`host`, then ends (SIGTERM) with
    every write completed and every page of its memory as it wrote it."""
    mt.each_thread_goes_on(lambda: mt.writes_by_thread(name), 1, host, pid, "the client",
                           "writing")
    run_ok(host, f"kill -TERM {pid}")
    wait_until(host, f"grep -q '^{{' {mt.WORK}/{name}-p.out", 120, "the client reported")
    v = json.loads(run_ok(host, f"grep '^{{' {mt.WORK}/{name}-p.out").out)
    print(f"{name}: the client's verdict: {v}", flush=True)
    check(v["ok"] and v["errors"] == 0 and v["heap_bad_pages"] == 0 and v["heap_mib"] == 128,
          "the client's writes or memory", v)


def failpoint_on_host1(point):
    mt.ensure_daemons()
    migrators.kill_daemon(1)
    migrators.start_daemon(1, f"RDMAVIRT_FAILPOINTS={point}")
    mt.ensure_daemons()


@lab_test
@mt.logs_on_failure("pcdaemon")
def a_lazy_pages_daemon_killed_during_the_restore_rolls_the_postcopy_move_back():
    """host2's lazy-pages daemon is SIGKILLed as soon as CRIU's restore
    starts there: the restore fails or finds the daemon dead when it
    returns, host2 kills what it restored, and the move rolls back: the
    client resumes on host1 with its memory whole."""
    mt.ensure_daemons()
    pid = postcopy_client("pcdaemon")
    try:
        armed = f"{mt.WORK}/pcdaemon-armed"
        killer = LAB.submit(2, f"touch {armed}; for i in $(seq 12000); do "
                               "pgrep -f '[c]riu restore' > /dev/null && break; sleep 0.05; done; "
                               f"pkill -9 -f {LAZY_DAEMON} && echo killed", 900)
        wait_until(2, f"[ -e {armed} ]", 60, "the killer running")
        r = LAB.wait(1, migrate_job(1, pid, 2, options=PC_MOVE), 900)
        k = LAB.wait(2, killer, 60)
        check("killed" in k.out, "no lazy-pages daemon found during the restore", k)
        rep = report_of(r)
        check(r.rc == 1 and rep is not None and rep.get("rolled_back") is True,
              "not rolled back", r)
        print("outcome:", rep.get("error"), flush=True)
        check("lazy-pages" in rep.get("error", "") or "restor" in rep.get("error", ""),
              "not the restore's failure", rep)
        exactly_one_copy(pid, 1, (2,), "the client", comm="qp_holder")
        postcopy_client_verdict("pcdaemon", 1, pid)
    finally:
        stop_postcopy_client()
        cleanup("pcdaemon", ())


@lab_test
@mt.logs_on_failure("pcsource")
def the_source_page_server_killed_during_the_postcopy_loses_the_process_and_says_so():
    """P runs on host2 and takes its last pages from host1 when host1's
    CRIU serving them is SIGKILLed (a source that dies): the process
    cannot be whole anywhere. host2's copy is killed rather than left to
    fault on the missing pages, host1's stopped copy too, and the CLI says
    the process is lost."""
    failpoint_on_host1("phase:postcopy")
    pid = postcopy_client("pcsource")
    try:
        job = migrate_job(1, pid, 2, options=PC_MOVE)
        stopped_at_failpoint(1, "phase:postcopy")
        check(LAB.run(2, f"pgrep -f {LAZY_DAEMON}").rc == 0,
              "post-copy ended before the fault (too little memory to fetch)")
        run_ok(1, f"pkill -9 -f {PAGE_SERVER}")
        wait_until(2, f"[ \"$(cat /proc/{pid}/comm 2>/dev/null)\" != qp_holder ]", 120,
                   "host2's copy killed once its pages could not all come")
        run_ok(1, "kill -CONT $(pgrep -x rdmavirt-migrat)")
        r = LAB.wait(1, job, 900)
        rep = report_of(r)
        print("outcome:", r.rc, rep and rep.get("error"), r.err[-400:], flush=True)
        said = (rep or {}).get("error", "") + r.err
        check(r.rc != 0 and "the process is lost" in said, "the CLI does not say it is lost", r)
        check(rep is None or rep.get("rolled_back") is not True, "said rolled back", rep)
        for h in (1, 2):
            check(LAB.run(h, f"cat /proc/{pid}/comm 2>/dev/null").out.strip() != "qp_holder",
                  f"a copy of the lost client on host{h}")
        check(LAB.run(3, f"pgrep -f 'qp_holder --server.*--port {PC_PORT}'").rc == 0,
              "the peer (the server on host3) went down with it")
    finally:
        stop_postcopy_client()
        cleanup("pcsource", ())


@lab_test
@mt.logs_on_failure("pcrestart")
def migrators_restarted_during_a_postcopy_find_it_in_their_records_and_finish_it():
    """Both migrators of a post-copy move are SIGKILLed and started again
    while the last pages still flow (CRIU's page server and lazy-pages
    daemon run on, in process groups of their own): the restarted source
    finds the post-copy in its record and waits for its page server's
    end, the restarted destination watches its daemon; the move ends
    done, one copy, every page whole."""
    failpoint_on_host1("phase:postcopy")
    pid = postcopy_client("pcrestart")
    try:
        job = migrate_job(1, pid, 2, wait=True, options=PC_MOVE)
        stopped_at_failpoint(1, "phase:postcopy")
        check(LAB.run(2, f"pgrep -f {LAZY_DAEMON}").rc == 0 and
              LAB.run(1, f"pgrep -f {PAGE_SERVER}").rc == 0,
              "post-copy ended before the restarts (too little memory to fetch)")
        crash_and_restart(2)
        crash_and_restart(1)
        r = LAB.wait(1, job, 900)
        rep = report_of(r)
        print("outcome:", r.rc, rep and rep.get("error"), flush=True)
        check(r.rc == 0 and rep is not None and rep.get("ok") is True,
              "the move did not finish after the restarts", r)
        check(LAB.run(1, f"pgrep -f {PAGE_SERVER}").rc != 0, "host1's page server still runs")
        status = run_ok(2, f"cat $(ls -t {mt.STATE}/criu-logs/postcopy-*/lazy-pages.status "
                           "| head -1)").out.strip()
        check(status == "0", "host2's lazy-pages daemon did not end well", status)
        exactly_one_copy(pid, 2, (1,), "the client", comm="qp_holder")
        postcopy_client_verdict("pcrestart", 2, pid)
    finally:
        stop_postcopy_client()
        cleanup("pcrestart", ())


def pp_iterations(name):
    """The last "iteration N" cm_pingpong's client printed (every 100)."""
    import rdmacm_tests as cm
    found = re.findall(r"^iteration (\d+)$", cm.read(name, missing_ok=True), re.M)
    return int(found[-1]) if found else 0


def pp_progresses(name, by=200, timeout=180):
    """cm_pingpong's client advances by `by` iterations (each a SEND and
    its answer, every byte checked)."""
    start = pp_iterations(name)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pp_iterations(name) >= start + by:
            return
        time.sleep(0.5)
    check(False, f"cm_pingpong's client did not advance by {by} iterations from {start}")


def with_failpoints(host, points):
    """host`host`'s migrator started again with RDMAVIRT_FAILPOINTS."""
    migrators.kill_daemon(host)
    migrators.start_daemon(host, f"RDMAVIRT_FAILPOINTS={points}")
    mt.ensure_daemons()


@lab_test
@mt.logs_on_failure("cmfault")
def an_rdma_cm_client_through_three_faulted_moves_ends_in_one_copy_and_passes():
    """An RDMA CM program (tests/apps/cm_pingpong: every byte and every CM
    event checked, a CM event while connected fails it) through the faults
    the integrity workload's tests strike, one move each: the source's
    migrator killed after the final dump (rolled back: it goes on on
    host1), the destination's killed before the resume (asked again: done,
    on host2), and from host2 back to host1 a fabric cut of the destination
    during the transfer and of the peer's host during the reconnect (done
    or rolled back). After each, exactly one copy and progress; at the end
    both sides' own verdict, and the disconnect reaching the server."""
    import rdmacm_tests as cm
    mt.ensure_daemons()
    name = "cmfault"
    stop = f"{cm.WORK}/{name}-stop"
    run_ok(1, f"rm -f {stop}")
    args = f"-p {cm.PORT} -n 1000000 -d client"
    spid = cm.start_logged(3, f"{cm.PINGPONG} -s -a {mt.ip(3)} {args}", f"{name}-server.out")
    cpid = None
    try:
        wait_until(3, f"grep -q listening {cm.WORK}/{name}-server.out", 30, "the server listens")
        cpid = cm.start_logged(1, f"{cm.PINGPONG} -c {mt.ip(3)} {args} -i 20 -u {stop}",
                               f"{name}-client.out")
        pp_progresses(f"{name}-client.out", 100)
        comm = dict(comm="cm_pingpong")

        with_failpoints(1, "phase:transfer")
        job = migrate_job(1, cpid, 2, wait=True)
        stopped_at_failpoint(1, "phase:transfer")
        crash_and_restart(1)
        r = LAB.wait(1, job, 900)
        rep = report_of(r)
        check(r.rc == 1 and rep is not None and rep.get("rolled_back") is True,
              "the source killed after the final dump: not rolled back", r)
        exactly_one_copy(cpid, 1, (2,), "the client", **comm)
        pp_progresses(f"{name}-client.out")

        with_failpoints(2, "serve:resume")
        job = migrate_job(1, cpid, 2)
        if not stopped_or_done(2, job, job_host=1):
            check(False, "the move ended before the destination reached serve:resume",
                  LAB.wait(1, job, 60))
        crash_and_restart(2)
        r = LAB.wait(1, job, 900)
        rep = report_of(r)
        check(r.rc == 0 and rep is not None and rep.get("ok") is True,
              "the destination killed before the resume: the move did not finish", r)
        exactly_one_copy(cpid, 2, (1,), "the client", **comm)
        exactly_one_copy(spid, 3, (1, 2), "the server", **comm)
        pp_progresses(f"{name}-client.out")

        with_failpoints(2, "phase:transfer,phase:reconnect")
        rep = cut_through_move(2, cpid, 1, 3)
        where, other = (1, 2) if rep.get("ok") else (2, 1)
        exactly_one_copy(cpid, where, (other,), "the client", **comm)
        pp_progresses(f"{name}-client.out")

        run_ok(1, f"touch {stop}")
        cm.wait_gone(where, cpid, "cm_pingpong's client", 180)
        cm.wait_gone(3, spid, "cm_pingpong's server", 120)
        cm.pp_verdict(f"{name}-client.out", "client")
        cm.pp_verdict(f"{name}-server.out", "server")
    finally:
        for h in (1, 2, 3):
            cut(h, False)
        cleanup(name, [spid] + ([cpid] if cpid else []))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
