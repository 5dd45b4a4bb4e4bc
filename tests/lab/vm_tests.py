"""RDMA guests under real libvirt: a drain, a live VM migration, snapshots of
two guests taken together and reverted, all with live connections; and the
destination hook refusing a host that cannot take them.

The VM lab (tools/lab/vmlab.py): two libvirt daemons on this machine, each
with its own rdmavirt-migratord and rdmavirt's qemu hook; TCG guests whose
RDMA NIC is a virtio NIC with Soft-RoCE on top, hot-unplugged and replaced
by a NIC of the destination (new MAC, new address, so a new GID) around
the migration. The integrity workload runs in two guests, unmodified,
under the shim; each guest runs its own migrator.
"""

import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "lab"))
import vmlab  # noqa: E402

from labtest import check, lab_test, main  # noqa: E402

LAB = vmlab.VmLab(os.environ.get("RDMAVIRT_VMLAB_DIR", vmlab.DEFAULT_DIR))
SHIM_ENV = ["LD_PRELOAD=/usr/local/lib/rdmavirt/librdmavirt.so",
            "PATH=/usr/local/bin:/usr/bin:/bin"]
INTEGRITY = "/usr/local/bin/integrity"


def where(name):
    """The host (1 or 2) that runs guest `name`, or None."""
    for h in (1, 2):
        if name in LAB.virsh(h, "list", "--name").stdout.split():
            return h
    return None


def guests_up():
    """guest1 and guest2 run (started on vmhost1 if they run nowhere);
    returns their hosts."""
    if LAB._state() is None:
        LAB.up()
    for n in (1, 2):
        if where(f"guest{n}") is None:
            LAB.start_guest(1, f"guest{n}", n)
        # Snapshots left by a failed run would stop libvirt migrating it.
        h = where(f"guest{n}")
        for snap in LAB.virsh(h, "snapshot-list", f"guest{n}", "--name").stdout.split():
            LAB.virsh(h, "snapshot-delete", f"guest{n}", snap)
    return where("guest1"), where("guest2")


def poll(fn, done, timeout):
    """fn()'s value as soon as done(value) holds, else its last one after
    `timeout` seconds (the caller checks it)."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if done(value) or time.monotonic() >= end:
            return value
        time.sleep(1)


def spawn_integrity(h, name, side, argv):
    """Starts integrity ARGV in guest `name` under the shim, its stdout (a
    progress line a second) into /tmp/`side`.out: the agent hands over
    what it captured only at the end. Its stderr stays captured. Returns
    the agent's pid (the program's: sh and env exec it; the shim is
    loaded by the program only)."""
    return LAB.guest_spawn(h, name, ["/bin/sh", "-c", f'exec env "$@" > /tmp/{side}.out', "sh"] +
                           SHIM_ENV + [INTEGRITY] + argv, SHIM_ENV[1:])


def check_running(h, name, side, pid):
    """Fails the test if `side`'s program (P or Q) has ended."""
    r = LAB.guest_status(h, name, pid)
    check(r is None, f"{side} ended early", r, guest_log(h, name, f"/tmp/{side.lower()}.out"))


def listening(h, name, port):
    """Whether a TCP socket listens on `port` in guest `name`."""
    tcp = LAB.guest_exec(h, name, ["/usr/bin/cat", "/proc/net/tcp"], timeout=20)["out"]
    return any(len(f) > 3 and f[1].endswith(f":{port:04X}") and f[3] == "0A"
               for f in (line.split() for line in tcp.splitlines()[1:]))


def sent(h, name, side="p"):
    """The SENDs `side` (p or q) posted, from its last progress line."""
    out = LAB.guest_exec(h, name, ["/usr/bin/tail", "-c", "2000", f"/tmp/{side}.out"],
                         timeout=20)["out"]
    found = re.findall(r"^integrity: t=\d+s sent=(\d+)\b", out, re.M)
    return int(found[-1]) if found else 0


def wait_sent(h, pid, at_least, timeout=300):
    """Until P (in guest1 on vmhost`h`) has posted `at_least` SENDs:
    traffic flows. The guests are TCG: slow."""
    def posted():
        check_running(h, "guest1", "P", pid)
        return sent(h, "guest1")
    n = poll(posted, lambda n: n >= at_least, timeout)
    check(n >= at_least, f"P posted {n} SENDs in {timeout}s, not {at_least}",
          guest_log(h, "guest1", "/tmp/p.out")[-500:])
    return n


# In guest1: once it exists, P stops (and Q with it) where it is
# (integrity --until-file).
STOP = "/tmp/stop"


