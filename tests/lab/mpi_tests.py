"""MPI jobs over rxe0 between lab hosts: Debian's Open MPI 4.1 with UCX
(tools/lab/mpi.py has the recipe, docs/mpi.md why), natively and with
every rank under the shim, in default and offset modes."""

import json
import os
import re
import shutil
import sys

from labtest import BUILD, LAB, check, lab_test, main, run_ok

import migration_tests
import migrator_tests as migrators
import mpi  # tools/lab, on the path through labtest

HOSTS = [1, 2]
VERIFY = f"{BUILD}/tests/apps/mpi_verify"


VERIFY_MPICH = f"{BUILD}/tests/apps/mpi_verify_mpich"


def mpirun(np, program, shim, timeout=300, launcher="openmpi"):
    """Runs the job from host1; returns (result, packets rxe0 carried on
    each host meanwhile)."""
    r, packets = mpi.run_job(LAB, HOSTS, np, program, shim=shim, build=BUILD, timeout=timeout,
                             launcher=launcher)
    return r, {n: sent + rcvd for n, (sent, rcvd) in packets.items()}


def verdict(r):
    lines = [l for l in r.out.splitlines() if l.startswith("{")]
    check(len(lines) == 1, "mpi_verify printed no verdict", r)
    return json.loads(lines[0])


def verify_job(shim, launcher="openmpi"):
    """Four ranks, two per host: shared memory within a host, RC over
    rxe0 between them; every byte checked by the program itself."""
    r, packets = mpirun(4, [PROGRAMS[launcher], "--rounds", "2", "--max-bytes", "262144"], shim,
                        launcher=launcher)
    check(r.rc == 0, f"the job failed (shim {shim})", r)
    v = verdict(r)
    check(v["verdict"] == "ok" and v["errors"] == 0, f"corrupt data (shim {shim})", v)
    check(v["ranks"] == 4 and v["rounds"] == 2 and v["rma"], "not the job asked for", v)
    check(sorted(v["hosts"]) == ["host1", "host1", "host2", "host2"],
          "ranks not two per host", v)
    check(v["shimmed_ranks"] == (0 if shim == "none" else 4),
          f"{v['shimmed_ranks']} of 4 ranks had the shim (shim {shim})", v)
    # The data went over RDMA: the launch and UCX's wire-up alone carry
    # no more than a few hundred packets (measured: about 2,000 per host
    # for this job).
    for n, count in packets.items():
        check(count > 1000, f"host{n}'s rxe0 carried only {count} packets", r)
    print(f"{launcher}, shim {shim}: {v['bytes_verified']} bytes verified, "
          f"{v['shimmed_ranks']} ranks shimmed, rxe0 packets {packets}", flush=True)
    return v


def both_agree(shim, launcher="openmpi"):
    native = verify_job("none", launcher)
    shimmed = verify_job(shim, launcher)
    check(shimmed["bytes_verified"] == native["bytes_verified"],
          "the shim changed what the job did", native, shimmed)


@lab_test
def mpi_job_verifies_every_byte_natively_and_under_the_shim():
    both_agree("default")


@lab_test
def mpi_job_verifies_every_byte_under_the_shim_in_offset_mode():
    verify_job("offset")


@lab_test
def mpich_job_verifies_every_byte_natively_and_under_the_shim_in_both_modes():
    """mpi_verify built against MPICH (ch4 over UCX), launched by Hydra:
    the same job natively and under the shim, default and offset."""
    native = verify_job("none", "mpich")
    for mode in ("default", "offset"):
        shimmed = verify_job(mode, "mpich")
        check(shimmed["bytes_verified"] == native["bytes_verified"],
              f"the shim ({mode}) changed what the MPICH job did", native, shimmed)


@lab_test
def netpipe_integrity_check_passes_natively_and_under_the_shim():
    # NetPIPE's own integrity mode: every message size from 1 byte to
    # 128 KiB, each checked by the receiver.
    counts = {}
    for shim in ("none", "default", "offset"):
        r, _ = mpirun(2, ["NPopenmpi", "-i", "-u", "131072", "-p", "0", "-n", "5",
                          "-o", "/dev/null"], shim)
        text = r.out + r.err  # NetPIPE reports on stderr
        passed = re.findall(r"-->\s+Integrity check passed", text)
        check(r.rc == 0 and len(passed) >= 20, f"NetPIPE failed (shim {shim})", r)
        check("fail" not in text.lower(), f"NetPIPE found corrupt data (shim {shim})", r)
        counts[shim] = len(passed)
    check(len(set(counts.values())) == 1, "not every run checked every size", counts)


