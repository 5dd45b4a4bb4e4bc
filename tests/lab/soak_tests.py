"""The soak, short: tools/soak with ten moves or more (P and Q live, through
checkpoints, and both at once toward each other), every one checked, and
each side's report at the end: nothing lost but datagrams the fabric
dropped while neither side moved (tools/soak says how that is told). The
workload may run 30 s per move (the tool's default is 15), and is told to
stop once the tenth move is made: a move takes 7 s on an idle lab and 14 s
on a loaded one (a CI run that sized the workload at 12 s fit only 9 moves
in it)."""

import json
import os
import subprocess
import sys

from labtest import LAB, ROOT, check, lab_test, main


@lab_test
def ten_moves_in_a_row_lose_nothing():
    out = os.path.join(LAB.shared, "soak-ci.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "soak"), "--moves", "10",
                        "--meet", "--seconds-per-move", "30", "--json", out], capture_output=True, text=True, timeout=1500)
    print(r.stdout[-6000:], r.stderr[-6000:], flush=True)
    check(r.returncode == 0, "the soak failed", r.stderr[-2000:])
    with open(out) as f:
        res = json.load(f)
    check(res["ok"] and len(res["moves"]) >= 10, "fewer than 10 moves, or not ok", res)
    kinds = {(m["kind"], m["side"]) for m in res["moves"]}
    check({("live", "p"), ("live", "q"), ("checkpoint+restore", "p"),
           ("checkpoint+restore", "q")} <= kinds,
          "the cycle did not run", kinds)
    check(any(m.get("swap") for m in res["moves"]), "no swap was made", res["moves"])
    reports_verified(res)


def reports_verified(res):
    for side in "pq":
        rep = res["reports"][side]
        dropped = res["ud_dropped_by_fabric"][side.upper()]
        check(rep["lost"] == len(dropped) == rep["kinds"]["ud"]["lost"] and
              rep["duplicated"] == 0 and rep["corrupted"] == 0 and rep["out_of_order"] == 0,
              f"{side}'s report", rep)


# Its draws (one move in two): the peer's migrator down, CRIU killed on
# the destination, the destination's migrator killed, its state directory
# full twice, the source's migrator killed, in that order (a swap's
# refused move, made again, draws too and shifts them); where each strikes
# is the moves' timing.
CHAOS_SEED = 12


@lab_test
def a_short_chaos_soak_ends_with_one_copy_each_and_nothing_lost():
    """tools/soak --chaos, short: eight moves or more, a fault in about one
    in two, each move's outcome (done, rolled back, refused, moved with an
    error) checked against where each side runs, and both reports at the
    end."""
    out = os.path.join(LAB.shared, "soak-chaos-ci.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "soak"), "--chaos",
                        "--moves", "8", "--fault-every", "2", "--seed", str(CHAOS_SEED),
                        "--seconds-per-move", "30", "--json", out],
                       capture_output=True, text=True, timeout=1500)
    print(r.stdout[-6000:], r.stderr[-6000:], flush=True)
    check(r.returncode == 0, "the chaos soak failed", r.stderr[-2000:])
    with open(out) as f:
        res = json.load(f)
    check(res["ok"] and len(res["moves"]) >= 8, "fewer than 8 moves, or not ok", res)
    struck = [m["fault"] for m in res["moves"] if m.get("fault", {}).get("hit")]
    print("faults that struck:", struck, flush=True)
    check(len(struck) >= 2, "fewer than two faults struck a move", res["moves"])
    reports_verified(res)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
