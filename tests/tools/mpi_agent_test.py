"""tools/mpi/rdmavirt-mpi-agent, the launch agent of Open MPI and of MPICH's
Hydra, with an `ssh` of this test's that records what it was given: the
host it was asked to reach after any ssh options of the launcher, and the
daemon's command on standard input, whole."""

import os
import subprocess
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "tools", "mpi", "rdmavirt-mpi-agent")
FAKE_SSH = """#!/bin/sh
printf '%s\\n' "$@" > "$RECORD.args"
cat > "$RECORD.stdin"
"""


class AgentTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        ssh = os.path.join(self.dir.name, "ssh")
        with open(ssh, "w") as f:
            f.write(FAKE_SSH)
        os.chmod(ssh, 0o755)
        self.record = os.path.join(self.dir.name, "record")

    def tearDown(self):
        self.dir.cleanup()

    def agent(self, *args):
        env = dict(os.environ, PATH=f"{self.dir.name}:{os.environ['PATH']}", RECORD=self.record)
        return subprocess.run([AGENT, *args], env=env, capture_output=True, text=True,
                              timeout=30)

    def recorded(self):
        with open(self.record + ".args") as f:
            args = f.read().splitlines()
        with open(self.record + ".stdin") as f:
            return args, f.read()

    def test_open_mpis_call_reaches_the_host_with_orteds_command(self):
        r = self.agent("host2", "orted", "-mca", "orte_hnp_uri", "1;tcp://10.77.0.1:4242")
        self.assertEqual(r.returncode, 0, r.stderr)
        args, stdin = self.recorded()
        self.assertEqual(args[:3], ["-o", "BatchMode=yes", "host2"])
        self.assertEqual(stdin, "orted -mca orte_hnp_uri 1;tcp://10.77.0.1:4242\n")

    def test_hydras_ssh_options_are_not_taken_for_the_host(self):
        proxy = ['"/usr/bin/hydra_pmi_proxy"', "--control-port", "host1:36551", "--proxy-id", "1"]
        r = self.agent("-x", "host2", *proxy)
        self.assertEqual(r.returncode, 0, r.stderr)
        args, stdin = self.recorded()
        self.assertEqual(args[2], "host2")
        self.assertEqual(stdin, " ".join(proxy) + "\n")

    def test_options_with_a_value_are_skipped_with_it(self):
        r = self.agent("-p", "2222", "-o", "ConnectTimeout=5", "-x", "host3", "orted")
        self.assertEqual(r.returncode, 0, r.stderr)
        args, stdin = self.recorded()
        self.assertEqual(args[2], "host3")
        self.assertEqual(stdin, "orted\n")

    def test_a_call_without_a_command_is_refused_with_the_usage(self):
        for call in (["-x", "host2"], ["-p"], []):
            r = self.agent(*call)
            self.assertEqual(r.returncode, 2, call)
            self.assertIn("usage: rdmavirt-mpi-agent", r.stderr)
            self.assertFalse(os.path.exists(self.record + ".args"), call)


if __name__ == "__main__":
    unittest.main()