# A move in the middle of a job: host2's orted tree goes to host3.
MOVING, DEST = 2, 3
MOVE_DIR = "/lab/mpi-move"  # in the hosts; under LAB.shared here
# UCX's receive queues at 1024 (4095 by default), the lab's own tuning in
# /etc/ucx/ucx.conf: each rank holds 57 MiB of anonymous memory instead of
# 125 (two 38 MiB pools of receive buffers), which is what the move copies
# over TCG hosts' links; the move itself is the same.
UCX_TUNING = ["UCX_RC_VERBS_RX_QUEUE_LEN=1024"]


def wait_progress(job, condition, timeout, what):
    """Until condition(progress of `job`) holds; the last progress seen."""
    held, seen = mpi.wait_progress(LAB, job["progress"], condition, timeout)
    check(held, f"job {job['name']}: {what}: not after {timeout}s", seen)
    return seen


def leases(n):
    """hostN's leased service addresses (rdmavirt-mpi-orted --list)."""
    r = run_ok(n, "/usr/local/lib/rdmavirt/rdmavirt-mpi-orted --list")
    return [line.split()[0] for line in r.out.splitlines() if line.strip()]


# Two jobs with ranks on host2, each started with the user's stock command
# from host1: A on 3 hosts (host1: mpirun and rank 0; host2: orted, ranks 1
# and 2; host3: orted, rank 3), B on 2 (host1: rank 0; host2: orted, rank 1).
JOBS = [
    {"name": "A", "slots": {1: 1, 2: 2, 3: 1}, "np": 4, "max_bytes": 262144, "on_host2": [1, 2],
     "ends_on": ["host1", "host3", "host3", "host3"]},
    {"name": "B", "slots": {1: 1, 2: 1}, "np": 2, "max_bytes": 65536, "on_host2": [1],
     "ends_on": ["host1", "host3"]},
]
# Each launcher's daemon on the hosts other than the launch's, whose tree
# a drain moves, and the program its job runs.
DAEMONS = {"openmpi": "orted", "mpich": "hydra_pmi_proxy"}
PROGRAMS = {"openmpi": VERIFY, "mpich": VERIFY_MPICH}


@lab_test
def an_mpi_job_runs_to_its_end_while_a_host_of_it_is_moved():
    """Hosts set up by `rdmavirt-install host --mpi` (and mpi.conf's
    addresses), the user's stock mpirun: job A of JOBS, every rank under
    the shim through Open MPI's own settings, orted without it. While it
    runs, host2 is drained (rdmavirtctl drain), which moves its orted tree
    to host3 as one, with the service address rdmavirt-mpi-orted leased
    it; the ranks' terminals, whose numbers host3's own orted holds, are
    renumbered by the restore. The ranks must go on there (their progress
    names host3 and advances), the job must end with every byte verified,
    and nothing of it may be left on host2. Neither the ranks nor mpirun
    know of the move."""
    drained_jobs(JOBS[:1])


@lab_test
def two_mpi_jobs_on_a_drained_host_run_to_their_end():
    """As above with both jobs of JOBS on host2 when it is drained: each
    job's orted tree moves as one, with its own leased address, and both
    jobs end with every byte verified."""
    drained_jobs(JOBS)


@lab_test
def an_mpich_job_runs_to_its_end_while_a_host_of_it_is_moved():
    """Job A of JOBS with MPICH (Hydra's mpiexec, ch4 over UCX), started
    with the stock mpiexec.mpich on hosts set up by `rdmavirt-install host
    --mpi` (Hydra's own configuration file): host2 is drained mid-run, its
    hydra_pmi_proxy tree moves to host3 as one with the proxy's leased
    address, and the job ends with every byte verified."""
    drained_jobs([dict(JOBS[0], launcher="mpich")])


