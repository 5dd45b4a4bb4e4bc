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


def mpirun(np, program, shim, timeout=300):
    """Runs the job from host1; returns (result, packets rxe0 carried on
    each host meanwhile)."""
    r, packets = mpi.run_job(LAB, HOSTS, np, program, shim=shim, build=BUILD, timeout=timeout)
    return r, {n: sent + rcvd for n, (sent, rcvd) in packets.items()}


def verdict(r):
    lines = [l for l in r.out.splitlines() if l.startswith("{")]
    check(len(lines) == 1, "mpi_verify printed no verdict", r)
    return json.loads(lines[0])


def verify_job(shim):
    """Four ranks, two per host: shared memory within a host, RC over
    rxe0 between them; every byte checked by the program itself."""
    r, packets = mpirun(4, [VERIFY, "--rounds", "2", "--max-bytes", "262144"], shim)
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
    return v


def both_agree(shim):
    native = verify_job("none")
    shimmed = verify_job(shim)
    check(shimmed["bytes_verified"] == native["bytes_verified"],
          "the shim changed what the job did", native, shimmed)


@lab_test
def mpi_job_verifies_every_byte_natively_and_under_the_shim():
    both_agree("default")


@lab_test
def mpi_job_verifies_every_byte_under_the_shim_in_offset_mode():
    verify_job("offset")


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


def wait_progress(condition, timeout, what):
    """Until condition(progress) holds; the last progress seen."""
    held, seen = mpi.wait_progress(LAB, f"{MOVE_DIR}/progress", condition, timeout)
    check(held, f"{what}: not after {timeout}s", seen)
    return seen


def leases(n):
    """hostN's leased service addresses (rdmavirt-mpi-orted --list)."""
    r = run_ok(n, "/usr/local/lib/rdmavirt/rdmavirt-mpi-orted --list")
    return [line.split()[0] for line in r.out.splitlines() if line.strip()]


@lab_test
def an_mpi_job_runs_to_its_end_while_a_host_of_it_is_moved():
    """Hosts set up by `rdmavirt-install host --mpi` (and mpi.conf's
    addresses), the user's stock mpirun: 4 ranks of mpi_verify on 3 hosts
    (host1: mpirun and rank 0; host2: orted, ranks 1 and 2; host3: orted,
    rank 3), every rank under the shim through Open MPI's own settings,
    orted without it. While it runs, host2 is drained (rdmavirtctl drain),
    which moves its orted tree to host3 as one, with the service address
    rdmavirt-mpi-orted leased it; the ranks' terminals, which host3's own
    orted holds the numbers of, are renumbered by the restore. The ranks
    must go on there (their progress names host3 and advances), the job
    must end with every byte verified, and nothing of it may be left on
    host2. Neither the ranks nor mpirun know of the move."""
    hosts = [1, 2, 3]
    migrators.daemons_up()
    mpi.stop_job(LAB, hosts)
    local = os.path.join(LAB.shared, "mpi-move")
    shutil.rmtree(local, ignore_errors=True)
    os.makedirs(os.path.join(local, "progress"))
    try:
        installed = mpi.install_mpi(LAB, BUILD, hosts, migrators.SOCK, UCX_TUNING)
        for n, out in installed.items():
            check("configuring /etc/openmpi/openmpi-mca-params.conf" in out and
                  "configuring /etc/ucx/ucx.conf" in out and "done: host, with MPI" in out,
                  f"host{n}: rdmavirt-install --mpi did not configure Open MPI and UCX", out)
        moved_job(hosts)
    finally:
        mpi.stop_job(LAB, hosts)
        mpi.uninstall_mpi(LAB, hosts)


