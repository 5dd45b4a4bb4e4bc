"""CRIU through the migrator's driver (migrator/criu/criu_driver.h) and image
directories (migrator/criu/image_dir.h), driven by rdmavirt-criu-probe in the lab:
pre-copy iterations and a move to a host that shares no image directory,
tampered images refused, a dump that leaves the process running, file
locks dumped and taken again."""

import json
import os
import shlex
import shutil
import sys
import time

from labtest import BUILD, LAB, Failure, check, lab_test, main, run_ok, wait_until

PROBE_BUILT = os.path.join(BUILD, "migrator", "rdmavirt-criu-probe")
# The probe is copied to the lab share by each test: the hosts see the
# machine's / through an overlay that may hold a stale copy of a binary
# built after the lab booted.
PROBE = "/lab/criu/bin/rdmavirt-criu-probe"

# A counter holding 16 MiB of touched memory, writing its progress to the
# lab share (by rename, no file open between writes) and a line per tick to
# stdout, a regular file on 9p it keeps open. Each tick dirties one page.
COUNTER = r"""
import os, sys, time
d = sys.argv[1]
mem = bytearray(16 << 20)
for i in range(0, len(mem), 4096):
    mem[i] = 1
n = 0
while True:
    with open(os.path.join(d, "count.tmp"), "w") as f:
        f.write(str(n))
    os.rename(os.path.join(d, "count.tmp"), os.path.join(d, "count"))
    print(n, flush=True)
    mem[(n * 4096) % len(mem)] = n & 0xff
    n += 1
    time.sleep(0.2)
"""


def install_probe():
    check(os.path.exists(PROBE_BUILT), f"{PROBE_BUILT} not built "
          "(cmake --build BUILD --target rdmavirt-criu-probe)")
    bindir = os.path.join(LAB.shared, "criu", "bin")
    os.makedirs(bindir, exist_ok=True)
    tmp = os.path.join(bindir, ".probe.tmp")
    shutil.copy2(PROBE_BUILT, tmp)
    os.replace(tmp, os.path.join(bindir, "rdmavirt-criu-probe"))