def drained_jobs(jobs):
    hosts = [1, 2, 3]
    migrators.daemons_up()
    mpi.stop_job(LAB, hosts)
    local = os.path.join(LAB.shared, "mpi-move")
    shutil.rmtree(local, ignore_errors=True)
    for job in jobs:
        job["progress"] = f"{MOVE_DIR}/progress-{job['name']}"
        job["stop"] = f"{MOVE_DIR}/stop-{job['name']}"
        os.makedirs(os.path.join(local, f"progress-{job['name']}"))
    try:
        installed = mpi.install_mpi(LAB, BUILD, hosts, migrators.SOCK, UCX_TUNING)
        for n, out in installed.items():
            check("configuring /etc/openmpi/openmpi-mca-params.conf" in out and
                  "configuring /etc/ucx/ucx.conf" in out and "done: host, with MPI" in out,
                  f"host{n}: rdmavirt-install --mpi did not configure Open MPI and UCX", out)
            check(all(j.get("launcher") != "mpich" for j in jobs) or
                  "configuring /usr/etc/mpiexec.hydra.conf" in out,
                  f"host{n}: rdmavirt-install --mpi did not configure MPICH's Hydra", out)
        try:
            for job in jobs:
                launcher = job.setdefault("launcher", "openmpi")
                script = mpi.stock_script(
                    job["slots"], job["np"],
                    [PROGRAMS[launcher], "--rounds", "3", "--until-file", job["stop"],
                     "--seconds", "1800", "--max-bytes", str(job["max_bytes"]),
                     "--progress", job["progress"]],
                    timeout=2000, launcher=launcher)
                job["handle"] = LAB.submit(1, f"cd /tmp && {script}", 2100)
            drain_while_running(jobs)
        finally:
            for job in jobs:
                if "handle" in job:
                    LAB.kill(1, job["handle"])
    finally:
        mpi.stop_job(LAB, hosts)
        mpi.uninstall_mpi(LAB, hosts)


def started_on_host2(job):
    """Once every rank of `job` has done a round: its ranks on host2
    {rank: pid} (job["moving"]) and host2's part of it (on_host2)."""
    np = job["np"]
    before = wait_progress(job, lambda p: len(p) == np and min(r for r, _, _ in p.values()) >= 1,
                           300, "every rank done a round")
    job["moving"] = {rank: pid for rank, (_, host, pid) in before.items()
                     if host == f"host{MOVING}"}
    check(sorted(job["moving"]) == job["on_host2"],
          f"job {job['name']}: ranks not on host2 as asked", before)
    on_host2(job)


def on_host2(job):
    """The daemon (orted, hydra_pmi_proxy) of `job`'s ranks on host2
    (job["moving"]), without the shim, and the address its connection to
    mpirun (mpiexec) is on, which must be a lease of host2's pool."""
    daemon = DAEMONS[job.setdefault("launcher", "openmpi")]
    parents = {int(run_ok(MOVING, f"ps -o ppid= -p {pid}").out) for pid in job["moving"].values()}
    check(len(parents) == 1, f"job {job['name']}: host2's ranks have more than one parent",
          parents)
    orted = parents.pop()
    check(run_ok(MOVING, f"cat /proc/{orted}/comm").out.strip() == daemon,
          f"job {job['name']}: host2's ranks are not {daemon}'s children")
    check(LAB.run(MOVING, f"grep -q librdmavirt /proc/{orted}/maps").rc != 0,
          f"{daemon} runs under the shim: the shim's setting reached more than the ranks")
    # (a lease of an earlier job may still wait out its idle minute beside it)
    ss = run_ok(MOVING, "ss -Htnp state established").out
    local = {line.split()[2].rsplit(":", 1)[0] for line in ss.splitlines()
             if f"pid={orted}," in line}
    lease = [a for a in leases(MOVING) if a in local]
    check(len(lease) == 1 and f"{lease[0]}/24" in mpi.pool(MOVING),
          f"job {job['name']}: {daemon}'s connection to mpirun is not on a lease of host2's pool",
          local, leases(MOVING))
    job["orted"] = orted
    job["lease"] = lease[0]
    ranks = sorted(job["moving"].values())
    job["tree"] = (f"pid {orted} ({daemon}'s job tree: ranks {', '.join(map(str, ranks))}; "
                   f"with {lease[0]}/24)")


def drain_while_running(jobs):
    for job in jobs:
        started_on_host2(job)
    at_move = drain_host2(jobs, mpi.rank_progress)
    for job in jobs:
        mark = at_move[job["name"]]
        after = wait_progress(
            job, lambda p: all(p[k][0] >= mark[k][0] + 1 for k in mark) and
            all(p[k][1] == f"host{DEST}" for k in job["moving"]),
            600, "every rank done a round more, host2's on host3")
        print(f"job {job['name']}: progress when moved: {mark}, later: {after}", flush=True)
    for job in jobs:
        run_ok(1, f"touch {job['stop']}")
    for job in jobs:
        ended(job, LAB.wait(1, job["handle"], 900))
    host2_left(jobs)