def start_workload(iterations, hp, hq):
    """Q (server) in guest2 on vmhost`hq`, P (client) in guest1 on
    vmhost`hp`, once Q listens; returns their agent pids. The workload runs
    `iterations` long unless stop_workload() ends it sooner."""
    LAB.guest_exec(hp, "guest1", ["/usr/bin/busybox", "rm", "-f", STOP], timeout=20)
    # rdmavirt-guest names a NIC's Soft-RoCE device after it.
    args = ["--iterations", str(iterations), "--ud-lost-after", "1800", "--port", "18900",
            "--device", "rxe_eth0", "--until-file", STOP]
    q = spawn_integrity(hq, "guest2", "q", ["--server"] + args + ["--report", "/tmp/q.json"])

    def q_listens():
        check_running(hq, "guest2", "Q", q)
        return listening(hq, "guest2", 18900)
    check(poll(q_listens, bool, 120), "Q does not listen on port 18900 after 120s",
          guest_log(hq, "guest2", "/tmp/q.out"))
    p = spawn_integrity(hp, "guest1", "p", ["--connect", LAB.guest_ip(hq, "guest2")] + args +
                        ["--report", "/tmp/p.json"])
    return p, q


def check_integrity(side, r, h, name, path):
    check(r["exitcode"] == 0, f"{side} exited {r['exitcode']}", r["err"][-2000:], r["out"][-2000:])
    rep = json.loads(LAB.guest_exec(h, name, ["/usr/bin/cat", path], timeout=20)["out"])
    check(rep["ok"] and rep["lost"] == 0 and rep["duplicated"] == 0 and rep["corrupted"] == 0
          and rep["out_of_order"] == 0 and rep["completion_errors"] == 0
          and rep["sends"] == rep["iterations"], f"{side}'s integrity report", rep)
    return rep


def show_logs():
    for name in ("guest1", "guest2"):
        print(f"--- {name} console (end)\n{vmlab._tail(LAB.console(name), 3000)}", flush=True)
    for h in (1, 2):
        for f in ("migratord.log", "hook.log"):
            print(f"--- vmhost{h} {f} (end)\n"
                  f"{vmlab._tail(os.path.join(LAB.hdir(h), f), 2000)}", flush=True)


def guest_log(h, name, path):
    try:
        return LAB.guest_exec(h, name, ["/usr/bin/tail", "-c", "3000", path], timeout=20)["out"]
    except vmlab.VmLabError as e:
        return str(e)


def stop_workload(p):
    """Once P has posted 200 SENDs more (traffic flows where the guests run
    now), tells it to stop: Q learns of it from P."""
    h = where("guest1")
    wait_sent(h, p, sent(h, "guest1") + 200)
    LAB.guest_exec(h, "guest1", ["/usr/bin/busybox", "touch", STOP], timeout=20)


def check_workload(p, q):
    """Waits for P (guest1) and Q (guest2), wherever they run now."""
    pr = LAB.guest_wait(where("guest1"), "guest1", p, 900)
    qr = LAB.guest_wait(where("guest2"), "guest2", q, 300)
    for side, res, name in (("p", pr, "guest1"), ("q", qr, "guest2")):  # stdout: a file
        res["out"] = guest_log(where(name), name, f"/tmp/{side}.out")
    for side, res in (("P", pr), ("Q", qr)):  # what each side complained of
        if res["exitcode"] != 0 or res["err"]:
            print(f"--- {side} exited {res['exitcode']}; its stderr:\n{res['err'][-3000:]}",
                  flush=True)
    for side, res, name in (("P", pr, "guest1"), ("Q", qr, "guest2")):
        rep = check_integrity(side, res, where(name), name, f"/tmp/{side.lower()}.json")
        print(side, {k: rep[k] for k in ("sends", "lost", "duplicated", "corrupted")},
              flush=True)


def rdmavirtctl(h, *args, timeout=600):
    """rdmavirtctl --json ARGS with vmhost`h`'s certificates; (result, report)."""
    r = vmlab._run([LAB.ctl, "--tls-dir", LAB.tls(h), "--json"] + list(args), check=False,
                   timeout=timeout)
    print(r.stderr, flush=True)
    return r, (json.loads(r.stdout) if r.stdout.strip() else None)


def vm_logs_on_failure(fn):
    def run():
        try:
            fn()
        except BaseException:
            show_logs()
            for name in ("guest1", "guest2"):
                h = where(name)
                if h:
                    print(f"--- {name} migrator log\n"
                          f"{guest_log(h, name, '/var/log/rdmavirt-migratord.log')}", flush=True)
            raise
    run.__name__ = fn.__name__
    return run


def guest_status(name):
    """`rdmavirtctl status` of the migrator in guest `name`."""
    r = LAB.guest_exec(where(name), name, ["/usr/local/bin/rdmavirtctl", "--tls-dir",
                                           "/etc/rdmavirt/tls", "--json", "status"], timeout=60)
    check(r["exitcode"] == 0, f"rdmavirtctl status in {name}", r)
    return json.loads(r["out"])


