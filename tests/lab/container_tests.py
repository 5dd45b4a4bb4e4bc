"""RDMA programs in containers: Debian's Podman 4.3 with runc (Debian's
crun is built without CRIU, so runc is the runtime that can checkpoint)
in the lab hosts, the container's root the host's own tree (`--rootfs
/:O`, an overlay over it: no registry is reachable, and every program the
lab has is then in the container too), its storage on the host's tmpfs."""

import json
import sys

from labtest import BUILD, LAB, check, lab_test, main, run_ok, wait_until

import migrator_tests as migrators

PODMAN = ("podman --root /tmp/containers --runroot /run/containers --runtime runc "
          "--cgroup-manager cgroupfs --events-backend file")


def podman(host, args, timeout=120):
    return run_ok(host, f"{PODMAN} {args}", timeout)


@lab_test
def a_shimmed_program_in_its_own_pid_namespace_is_admitted_and_known_by_its_host_pid():
    """ibv_rc_pingpong under the shim as pid 1 of a Podman container (a pid
    namespace of its own, the host's network, uverbs0 given to it, the
    migrator's socket directory mounted in): the migrator admits its shim,
    whose Hello says pid 1, and `rdmavirtctl ps` lists the program by its
    pid on the host, with its QP. (A migrator that took the Hello's pid
    as the host's refused it: "its Hello speaks for pid 1".)"""
    migrators.daemons_up()
    sock_dir = migrators.SOCK.rsplit("/", 1)[0]
    podman(1, "rm -f -t 0 -a")
    try:
        podman(1, f"run -d --name shimmed --network host --device /dev/infiniband/uverbs0 "
                  f"-v {sock_dir}:{sock_dir} --rootfs /:O env RDMAVIRT_SOCKET={migrators.SOCK} "
                  f"LD_PRELOAD={BUILD}/shim/librdmavirt.so "
                  f"ibv_rc_pingpong -d rxe0 -g 1 -p 18790 -n 1000")
        wait_until(1, "pgrep -x ibv_rc_pingpong > /dev/null", 60, "the container's program runs")
        host_pid = int(run_ok(1, "pgrep -x ibv_rc_pingpong").out.split()[0])
        ns = run_ok(1, f"sed -n 's/^NSpid:\\s*//p' /proc/{host_pid}/status").out.split()
        check(ns == [str(host_pid), "1"], "the program is not pid 1 of a pid namespace of its own",
              ns)
        wait_until(1, f"grep -q 'pid {host_pid} uid 0 is pid 1 in its own pid namespace' "
                      f"{migrators.LOGS}/host1.log", 60, "the migrator admitted the container's shim")
        r = migrators.ctl(1, "--json ps")
        check(r.rc == 0, "rdmavirtctl ps failed", r)
        listed = {e["pid"]: e for e in json.loads(r.out).get("endpoints", [])}
        check(host_pid in listed, f"ps does not list the container's program as pid {host_pid}",
              sorted(listed))
        check(1 not in listed, "ps lists the program by its pid in the container", sorted(listed))
        e = listed[host_pid]
        check(e.get("program") == "ibv_rc_pingpong" and len(e.get("qps", [])) == 1,
              "ps does not show the program's QP", e)
        print(f"container's ibv_rc_pingpong: pid 1 there, {host_pid} here, listed with "
              f"{len(e['qps'])} QP", flush=True)
    finally:
        LAB.run(1, f"{PODMAN} rm -f -t 0 -a", 120)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