def drain_host2(jobs, progress):
    """host2 drained while `jobs` run (on_host2 done for each): each
    job's orted tree moved as one, with its lease (moved_tree); returns
    {job name: progress(LAB, job["progress"]) once its tree moved}."""
    check(len({j["lease"] for j in jobs}) == len(jobs), "two jobs' daemons share an address",
          [j["lease"] for j in jobs])
    # host2 drained as an operator would: the ranks found under the shim
    # move with their orted's tree, each job's as one, with the service
    # address its orted's connection to mpirun is on, which nobody names.
    # One pre-copy round (each costs this test half a minute): the release
    # then leaves out of the final dump the registered pages that round
    # holds unchanged (most of UCX's), and the report must say so.
    dest = f"{migration_tests.ip(DEST)}:{migration_tests.PORT}"
    drain = f"drain --connect none --to-migrator {dest} --max-precopy 1"
    r, plan = migration_tests.ctl(MOVING, f"{drain} --dry-run", 120)
    trees = sorted(f"{j['tree']} -> {dest}" for j in jobs)
    check(r.rc == 0 and plan is not None and sorted(plan.get("plan", [])) == trees,
          "drain --dry-run does not plan each job's orted tree on host2 as one", trees, r)
    r, drained = migration_tests.ctl(MOVING, drain, 2400)
    check(r.rc == 0 and drained is not None and drained.get("ok") and
          len(drained.get("processes", [])) == len(jobs),
          "drain of host2 did not move each job's orted tree as one", r)
    reports = {int(rep.get("tree_root", 0)): rep for rep in drained["processes"]}
    at_move = {}
    for job in jobs:
        rep = reports.get(job["orted"])
        check(rep is not None, f"job {job['name']}: no move of its orted tree", drained)
        moved_tree(job, rep)
        at_move[job["name"]] = progress(LAB, job["progress"])
    return at_move


def host2_left(jobs):
    """Nothing of `jobs` (their daemons and ranks) left on host2, nor any
    lease of theirs."""
    pids = [str(p) for j in jobs for p in [j["orted"]] + list(j["moving"].values())]
    left = [p for p in pids if LAB.run(MOVING, f"kill -0 {p}").rc == 0]
    check(not left, "a part of a job is left on host2", left)
    check(LAB.run(MOVING, "pgrep -x 'orted|hydra_pmi_proxy|mpi_verify|xdlu'").rc != 0,
          "a daemon or rank of an MPI job is left on host2")
    # host2's next daemon start (here: a collection) drops the leases whose
    # addresses left with their daemons.
    run_ok(MOVING, "/usr/local/lib/rdmavirt/rdmavirt-mpi-orted --gc")
    left = [j["lease"] for j in jobs if j["lease"] in leases(MOVING)]
    check(not left, "host2 still holds leases of addresses that left it", left)


def moved_tree(job, rep):
    """The report of the move of `job`'s tree, and where its parts are."""
    name = job["name"]
    migration_tests.check_report(rep, f"drain of host2's orted tree of job {name}")
    check(rep.get("addresses") == [f"{job['lease']}/24"],
          f"job {name}: the drain moved orted's tree without its address", rep)
    unchanged = int(rep.get("registered_pages_unchanged", 0))
    marked = int(rep.get("registered_pages_marked", 0))
    check(unchanged > marked, f"job {name}: the release marked most registered pages for the "
          "final dump, though the pre-copy had sent them", rep)
    parts = [("orted", job["orted"])] + [(f"rank {k}", v) for k, v in job["moving"].items()]
    for what, pid in parts:
        check(LAB.run(DEST, f"kill -0 {pid}").rc == 0, f"job {name}: {what} does not run on host3")
        check(LAB.run(MOVING, f"kill -0 {pid}").rc != 0, f"job {name}: {what} still on host2")
    address = f"{job['lease']}/32"
    check(LAB.run(DEST, f"ip -o addr show to {address} | grep -q .").rc == 0 and
          LAB.run(MOVING, f"ip -o addr show to {address} | grep -q .").rc != 0,
          f"job {name}: {job['lease']} did not move from host2 to host3 with orted")
    b = rep["breakdown"]
    print(f"job {name}: registered pages: {marked} in the final dump, {unchanged} held unchanged "
          f"from the pre-copy; final dump {int(rep.get('final_bytes', 0)) / 2**20:.0f} MiB; "
          f"blackout {int(b['blackout_us']) / 1e6:.1f} s, reconnect "
          f"{int(b['reconnect_us']) / 1e6:.1f} s, whole move {int(b['total_us']) / 1e6:.1f} s",
          flush=True)


