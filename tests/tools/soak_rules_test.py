"""tools/soak's verdict on lost UD datagrams, on reports made up here: only
a datagram lost between two that arrived at one place of the receiver and
were sent from one place of the sender counts as the fabric's."""

import copy
import importlib.machinery
import importlib.util
import os
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "lab"))  # soak imports the lab helpers
_loader = importlib.machinery.SourceFileLoader("soak", os.path.join(ROOT, "tools", "soak"))
_spec = importlib.util.spec_from_loader("soak", _loader)
soak = importlib.util.module_from_spec(_spec)
_loader.exec_module(soak)
import migration_tests  # noqa: E402  (the lab tests' rule for both sides)


def tally(lost=0):
    return {"ok": 1000 - lost, "lost": lost, "duplicated": 0, "corrupted": 0, "out_of_order": 0}


def report(missing, places):
    return {"iterations": 1000, "sends": 1000, "lost": len(missing), "duplicated": 0,
            "corrupted": 0, "out_of_order": 0, "completion_errors": 0, "fatal": None,
            "peer_finished": True, "ok": not missing,
            "kinds": {"send": tally(), "write": tally(), "ud": tally(len(missing))},
            "places": places, "ud_missing": missing}


def place(host, ud_sent_from):
    return {"host": host, "pid": 1, "since_s": 0, "ud_sent_from": ud_sent_from,
            "ud_arrivals_before": 0}


SENDER = report([], [place("host1", 0), place("host2", 500)])


class SoakRules(unittest.TestCase):
    def test_nothing_lost_passes(self):
        self.assertEqual(soak.report_ok(report([], [place("host3", 0)]), SENDER), [])

    def test_a_datagram_dropped_while_both_stayed_is_the_fabrics(self):
        rep = report([{"seq": 100, "prev": 99, "next": 101, "receiver_stayed": True}],
                      [place("host3", 0)])
        self.assertEqual(soak.report_ok(rep, SENDER), [100])

    def test_a_datagram_lost_across_a_move_of_the_receiver_fails(self):
        rep = report([{"seq": 100, "prev": 99, "next": 101, "receiver_stayed": False}],
                     [place("host3", 0)])
        self.assertIsNone(soak.report_ok(rep, SENDER))

    def test_a_datagram_lost_across_a_move_of_the_sender_fails(self):
        rep = report([{"seq": 499, "prev": 498, "next": 500, "receiver_stayed": True}],
                     [place("host3", 0)])
        self.assertIsNone(soak.report_ok(rep, SENDER))

    def test_the_last_datagrams_lost_fail(self):
        rep = report([{"seq": 999, "prev": 998, "next": None, "receiver_stayed": False}],
                     [place("host3", 0)])
        self.assertIsNone(soak.report_ok(rep, SENDER))

    def test_an_rc_message_lost_beside_a_dropped_datagram_fails(self):
        rep = report([{"seq": 100, "prev": 99, "next": 101, "receiver_stayed": True}],
                     [place("host3", 0)])
        rep["lost"] += 1
        rep["kinds"]["send"] = tally(1)
        self.assertIsNone(soak.report_ok(rep, SENDER))

    def test_losses_not_all_listed_fail(self):
        rep = report([{"seq": 100, "prev": 99, "next": 101, "receiver_stayed": True}],
                     [place("host3", 0)])
        rep["kinds"]["ud"] = tally(2)
        rep["lost"] = 2
        self.assertIsNone(soak.report_ok(rep, SENDER))

    def test_anything_duplicated_or_unfinished_fails(self):
        base = report([], [place("host3", 0)])
        for key, value in (("duplicated", 1), ("corrupted", 1), ("out_of_order", 1),
                           ("completion_errors", 1), ("fatal", "no progress"),
                           ("peer_finished", False), ("sends", 999)):
            rep = copy.deepcopy(base)
            rep[key] = value
            self.assertIsNone(soak.report_ok(rep, SENDER), key)


class BothSides(unittest.TestCase):
    """The lab tests judge each side by its own report and by what its peer
    said of it (migration_tests.side_ok): a datagram of P's that the fabric
    dropped on its way to Q is an error in Q's count, which P's report
    carries as peer_errors; that one error is no fault of P's. (A lab test
    failed so: Q's two fabric drops, allowed by report_ok, failed P.)"""

    def test_the_peers_errors_for_our_dropped_datagrams_pass(self):
        q = report([{"seq": 100, "prev": 99, "next": 101, "receiver_stayed": True}],
                   [place("host3", 0)])
        p = copy.deepcopy(SENDER)
        p["peer_errors"] = 1
        self.assertEqual(migration_tests.side_ok(p, q), [])
        self.assertEqual(migration_tests.side_ok(q, p), [100])

    def test_a_peer_error_beyond_the_dropped_datagrams_fails(self):
        q = report([{"seq": 100, "prev": 99, "next": 101, "receiver_stayed": True}],
                   [place("host3", 0)])
        p = copy.deepcopy(SENDER)
        p["peer_errors"] = 2
        self.assertIsNone(migration_tests.side_ok(p, q))
        q = report([], [place("host3", 0)])
        p["peer_errors"] = 1
        self.assertIsNone(migration_tests.side_ok(p, q))


if __name__ == "__main__":
    unittest.main()
