"""MPI jobs over rxe0 between lab hosts: Debian's Open MPI 4.1 with UCX
(tools/lab/mpi.py has the recipe, docs/mpi.md why), natively and with
every rank under the shim, in default and offset modes."""

import json
import re
import sys

from labtest import BUILD, LAB, check, lab_test, main

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


if __name__ == "__main__":
    sys.exit(main(sys.argv))
