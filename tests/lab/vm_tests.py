"""RDMA guests under real libvirt: live VM migration with live connections,
and the destination hook refusing a host that cannot take them.

The VM lab (tools/lab/vmlab.py): two libvirt daemons on this machine, each
with its own rdmavirt-migratord and rdmavirt's qemu hook; TCG guests whose
RDMA NIC is a virtio NIC with Soft-RoCE on top, hot-unplugged and replaced
by a NIC of the destination (new MAC, new address, so a new GID) around
the migration. The integrity workload runs in two guests, unmodified,
under the shim; each guest runs its own migrator.
"""

import json
import os
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


def guests_up():
    """vmhost1 runs guest1 and guest2 (started if not running)."""
    if LAB._state() is None:
        LAB.up()
    running = LAB.virsh(1, "list", "--name").stdout.split()
    for n in (1, 2):
        if f"guest{n}" not in running:
            LAB.start_guest(1, f"guest{n}", n)


def start_workload(iterations):
    """Q (server) in guest2, P (client) in guest1; returns their agent pids."""
    # rdmavirt-guest names a NIC's Soft-RoCE device after it.
    args = ["--iterations", str(iterations), "--ud-lost-after", "1800", "--port", "18900",
            "--device", "rxe_eth0"]
    q = LAB.guest_spawn(1, "guest2", [INTEGRITY, "--server"] + args +
                        ["--report", "/tmp/q.json"], SHIM_ENV)
    time.sleep(3)
    p = LAB.guest_spawn(1, "guest1", [INTEGRITY, "--connect", vmlab.guest_address(2)] + args +
                        ["--report", "/tmp/p.json"], SHIM_ENV)
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


@lab_test
def integrity_survives_a_live_vm_migration():
    guests_up()
    try:
        p, q = start_workload(4000)
        time.sleep(20)  # connected, traffic flowing
        early = LAB.guest_status(1, "guest1", p)
        check(early is None, "P ended before the move", early)
        r = vmlab._run([LAB.ctl, "--tls-dir", LAB.tls(1), "--json", "vm-migrate", "guest1",
                        "--connect", LAB.uri(1), "--to", LAB.uri(2),
                        "--to-migrator", LAB.migrator(2),
                        "--migrate-uri", "tcp://127.0.0.1:49400"], check=False, timeout=600)
        print(r.stderr, flush=True)
        rep = json.loads(r.stdout) if r.stdout.strip() else None
        check(r.returncode == 0 and rep and rep["ok"], "vm-migrate guest1 vmhost1 -> vmhost2",
              r.stdout[-3000:], r.stderr[-2000:])
        print("vm-migrate:", json.dumps({k: v for k, v in rep.items()
                                         if k not in ("suspended", "resumed")}), flush=True)
        check(int(rep.get("blackout_us", 0)) > 0, "no blackout measured", rep)
        check(rep["old_nic"].split()[0] != rep["new_nic"].split()[0], "the NIC did not change",
              rep)
        check("guest1" in LAB.virsh(2, "list", "--name").stdout.split(),
              "guest1 does not run on vmhost2")
        # The source host's migrator heard that guest1 left; vmhost2's holds it.
        time.sleep(2)
        h2 = json.loads(LAB.rdmavirtctl(2, "--json", "host").stdout)
        check("guest1" in h2["guest_nics"].get("domains", []), "vmhost2 does not count guest1",
              h2)
        pr = LAB.guest_wait(2, "guest1", p, 900)
        qr = LAB.guest_wait(1, "guest2", q, 120)
        for side, res, h, name in (("P", pr, 2, "guest1"), ("Q", qr, 1, "guest2")):
            rep_side = check_integrity(side, res, h, name, f"/tmp/{side.lower()}.json")
            print(side, {k: rep_side[k] for k in ("sends", "lost", "duplicated", "corrupted")},
                  flush=True)
    except BaseException:
        show_logs()
        for h, name in ((1, "guest2"), (2, "guest1"), (1, "guest1")):
            print(f"--- {name} migrator log\n"
                  f"{guest_log(h, name, '/var/log/rdmavirt-migratord.log')}", flush=True)
        raise


@lab_test
def the_destination_hook_refuses_a_host_without_an_rdma_device():
    guests_up()
    running = {h: LAB.virsh(h, "list", "--name").stdout.split() for h in (1, 2)}
    src = 1 if "guest2" in running[1] else 2
    dst = 3 - src
    LAB.start_migrator(dst, guest_nics=False)
    try:
        # Straight through libvirt: the hook on the destination refuses.
        r = LAB.virsh(src, "migrate", "--live", "guest2", LAB.uri(dst),
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
                        "--to-migrator", LAB.migrator(dst)], check=False, timeout=120)
        check(r.returncode == 1 and "no RDMA device for guests" in r.stderr and
              "nothing was suspended" in r.stderr, "vm-migrate was not refused", r.stderr)
        # And a host whose migrator is down.
        LAB.stop_migrator(dst)
        r = LAB.virsh(src, "migrate", "--live", "guest2", LAB.uri(dst),
                      "--migrateuri", f"tcp://127.0.0.1:{49152 + 100 * dst + 11}",
                      check=False, timeout=300)
        check(r.returncode != 0 and "does not answer" in r.stderr,
              "not refused without a migrator", r.stderr)
    finally:
        LAB.start_migrator(dst)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
