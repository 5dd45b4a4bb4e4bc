#!/usr/bin/env python3
"""Runs rdma-core's own pyverbs test suite (Debian's python3-pyverbs ships
it, partly gzipped, under /usr/share/doc/rdma-core/tests) on one device
and prints each test's outcome as one JSON object on the last line:
{"test id": "ok" | "skip: reason" | "fail: ..." | "error: ..."}.

Run on a lab host, natively or under the shim; shim_tests.py compares
the runs. Usage: pyverbs_outcomes.py DEVICE [TEST_PREFIX]
"""

import gzip
import json
import os
import shutil
import sys
import tempfile
import traceback
import unittest

SUITE = "/usr/share/doc/rdma-core/tests"


def unpacked_suite():
    """A copy of the suite with its gzipped modules unpacked."""
    root = tempfile.mkdtemp(prefix="pyverbs-suite-")
    dest = os.path.join(root, "tests")
    os.mkdir(dest)
    for name in os.listdir(SUITE):
        src = os.path.join(SUITE, name)
        if name.endswith(".py.gz"):
            with gzip.open(src, "rb") as f, open(os.path.join(dest, name[:-3]), "wb") as out:
                shutil.copyfileobj(f, out)
        elif name.endswith(".py"):
            shutil.copy(src, dest)
    return root, dest


class Outcomes(unittest.TextTestResult):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.outcomes = {}

    @staticmethod
    def last_line(err):
        lines = "".join(traceback.format_exception(*err)).strip().splitlines()
        return lines[-1] if lines else "?"

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[test.id()] = "ok"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[test.id()] = "skip: " + reason

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[test.id()] = "fail: " + self.last_line(err)

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[test.id()] = "error: " + self.last_line(err)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcomes[test.id()] = "expected failure"

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcomes[test.id()] = "unexpected success"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: pyverbs_outcomes.py DEVICE [TEST_PREFIX]")
    device = sys.argv[1]
    prefix = sys.argv[2] if len(sys.argv) == 3 else ""
    if not os.path.isdir(SUITE):
        sys.exit(f"{SUITE} is missing: install python3-pyverbs")
    root, dest = unpacked_suite()
    try:
        # The suite's modules import args_parser at top level and read the
        # device from the command line.
        sys.path.insert(0, dest)
        sys.path.insert(0, root)
        sys.argv = [sys.argv[0], "--dev", device]
        from args_parser import parser
        parser.parse_args()
        import tests
        suite = unittest.defaultTestLoader.loadTestsFromModule(tests)

        def flat(s):
            for t in s:
                if isinstance(t, unittest.TestSuite):
                    yield from flat(t)
                else:
                    yield t

        chosen = unittest.TestSuite(t for t in flat(suite) if t.id().startswith(prefix))
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1,
                                         resultclass=Outcomes)
        result = runner.run(chosen)
        sys.stdout.flush()
        print(json.dumps(result.outcomes, sort_keys=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