def probe(host, args, timeout=300, ok=True):
    """Runs the probe on a host; returns its JSON result."""
    t0 = time.monotonic()
    r = LAB.run(host, f"{PROBE} --log-dir /tmp/criu-logs {args}", timeout)
    print(f"  host{host}: probe {args.split()[0]}: {time.monotonic() - t0:.1f}s", flush=True)
    try:
        out = json.loads(r.out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Failure(f"host{host}: probe {args}: no JSON result\n  {r!r}")
    if ok:
        check(r.rc == 0 and out.get("ok"), f"host{host}: probe {args} failed", out)
    else:
        check(r.rc == 1 and not out.get("ok"), f"host{host}: probe {args} did not fail", out)
    return out


def start(host, work, program):
    """Starts `program` (shell words) as a session leader with stdio on
    files, as the endpoints we dump run; returns its pid. fd 9 is the lab
    agent's, not the program's."""
    run_ok(host, f"rm -rf {work} && mkdir -p {work}")
    run_ok(host, f"cd {work}; setsid {program} < /dev/null > {work}/out.log 2>&1 9>&- &"
                 f" echo $! > {work}/pid")
    return int(open(LAB.shared + work[len("/lab"):] + "/pid").read())


def count(work):
    try:
        return int(open(LAB.shared + work[len("/lab"):] + "/count").read() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def session(host, pid):
    """(ppid, sid) of pid on host."""
    r = run_ok(host, f"ps -o ppid=,sid= -p {pid}")
    ppid, sid = r.out.split()
    return int(ppid), int(sid)


@lab_test
def criu_probe_checks_and_reports_errors():
    install_probe()
    for n in (1, 2):
        probe(n, "check", 180)
    out = probe(1, "dump 999999 /tmp/criu-none", ok=False)
    check(out["code"] == "NOT_FOUND", "a missing pid is not NOT_FOUND", out)
    out = probe(1, "restore /tmp/criu-none", ok=False)
    check(out["code"] == "NOT_FOUND", "a missing images dir is not NOT_FOUND", out)


@lab_test
def criu_precopy_moves_a_process_without_shared_images():
    install_probe()
    work = "/lab/criu/move"
    open(os.path.join(LAB.shared, "criu", "counter.py"), "w").write(COUNTER)
    t0 = time.monotonic()
    pid = start(1, work, f"python3 /lab/criu/counter.py {work}")
    try:
        wait_until(1, f"[ \"$(cat {work}/count 2>/dev/null)\" -ge 3 ] 2>/dev/null", 120,
                   "counter running")
        print(f"  host1: counter started: {time.monotonic() - t0:.1f}s", flush=True)
        run_ok(1, "rm -rf /tmp/criu-move")
        img = "/tmp/criu-move"
        pre1 = probe(1, f"predump {pid} {img}/pre-1")
        pre2 = probe(1, f"predump {pid} {img}/pre-2 {img}/pre-1")
        final = probe(1, f"dump {pid} {img}/final {img}/pre-2")
        check(LAB.run(1, f"kill -0 {pid}").rc != 0, "process still runs on host1 after dump")
        print(f"pre-dump 1: {pre1['image_bytes']} bytes in {pre1['elapsed_us'] / 1e6:.2f}s; "
              f"pre-dump 2: {pre2['image_bytes']} bytes in {pre2['elapsed_us'] / 1e6:.2f}s; "
              f"final dump: {final['image_bytes']} bytes in {final['elapsed_us'] / 1e6:.2f}s")
        check(pre1["image_bytes"] >= 16 << 20, "first pre-dump smaller than the touched memory",
              pre1)
        # Without memory tracking the final dump would hold all 16 MiB again;
        # with it, the counter's page and what the interpreter dirtied in
        # between (megabytes, on a loaded machine).
        check(final["image_bytes"] * 2 < pre1["image_bytes"],
              "final dump not far smaller than the first pre-dump (memory tracking?)",
              pre1, final)

        # Source: a manifest per iteration, then only the files it lists
        # go to the share (what the migrator streams: regular files, no
        # CRIU parent links).
        xfer = f"{work}/xfer"
        copies = [f"rm -rf {xfer}"]
        for d in ("pre-1", "pre-2", "final"):
            m = probe(1, f"manifest {img}/{d}")
            names = [f["name"] for f in m["files"]] + ["manifest.pb"]
            check(not any(n == "parent" for n in names), "manifest lists CRIU's parent link", m)
            for name in names:
                dst = f"{xfer}/{d}/{name}"
                copies.append(f"mkdir -p {shlex.quote(os.path.dirname(dst))} && dd "
                              f"if={shlex.quote(f'{img}/{d}/{name}')} of={shlex.quote(dst)} "
                              "bs=4M status=none")
        t0 = time.monotonic()
        run_ok(1, " && ".join(copies), 300)
        print(f"  host1: images to the share: {time.monotonic() - t0:.1f}s", flush=True)

        # Destination: its own copy, verified, restored.
        t0 = time.monotonic()
        run_ok(2, f"rm -rf {img} && mkdir -p {img} && cp -r {xfer}/. {img}/ && "
                  f"! test -e {img}/final/parent", 300)
        print(f"  host2: images from the share: {time.monotonic() - t0:.1f}s", flush=True)
        for d in ("pre-1", "pre-2", "final"):
            probe(2, f"verify {img}/{d}")
        before = count(work)
        restored = probe(2, f"restore {img}/final")
        print(f"restore: {restored['elapsed_us'] / 1e6:.2f}s")
        check(restored["pid"] == pid, "restored under another pid", restored)
        # Detached: re-parented away from the probe, its own session, and
        # still counting after the job that restored it is gone.
        ppid, sid = session(2, pid)
        check(ppid == 1 and sid == pid, f"restored process not detached (ppid {ppid}, sid {sid})")
        wait_until(2, f"[ \"$(cat {work}/count)\" -ge {before + 5} ]", 60,
                   "counter advancing on host2")
        run_ok(2, f"test -L {img}/final/parent && test -L {img}/pre-2/parent")
    finally:
        LAB.run(1, f"kill {pid}")
        LAB.run(2, f"kill {pid}")
        LAB.run(1, "rm -rf /tmp/criu-move")
        LAB.run(2, "rm -rf /tmp/criu-move")


@lab_test
def criu_tampered_images_are_refused():
    install_probe()
    work = "/lab/criu/tamper"
    pid = start(1, work, "bash -c 'i=0; while :; do echo $i; i=$((i+1)); sleep 0.2; done'")
    img = "/tmp/criu-tamper/img"
    try:
        run_ok(1, "rm -rf /tmp/criu-tamper; sleep 1")
        probe(1, f"dump {pid} {img}")
        # Flipped and cut files are refused by the manifest check before
        # CRIU sees them (image_dir_test; migrator_tests: a corrupted
        # checkpoint; CRIU itself hangs on a cut pages file). Here: CRIU on
        # an image that does not parse is DATA_LOSS too.
        run_ok(1, f"cp -r {img} {img}-badmap && truncate -s 10 {img}-badmap/pagemap-*.img")
        out = probe(1, f"restore {img}-badmap", ok=False)
        check(out["code"] == "DATA_LOSS", "CRIU's parse error not DATA_LOSS", out)
        # The intact images still restore.
        probe(1, f"restore {img}")
        run_ok(1, f"kill -0 {pid}")
    finally:
        LAB.run(1, f"kill {pid}")
        LAB.run(1, "rm -rf /tmp/criu-tamper")


# Holds an flock on the lab share and a POSIX lock on a local file, as
# daemons do with their pid files and databases. Its counter is one file
# kept open and rewritten in place at a fixed width: a temporary file
# renamed over it could be open at the dump and gone at the restore (CRIU
# then cannot reopen it), and CRIU checks an open file's size.
LOCKER = r"""
import fcntl, os, sys, time
d = sys.argv[1]
a = open(os.path.join(d, "lockfile"), "a")
fcntl.flock(a, fcntl.LOCK_EX)
b = open("/tmp/criu-locker", "a")
fcntl.lockf(b, fcntl.LOCK_EX)
c = os.open(os.path.join(d, "count"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
n = 0
while True:
    os.pwrite(c, b"%012d\n" % n, 0)
    n += 1
    time.sleep(0.2)
"""


@lab_test
def criu_dump_leaves_running_and_restores_file_locks():
    install_probe()
    work = "/lab/criu/locks"
    open(os.path.join(LAB.shared, "criu", "locker.py"), "w").write(LOCKER)
    pid = start(1, work, f"python3 /lab/criu/locker.py {work}")
    img = "/tmp/criu-locks/img"
    try:
        wait_until(1, f"[ \"$(cat {work}/count 2>/dev/null)\" -ge 3 ] 2>/dev/null", 120,
                   "locker running")

        def locks():
            return [ln for ln in run_ok(1, "cat /proc/locks").out.splitlines()
                    if f" {pid} " in ln]

        check(len(locks()) == 2, "the locker does not hold its two locks", locks())
        run_ok(1, "rm -rf /tmp/criu-locks")
        # A dump that leaves it running: it keeps counting and its locks.
        out = probe(1, f"dump {pid} {img} --leave-running")
        check(out["leave_running"], "dump did not leave the process running", out)
        n = count(work)
        wait_until(1, f"[ \"$(cat {work}/count)\" -ge {n + 5} ]", 60,
                   "locker advancing after a leave-running dump")
        check(len(locks()) == 2, "locks lost by a leave-running dump", locks())
        # Its pid is taken while it runs: ALREADY_EXISTS, and it keeps running.
        out = probe(1, f"restore {img}", ok=False)
        check(out["code"] == "ALREADY_EXISTS", "restore over a live pid not ALREADY_EXISTS", out)
        run_ok(1, f"kill -0 {pid}")
        # Once it is gone (and its locks with it), the dump brings both back.
        run_ok(1, f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.1; done")
        check(not locks(), "locks still held after the process is gone")
        out = probe(1, f"restore {img}")
        check(out["pid"] == pid, "restored under another pid", out)
        check(len(locks()) == 2, "locks not held again after the restore", locks())
        n = count(work)
        wait_until(1, f"[ \"$(cat {work}/count)\" -ge {n + 5} ]", 60,
                   "locker advancing after restore")
    finally:
        LAB.run(1, f"kill {pid}")
        LAB.run(1, "rm -rf /tmp/criu-locks /tmp/criu-locker")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