def report_summary(rep):
    return json.dumps({k: v for k, v in rep.items() if k not in ("suspended", "resumed")})


@lab_test
@vm_logs_on_failure
def two_guests_keep_their_connections_through_drain_migration_snapshot_and_revert():
    """The integrity workload between guest1 and guest2 while: vmhost1 is
    drained (both guests live-migrate to vmhost2, one after the other),
    guest1 live-migrates back, its filesystems are frozen and thawed, both
    are snapshotted together (one on each host), the workload goes on past
    the snapshot, and both are reverted to it. P and Q end with nothing
    lost, duplicated or corrupted."""
    guests_up()
    for n in (1, 2):
        if where(f"guest{n}") != 1:  # left elsewhere by an earlier run
            LAB.virsh(where(f"guest{n}"), "destroy", f"guest{n}")
            LAB.start_guest(1, f"guest{n}", n)
    p, q = start_workload(6000, 1, 1)
    wait_sent(1, p, 200)  # connected, traffic flowing

    # Drain vmhost1: both guests (each the other's peer) to vmhost2.
    common = ["drain", "--connect", LAB.uri(1), "--to", LAB.uri(2), "--to-migrator",
              LAB.migrator(2), "--host", LAB.migrator(1), "--unsafe"]
    r, plan = rdmavirtctl(1, *common, "--dry-run")
    check(r.returncode == 0 and plan and plan["dry_run"], "drain --dry-run", r.stdout, r.stderr)
    check(sorted(x.split()[0] for x in plan.get("plan", [])) == ["guest1", "guest2"],
          "the plan", plan)
    check(where("guest1") == 1 and where("guest2") == 1, "--dry-run moved something")
    r, rep = rdmavirtctl(1, *common, "--migrate-uri", "tcp://127.0.0.1:49401")
    check(r.returncode == 0 and rep and rep["ok"], "drain vmhost1", r.stdout[-4000:],
          r.stderr[-2000:])
    check(len(rep.get("vms", [])) == 2 and all(v["ok"] for v in rep["vms"]),
          "not every guest moved", rep)
    for v in rep["vms"]:
        print(f"drained {v['domain']}: blackout {int(v['blackout_us']) / 1e6:.1f}s, "
              f"migrate {int(v['migrate_us']) / 1e6:.1f}s", flush=True)
    check(where("guest1") == 2 and where("guest2") == 2, "an RDMA guest is still on vmhost1")
    check(LAB.guest_status(2, "guest1", p) is None, "P ended during the drain")

    # guest1 back to vmhost1, live, with a NIC of vmhost1 (a new GID).
    r, rep = rdmavirtctl(2, "vm-migrate", "guest1", "--connect", LAB.uri(2),
                         "--to", LAB.uri(1), "--to-migrator", LAB.migrator(1),
                         "--migrate-uri", "tcp://127.0.0.1:49400", "--unsafe")
    check(r.returncode == 0 and rep and rep["ok"], "vm-migrate guest1 vmhost2 -> vmhost1",
          r.stdout[-3000:], r.stderr[-2000:])
    print("vm-migrate:", report_summary(rep), flush=True)
    check(int(rep.get("blackout_us", 0)) > 0, "no blackout measured", rep)
    check(rep["old_nic"].split()[0] != rep["new_nic"].split()[0], "the NIC did not change", rep)
    check(where("guest1") == 1, "guest1 does not run on vmhost1")

    def host1():  # the hook tells the migrator in the background
        r = LAB.rdmavirtctl(1, "--json", "host", timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}
    info = poll(host1, lambda i: "guest1" in i.get("guest_nics", {}).get("domains", []), 60)
    check("guest1" in info.get("guest_nics", {}).get("domains", []),
          "vmhost1 does not count guest1 after 60s", info)

    # The guest agent's fsfreeze hook: a freeze (virsh domfsfreeze, or a
    # --quiesce snapshot) suspends guest1's endpoints with their peers, the
    # thaw resumes them.
    r = LAB.virsh(1, "domfsfreeze", "guest1", check=False, timeout=180)
    check(r.returncode == 0, "domfsfreeze guest1", r.stdout, r.stderr)
    frozen = guest_status("guest1")
    check([m["kind"] for m in frozen.get("in_flight", [])] == ["suspend"],
          "guest1's endpoint is not suspended while frozen", frozen)
    r = LAB.virsh(1, "domfsthaw", "guest1", check=False, timeout=180)
    check(r.returncode == 0, "domfsthaw guest1", r.stdout, r.stderr)
    thawed = guest_status("guest1")
    check(not thawed.get("in_flight") and thawed["recent"][0]["kind"] == "suspend" and
          thawed["recent"][0]["ok"], "guest1's endpoint did not resume at the thaw", thawed)
    print("fsfreeze: blackout",
          int(thawed["recent"][0]["breakdown"]["blackout_us"]) / 1e6, "s", flush=True)

    # A snapshot of both at one cut, across the two hosts.
    r, rep = rdmavirtctl(1, "snapshot", "guest1", "cut", "--connect", LAB.uri(1),
                         "--with", f"guest2@{LAB.uri(2)}")
    check(r.returncode == 0 and rep and rep["ok"], "snapshot guest1 + guest2",
          r.stdout[-3000:], r.stderr[-2000:])
    print("snapshot:", report_summary(rep), flush=True)
    check(rep["members"] == [f"guest1@{LAB.uri(1)}", f"guest2@{LAB.uri(2)}"], "members", rep)
    listed = LAB.virsh(2, "snapshot-list", "guest2", "--name").stdout.split()
    check(listed == ["cut"], "guest2's snapshots", listed)
    at_cut = sent(1, "guest1")
    wait_sent(1, p, at_cut + 200)  # the workload goes on past the cut
    check(LAB.guest_status(1, "guest1", p) is None, "P ended before the revert")

    # Both back to the cut: they reconnect, and P and Q carry on from there.
    r, rep = rdmavirtctl(1, "revert", "guest1", "cut", "--connect", LAB.uri(1))
    check(r.returncode == 0 and rep and rep["ok"], "revert guest1 + guest2",
          r.stdout[-3000:], r.stderr[-2000:])
    print("revert:", report_summary(rep), flush=True)
    waiting = [e.get("peers_waiting", 0) for g in rep["resumed"] for e in g["endpoints"]]
    check(waiting == [1, 0], "the first guest back waits for the second", rep["resumed"])
    stop_workload(p)
    check_workload(p, q)

    # A snapshot rdmavirtctl did not take (live connections in it) is refused.
    LAB.virsh(2, "snapshot-create-as", "guest2", "plain")
    r, _ = rdmavirtctl(2, "revert", "guest2", "plain", "--connect", LAB.uri(2))
    check(r.returncode == 1 and "was not taken by `rdmavirtctl snapshot`" in r.stderr,
          "a plain snapshot was not refused", r.stdout, r.stderr)
    LAB.virsh(2, "snapshot-delete", "guest2", "plain")
    # libvirt migrates no domain that has snapshots: vm-migrate says so first.
    r, rep = rdmavirtctl(2, "vm-migrate", "guest2", "--connect", LAB.uri(2), "--to",
                         LAB.uri(1), "--to-migrator", LAB.migrator(1), "--unsafe")
    check(r.returncode == 1 and "snapshot" in rep.get("error", "") and
          not rep.get("rolled_back"), "vm-migrate of a guest with a snapshot", r.stdout, r.stderr)
    LAB.virsh(1, "snapshot-delete", "guest1", "cut")
    LAB.virsh(2, "snapshot-delete", "guest2", "cut")


