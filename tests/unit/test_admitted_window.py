"""The learner's admitted window: the oldest attempt the workers started and the learner has not
seen holds back a step that would push it past max_lag, and only for a bounded time."""

from __future__ import annotations

import time

import pytest

from conveyor.admission import AdmissionLedger
from conveyor.contracts import Admission
from learner.admitted_window import AdmittedWindow

pytestmark = pytest.mark.unit

B = 8  # one learner batch
BOUND = 2 * B  # max_lag 1


def _ledger(*claims: str) -> AdmissionLedger:
    ledger = AdmissionLedger("w", "learner", sub=None, pub=None)  # type: ignore[arg-type]
    ledger.apply(Admission(run_id="w", kind="claim", member="rw", keys=list(claims), samples=[B] * len(claims)))
    return ledger


def test_a_step_waits_for_the_oldest_started_attempt_it_would_make_stale():
    window = AdmittedWindow(_ledger("a/0", "b/0", "c/0"), bound=BOUND, max_lag=1, wait_s=30)
    window.start(0)
    window.reported(0, 0)  # version 0: "a" and "b" (tickets 8, 16) can start under it
    window.consumed("b/0")
    window.reported(1, 8)  # version 1 after one batch ("b" arrived first)
    # A step from version 1 makes version 2: "a", generated at version 0, would be 2 > 1 versions old.
    assert window.hold(version=1, consumed=8, present=set())
    assert not window.hold(version=1, consumed=8, present={"a/0"})  # it is here: the batch takes it first
    # The attempts after a present one are still looked at: "b" is consumed, "c" not started yet.
    window.consumed("a/0")
    assert not window.hold(version=1, consumed=16, present=set())  # "c" started at version 1 at the earliest


def test_an_attempt_not_started_yet_holds_nothing_and_a_missing_one_only_for_a_while():
    window = AdmittedWindow(_ledger("a/0", "b/0", "c/0", "d/0"), bound=BOUND, max_lag=1, wait_s=0.2)
    window.start(0)
    window.reported(0, 0)
    for key in ("a/0", "b/0"):
        window.consumed(key)
    window.reported(1, 16)
    window.reported(2, 16)
    # "c" (ticket 24) could start at version 1 at the earliest: a step from 2 would make it 2 old.
    assert window.hold(version=2, consumed=16, present=set())
    time.sleep(0.3)
    # "c" waited for long enough: given up on. "d" (ticket 32) also started at version 1 at the
    # earliest: the next wait.
    assert window.hold(version=2, consumed=16, present=set())
    assert window.waits == 2
    time.sleep(0.3)
    assert not window.hold(version=2, consumed=16, present=set())  # nothing else is at risk
    window2 = AdmittedWindow(_ledger("x/0", "y/0", "z/0"), bound=BOUND, max_lag=1, wait_s=30)
    window2.start(0)
    window2.reported(0, 0)
    assert not window2.hold(version=0, consumed=0, present=set())  # a step from 0 leaves "x" 0 old


def test_a_restarted_learner_forgets_what_it_consumed_before():
    window = AdmittedWindow(_ledger("a/0", "b/0", "c/0"), bound=BOUND, max_lag=1, wait_s=30)
    window.start(16)  # the checkpoint had consumed 16 samples
    window.reported(5, 16)
    assert not window.hold(version=5, consumed=16, present=set())  # "c" started at version 5 at the earliest


def test_an_attempt_behind_one_that_arrived_is_still_waited_for():
    window = AdmittedWindow(_ledger("a/0", "b/0", "c/0"), bound=BOUND, max_lag=1, wait_s=30)
    window.start(0)
    window.reported(0, 0)  # "a" and "b" can start under version 0
    window.reported(1, 0)
    # "a" has partly arrived (the learner holds it); "b" has not arrived at all and would be 2 old.
    assert window.hold(version=1, consumed=0, present={"a/0"})


def test_an_attempt_the_ledger_forgot_holds_nothing():
    ledger = AdmissionLedger("w", "learner", sub=None, pub=None, retain=2)  # type: ignore[arg-type]
    window = AdmittedWindow(ledger, bound=BOUND, max_lag=1, wait_s=30)
    window.start(0)
    window.reported(0, 0)
    ledger.apply(Admission(run_id="w", kind="claim", member="rw", keys=["a/0"], samples=[B]))
    window.consumed("z/0")
    window.reported(1, 8)
    assert window.hold(version=1, consumed=8, present=set())  # "a" (version 0) would be 2 versions old
    more = [f"n{i}/0" for i in range(4)]  # the ledger forgets "a" (it remembers 2 to 4 attempts)
    ledger.apply(Admission(run_id="w", kind="claim", member="rw", keys=more, samples=[B] * 4))
    assert ledger.ticket("a/0") is None
    assert not window.hold(version=1, consumed=8, present=set())
