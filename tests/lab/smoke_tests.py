"""Lab smoke tests: real rxe between two hosts, real CRIU in a host."""

import re
import sys

from labtest import LAB, check, lab_test, main, run_ok, server_client, wait_until


@lab_test
def agent_timeout_is_reported():
    # A command that outlives its timeout comes back as rc 124, not a hang.
    r = LAB.run(1, "echo started; sleep 30", timeout=2)
    check(r.rc == 124 and "started" in r.out, "timeout not reported", r)


@lab_test
def jobs_queued_together_each_run_to_their_end():
    # Jobs queued back to back each keep their own timeout (the agent reads
    # each one's .cmd after a doorbell that may have carried several rings).
    for _ in range(3):
        jobs = [LAB.submit(1, f"sleep {s}; echo done {s}", 30) for s in (2, 1, 0)]
        results = [LAB.wait(1, j, 45) for j in jobs]
        for s, r in zip((2, 1, 0), results):
            check(r.rc == 0 and r.out == f"done {s}\n", f"job `sleep {s}` did not run to its end", r)


@lab_test
def hosts_have_rxe_on_the_fabric():
    for n in (1, 2):
        r = run_ok(n, "hostname; ip -4 -br addr show eth0; rdma link show")
        check(f"host{n}" in r.out and f"10.77.0.{n}/24" in r.out
              and "rxe0/1 state ACTIVE" in r.out, f"host{n} not set up", r)


@lab_test
def rc_pingpong_between_hosts():
    s, c = server_client("ibv_rc_pingpong -d rxe0 -g 1 -n 200",
                         "ibv_rc_pingpong -d rxe0 -g 1 -n 200 host1", 18515)
    check(s.rc == 0 and c.rc == 0, "ibv_rc_pingpong failed", s, c)
    check("200 iters" in c.out, "client did not finish its iterations", c)


@lab_test
def write_bw_between_hosts():
    s, c = server_client("ib_write_bw -d rxe0 -x 1 -F -n 200",
                         "ib_write_bw -d rxe0 -x 1 -F -n 200 host1", 18515)
    check(s.rc == 0 and c.rc == 0, "ib_write_bw failed", s, c)
    check("BW average" in c.out, "no bandwidth report", c)


@lab_test
def criu_check_passes():
    r = run_ok(1, "criu check", 120)
    check("Looks good." in r.out + r.err, "criu check did not pass", r)


@lab_test
def criu_refuses_a_process_holding_uverbs():
    # The problem rdmavirt solves: a verbs process cannot be dumped.
    run_ok(1, "rm -rf /lab/verbs && mkdir -p /lab/verbs/img")
    run_ok(1, "setsid ibv_rc_pingpong -d rxe0 -g 1 -p 18600 < /dev/null "
              "> /dev/null 2>&1 & echo $! > /lab/verbs/pid")
    pid = int(open(f"{LAB.shared}/verbs/pid").read())
    try:
        wait_until(1, "ss -Hltn 'sport = :18600' | grep -q .", 30, "server up")
        run_ok(1, f"ls -l /proc/{pid}/fd | grep -q /dev/infiniband/uverbs0")
        r = LAB.run(1, f"criu dump -t {pid} -D /lab/verbs/img -o dump.log; "
                       "rc=$?; cat /lab/verbs/img/dump.log; exit $rc", 120)
        check(r.rc != 0, "criu dumped a process holding uverbs0", r)
        # CRIU stops either at the fd ("Can't dump file N of that type ...
        # (chr 231:N)") or, first, at the device's mmapped doorbell page.
        maps = run_ok(1, f"cat /proc/{pid}/maps").out
        m = re.search(r"non-regular mapping on \d+'s map ([0-9a-f]+)", r.out)
        uverbs_map = m and any(l.startswith(m.group(1) + "-") and "uverbs" in l
                               for l in maps.splitlines())
        check(("Can't dump file" in r.out and "231:" in r.out) or uverbs_map,
              "criu failed for another reason than the uverbs device", r)
        run_ok(1, f"kill -0 {pid}")  # a failed dump leaves it running
    finally:
        LAB.run(1, f"kill {pid}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
