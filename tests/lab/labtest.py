"""Helpers for lab tests: a lab client, test registration and a runner.

Each lab test is a function registered with @lab_test; CTest runs one per
process: `python3 lab_tests.py NAME`. The lab itself is booted once per
test run by the `lab_up` fixture and torn down by `lab_down`.
"""

import json
import os
import signal
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "lab"))
import lab as labmod  # noqa: E402

LAB = labmod.Lab()
# The build tree, as seen from inside the hosts (the same path: hosts see
# the machine's / read-only).
BUILD = os.environ.get("RDMAVIRT_BUILD_DIR", os.path.join(ROOT, "build"))

_tests = {}


class Failure(AssertionError):
    pass


class Deadline(BaseException):
    """Raised in a test that outlives RDMAVIRT_LAB_TEST_DEADLINE seconds
    (CTest's timeout less a margin): its `finally` blocks then stop its
    programs and undo its settings, which CTest's kill would leave to the
    next tests. A BaseException, so that no `except Exception` swallows it."""


def _deadline(signum, frame):
    raise Deadline(f"the test did not end within {os.environ['RDMAVIRT_LAB_TEST_DEADLINE']} s: "
                   "stopped, cleaning up")


def lab_test(fn):
    _tests[fn.__name__] = fn
    return fn


def check(cond, msg, *results):
    if not cond:
        detail = "".join(f"\n  {r!r}" for r in results)
        raise Failure(msg + detail)


def json_of(result):
    """The JSON a command printed (rdmavirtctl --json), or None."""
    try:
        return json.loads(result.out) if result.out.strip() else None
    except json.JSONDecodeError:
        return None


def run_ok(host, script, timeout=60):
    r = LAB.run(host, script, timeout)
    check(r.rc == 0, f"host{host}: `{script}` exited {r.rc}", r)
    return r


def run_all(scripts, timeout=60):
    """Runs one script per host ({host: script}) side by side; returns
    {host: Result} once all have ended."""
    jobs = {n: LAB.submit(n, script, timeout) for n, script in scripts.items()}
    return {n: LAB.wait(n, job, timeout + 15) for n, job in jobs.items()}


def until_script(condition, timeout):
    """A shell command (a subshell) whose status is 0 as soon as
    `condition` holds, 1 after `timeout` seconds."""
    return (f"(for i in $(seq {int(timeout * 5)}); do "
            f"if {condition}; then exit 0; fi; sleep 0.2; done; exit 1)")


def wait_until(host, condition, timeout=30, what=None):
    """Polls a shell condition on a host until it holds (one job, no spin
    over the spool)."""
    r = LAB.run(host, until_script(condition, timeout), timeout + 10)
    check(r.rc == 0, f"host{host}: {what or condition} not true after {timeout}s", r)


def wait_listening(host, port, timeout=30):
    wait_until(host, f"ss -Hltn 'sport = :{port}' | grep -q .", timeout,
               f"a listener on port {port}")


def server_client(server_cmd, client_cmd, port, server=1, client=2, timeout=120):
    """Runs a server on one host and its client on another; returns both
    results (server started first, client once the port listens)."""
    job = LAB.submit(server, server_cmd, timeout)
    try:
        wait_listening(server, port)
        c = LAB.run(client, client_cmd, timeout)
    except BaseException:
        LAB.kill(server, job)
        raise
    s = LAB.wait(server, job, timeout + 15)
    return s, c


def main(argv):
    # The tests of the file run as a program, not of the ones it imports.
    own = {n: fn for n, fn in _tests.items() if fn.__module__ == "__main__"}
    names = argv[1:]
    if not names or names == ["--list"]:
        print("\n".join(sorted(own)))
        return 0
    failed = 0
    for name in names:
        fn = own.get(name)
        if fn is None:
            print(f"no such lab test: {name}", file=sys.stderr)
            return 2
        start = time.monotonic()
        deadline = int(os.environ.get("RDMAVIRT_LAB_TEST_DEADLINE", "0"))
        if deadline > 0:
            signal.signal(signal.SIGALRM, _deadline)
            signal.alarm(deadline)
        try:
            fn()
            print(f"PASS {name} ({time.monotonic() - start:.1f}s)")
        except (Exception, Deadline):  # report every kind of failure as the test's
            traceback.print_exc()
            print(f"FAIL {name} ({time.monotonic() - start:.1f}s)")
            failed += 1
        finally:
            signal.alarm(0)
    return 1 if failed else 0