def ended(job, result):
    """`job`'s end: exit 0 and its verdict."""
    name = job["name"]
    lines = [l for l in result.out.splitlines() if l.startswith("{")]
    check(result.rc == 0 and len(lines) == 1, f"job {name} failed after the move", result)
    v = json.loads(lines[0])
    check(v["verdict"] == "ok" and v["errors"] == 0, f"job {name}: corrupt data after the move", v)
    check(v["hosts"] == job["ends_on"], f"job {name}: the ranks did not end where they should", v)
    check(v["shimmed_ranks"] == job["np"], f"job {name}: not every rank had the shim", v)
    # UCX removes its fds from its epoll set at the end: the fds the
    # release closed must be back in it (shim/migration/epoll_regs.h).
    epoll = re.findall(r".*epoll_ctl.*", result.out + result.err)
    check(not epoll, f"job {name}: UCX's epoll set lost fds across the move", epoll[:3])
    print(f"job {name}: {v['rounds']} rounds, {v['bytes_verified']} bytes verified, "
          f"{v['seconds']:.0f} s; longest round per rank {v['longest_round_seconds']} s",
          flush=True)


# ScaLAPACK's own test of its LU solver (Debian's scalapack-mpi-test:
# xdlu, built against Open MPI), an MPI program nobody here wrote. For
# each problem of its input file, LU.dat, it spreads a random matrix over
# a grid of the ranks, factors it (PDGETRF), solves (PDGETRS), refines
# the solution and estimates the condition (PDGERFS, PDGECON), checks the
# residual itself and prints PASSED or FAILED for that problem; it ends
# with a count of each and "END OF TESTS.". The problems below, LU_TOTAL
# of them on two grids of the 4 ranks, take about 10 minutes on TCG hosts
# (15 to 25 s each at orders 40 and 80): the drain, begun after the 4th,
# is done by about the 10th.
SCALAPACK = "/usr/lib/x86_64-linux-gnu/scalapack/openmpi-tests/xdlu"
LU_DIR = f"{MOVE_DIR}/scalapack"  # the job's directory: LU.dat, and its output
LU_SIZES = [40, 80, 120]
LU_BLOCKS = [8, 32]
LU_RHS = [1, 4]
LU_GRIDS = [(2, 2), (1, 4)]
LU_TOTAL = len(LU_SIZES) * len(LU_BLOCKS) * len(LU_RHS) * len(LU_GRIDS)


def lu_input():
    """LU.dat, in the layout of /usr/share/scalapack/LU.dat: each value's
    line, then what it is (xdlu reads the first fields of each line)."""
    def row(values, what):
        return f"{' '.join(map(str, values)):<23} {what}"
    return "\n".join([
        "'ScaLAPACK LU factorization, moved mid-run'", "'rdmavirt lab'",
        "'LU.out'                output file name (if any)",
        row([6], "device out"),
        row([len(LU_SIZES)], "number of problems sizes"),
        row(LU_SIZES, "values of M"), row(LU_SIZES, "values of N"),
        row([len(LU_BLOCKS)], "number of NB's"), row(LU_BLOCKS, "values of NB"),
        row([len(LU_RHS)], "number of NRHS's"), row(LU_RHS, "values of NRHS"),
        row([1], "Number of NBRHS's"), row([4], "values of NBRHS"),
        row([len(LU_GRIDS)], "number of process grids (ordered pairs of P & Q)"),
        row([p for p, _ in LU_GRIDS], "values of P"), row([q for _, q in LU_GRIDS], "values of Q"),
        row(["1.0"], "threshold"),
        row(["T"], "(T or F) Test Cond. Est. and Iter. Ref. Routines"), ""])