def moved_job(hosts):
    stop = f"{MOVE_DIR}/stop"
    script = mpi.stock_script(
        {1: 1, 2: 2, 3: 1}, 4,
        [VERIFY, "--rounds", "3", "--until-file", stop, "--seconds", "1800",
         "--max-bytes", "262144", "--progress", f"{MOVE_DIR}/progress"], timeout=2000)
    job = LAB.submit(1, f"cd /tmp && {script}", 2100)
    try:
        # A round done before the move and one after it (each a full
        # exchange of every size, verified) show the job running across it.
        before = wait_progress(lambda p: len(p) == 4 and min(r for r, _, _ in p.values()) >= 1,
                               300, "every rank done a round")
        moving = {rank: pid for rank, (_, host, pid) in before.items()
                  if host == f"host{MOVING}"}
        check(sorted(moving) == [1, 2], "ranks 1 and 2 are not on host2", before)
        orted = int(run_ok(MOVING, "pgrep -x orted").out.split()[0])
        check(LAB.run(MOVING, f"grep -q librdmavirt /proc/{orted}/maps").rc != 0,
              "orted runs under the shim: the shim's setting reached more than the ranks")
        # orted's connection to mpirun is on an address of host2's pool,
        # leased to it (a lease of an earlier job may still wait out its
        # idle minute beside it).
        ss = run_ok(MOVING, "ss -Htnp state established").out
        local = {line.split()[2].rsplit(":", 1)[0] for line in ss.splitlines()
                 if f"pid={orted}," in line}
        lease = [a for a in leases(MOVING) if a in local]
        check(len(lease) == 1 and f"{lease[0]}/24" in mpi.pool(MOVING),
              "orted's connection to mpirun is not on an address leased from host2's pool",
              local, leases(MOVING))
        service = f"{lease[0]}/24"
        # host2 drained as an operator would: the ranks found under the
        # shim move with their orted's tree, as one, with the service
        # address orted's connection to mpirun is on, which nobody names.
        # One pre-copy round (each costs this test half a minute): the
        # release then leaves out of the final dump the registered pages
        # that round holds unchanged (most of UCX's), and the report must
        # say so.
        dest = f"{migration_tests.ip(DEST)}:{migration_tests.PORT}"
        drain = (f"drain --connect none --to qemu+tcp://{migration_tests.ip(DEST)}/system "
                 f"--to-migrator {dest} --max-precopy 1")
        r, plan = migration_tests.ctl(MOVING, f"{drain} --dry-run", 120)
        tree = (f"pid {orted} (orted's job tree: ranks {min(moving.values())}, "
                f"{max(moving.values())}; with {service}) -> {dest}")
        check(r.rc == 0 and plan is not None and plan.get("plan") == [tree],
              "drain --dry-run does not plan host2's orted tree as one", tree, r)
        r, drained = migration_tests.ctl(MOVING, drain, 1800)
        check(r.rc == 0 and drained is not None and drained.get("ok") and
              len(drained.get("processes", [])) == 1,
              "drain of host2 did not move its orted tree as one", r)
        rep = drained["processes"][0]
        migration_tests.check_report(rep, "drain of host2's orted tree")
        check(rep.get("tree_root") == orted and rep.get("addresses") == [service],
              "the drain moved something else than orted's tree with its address", rep)
        unchanged = int(rep.get("registered_pages_unchanged", 0))
        marked = int(rep.get("registered_pages_marked", 0))
        check(unchanged > marked, "the release marked most registered pages for the final "
              "dump, though the pre-copy had sent them", rep)
        for what, pid in [("orted", orted)] + [(f"rank {k}", v) for k, v in moving.items()]:
            check(LAB.run(DEST, f"kill -0 {pid}").rc == 0, f"{what} does not run on host3")
            check(LAB.run(MOVING, f"kill -0 {pid}").rc != 0, f"{what} still exists on host2")
        check(LAB.run(DEST, f"ip -o addr show to {lease[0]}/32 | grep -q .").rc == 0 and
              LAB.run(MOVING, f"ip -o addr show to {lease[0]}/32 | grep -q .").rc != 0,
              f"{service} did not move from host2 to host3 with orted")
        at_move = mpi.rank_progress(LAB, f"{MOVE_DIR}/progress")
        after = wait_progress(
            lambda p: all(p[k][0] >= at_move[k][0] + 1 for k in at_move) and
            all(p[k][1] == f"host{DEST}" for k in moving),
            600, "every rank done a round more, ranks 1 and 2 on host3")
        print("progress when moved:", at_move, "later:", after, flush=True)
        run_ok(1, f"touch {stop}")
        result = LAB.wait(1, job, 900)
        lines = [l for l in result.out.splitlines() if l.startswith("{")]
        check(result.rc == 0 and len(lines) == 1, "the job failed after the move", result)
        v = json.loads(lines[0])
        check(v["verdict"] == "ok" and v["errors"] == 0, "corrupt data after the move", v)
        check(v["hosts"] == ["host1", "host3", "host3", "host3"],
              "the ranks did not end where they should", v)
        check(v["shimmed_ranks"] == 4, "not every rank had the shim", v)
        # UCX removes its fds from its epoll set at the end: the fds the
        # release closed must be back in it (shim/migration/epoll_regs.h).
        epoll = re.findall(r".*epoll_ctl.*", result.out + result.err)
        check(not epoll, "UCX's epoll set lost fds across the move", epoll[:3])
        check(LAB.run(MOVING, "pgrep -x 'orted|mpi_verify'").rc != 0,
              "a part of the job is left on host2")
        # host2's next daemon start (here: a collection) drops the lease
        # whose address left with its daemon.
        run_ok(MOVING, "/usr/local/lib/rdmavirt/rdmavirt-mpi-orted --gc")
        check(lease[0] not in leases(MOVING),
              "host2 still holds the lease of the address that left it", leases(MOVING))
        b = rep["breakdown"]
        print(f"registered pages: {marked} in the final dump, {unchanged} held unchanged from "
              f"the pre-copy; final dump {int(rep.get('final_bytes', 0)) / 2**20:.0f} MiB",
              flush=True)
        print(f"moved: blackout {int(b['blackout_us']) / 1e6:.1f} s, reconnect "
              f"{int(b['reconnect_us']) / 1e6:.1f} s, whole move {int(b['total_us']) / 1e6:.1f} s; "
              f"job: {v['rounds']} rounds, {v['bytes_verified']} bytes verified, "
              f"{v['seconds']:.0f} s; longest round per rank {v['longest_round_seconds']} s",
              flush=True)
    finally:
        LAB.kill(1, job)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