@lab_test
def the_destination_hook_refuses_a_host_without_an_rdma_device():
    _, src = guests_up()
    dst = 3 - src
    LAB.start_migrator(dst, guest_nics=False)
    try:
        # Straight through libvirt: the hook on the destination refuses.
        # (--unsafe: the lab's guests share their disk files, vmlab.py.)
        r = LAB.virsh(src, "migrate", "--live", "--unsafe", "guest2", LAB.uri(dst),
                      "--migrateuri", f"tcp://127.0.0.1:{49152 + 100 * dst + 10}",
                      check=False, timeout=300)
        check(r.returncode != 0, "libvirt migrated an RDMA guest to a host without RDMA", r)
        check("has no RDMA device for guests" in r.stderr, "not refused by the hook", r.stderr)
        check("guest2" in LAB.virsh(src, "list", "--name").stdout.split(),
              "guest2 does not run on its host any more")
        print("refused:", r.stderr.strip().splitlines()[-1], flush=True)
        # Through rdmavirtctl: refused before anything is suspended.
        r = vmlab._run([LAB.ctl, "--tls-dir", LAB.tls(src), "vm-migrate", "guest2",
                        "--connect", LAB.uri(src), "--to", LAB.uri(dst),
                        "--to-migrator", LAB.migrator(dst), "--unsafe"], check=False,
                       timeout=120)
        check(r.returncode == 1 and "no RDMA device for guests" in r.stderr and
              "nothing was suspended" in r.stderr, "vm-migrate was not refused", r.stderr)
        # And a host whose migrator is down.
        LAB.stop_migrator(dst)
        r = LAB.virsh(src, "migrate", "--live", "--unsafe", "guest2", LAB.uri(dst),
                      "--migrateuri", f"tcp://127.0.0.1:{49152 + 100 * dst + 11}",
                      check=False, timeout=300)
        check(r.returncode != 0 and "does not answer" in r.stderr,
              "not refused without a migrator", r.stderr)
    finally:
        LAB.start_migrator(dst)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