def lu_output(lab, directory):
    try:
        with open(os.path.join(lab.shared, directory[len("/lab/"):], "xdlu.out")) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def lu_checked(lab, directory):
    """The verdicts of the problems xdlu has checked so far, in order."""
    return re.findall(r"^WALL .* (PASSED|FAILED)\s*$", lu_output(lab, directory), re.M)


@lab_test
def scalapack_checks_its_own_results_after_a_host_of_it_is_moved():
    """ScaLAPACK's xdlu with 4 ranks (host1: rank 0 and mpirun; host2:
    orted, ranks 1 and 2; host3: orted, rank 3), started with the stock
    mpirun on hosts set up by `rdmavirt-install host --mpi`. Once it has
    checked its first problems, host2 is drained: its orted tree moves to
    host3 as one, and xdlu goes on there to its last problem, each
    solution checked by xdlu itself."""
    hosts = [1, 2, 3]
    migrators.daemons_up()
    mpi.stop_job(LAB, hosts)
    local = os.path.join(LAB.shared, LU_DIR[len("/lab/"):])
    shutil.rmtree(local, ignore_errors=True)
    os.makedirs(local)
    with open(os.path.join(local, "LU.dat"), "w") as f:
        f.write(lu_input())
    job = {"name": "xdlu", "np": 4, "progress": LU_DIR}
    try:
        mpi.install_mpi(LAB, BUILD, hosts, migrators.SOCK, UCX_TUNING)
        script = mpi.stock_script({1: 1, 2: 2, 3: 1}, 4, [SCALAPACK], timeout=1500)
        job["handle"] = LAB.submit(1, f"cd {LU_DIR} && {script} > xdlu.out 2>&1", 1550)
        try:
            held, _ = mpi.wait_progress(LAB, LU_DIR, lambda checked: len(checked) >= 4, 300,
                                        job=job["handle"], progress=lu_checked)
            check(held, "xdlu did not check its first problems in 300 s",
                  lu_output(LAB, LU_DIR)[-2000:])
            job["moving"] = ranks_on(MOVING, "xdlu")
            check(sorted(job["moving"]) == [1, 2], "xdlu's ranks 1 and 2 are not on host2",
                  job["moving"])
            on_host2(job)
            at_move = drain_host2([job], lu_checked)["xdlu"]
            result = LAB.wait(1, job["handle"], 1500)
        finally:
            LAB.kill(1, job["handle"])
        out = lu_output(LAB, LU_DIR)
        checked = lu_checked(LAB, LU_DIR)
        print(f"xdlu: {len(at_move)} of its {len(checked)} problems checked when moved; "
              f"exit {result.rc}", flush=True)
        check(result.rc == 0 and "END OF TESTS." in out, "xdlu did not end", result, out[-3000:])
        check(len(at_move) < LU_TOTAL, "xdlu had checked its last problem when moved", at_move)
        lu_passed(out, checked)
        host2_left([job])
    finally:
        mpi.stop_job(LAB, hosts)
        mpi.uninstall_mpi(LAB, hosts)


def ranks_on(n, program):
    """{MPI rank: pid} of `program`'s processes on hostN (Open MPI's
    OMPI_COMM_WORLD_RANK in each one's environment)."""
    ranks = {}
    for pid in map(int, run_ok(n, f"pgrep -x {program}").out.split()):
        env = run_ok(n, f"tr '\\0' '\\n' < /proc/{pid}/environ").out
        rank = re.search(r"^OMPI_COMM_WORLD_RANK=(\d+)$", env, re.M)
        check(rank is not None, f"{program} {pid} on host{n} names no rank", env[-500:])
        ranks[int(rank.group(1))] = pid
    return ranks


def lu_passed(out, checked):
    """xdlu's own verdicts in its output `out`: every problem of LU.dat
    checked and passed (none skipped as illegal input)."""
    check(len(checked) == LU_TOTAL and set(checked) == {"PASSED"},
          f"xdlu did not pass all {LU_TOTAL} problems", checked.count("PASSED"),
          checked.count("FAILED"), out[-3000:])
    summary = re.search(r"Finished\s+(\d+) tests.*?\n\s+(\d+) tests completed and passed.*?\n"
                        r"\s+(\d+) tests completed and failed.*?\n\s+(\d+) tests skipped", out)
    check(summary is not None and [int(g) for g in summary.groups()] == [LU_TOTAL, LU_TOTAL, 0, 0],
          "xdlu's summary does not say every problem passed", out[-1500:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
