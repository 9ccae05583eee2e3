"""The learner's view of what the rollout workers have started and it has not consumed yet.

Admission (``conveyor/admission.py``) bounds the samples between the start of
generation and the learner, but the learner consumes groups as they arrive, not
in ticket order: a group that is late after generation (a slow or re-submitted
reward task, a whole group held in a stalled reward worker) can be overtaken by
newer ones until it is older than ``max_lag``. The window lets the learner see
it coming. It reads the admission ledger, follows the oldest attempt it has not
consumed, and works out the earliest policy version that attempt can have been
generated with: a worker starts ticket ``T`` only once the learner has reported
``T - bound`` samples consumed with the version it serves, so the earliest such
version is the first whose report reached ``T - bound``. A step that would make
that version more than ``max_lag`` old waits, for at most ``wait_s`` per
attempt; an attempt that is still missing after that (its worker died and the
task is being redelivered, or it was lost) no longer holds the learner back.
"""

from __future__ import annotations

import time
from collections import deque

from conveyor.admission import AdmissionLedger


class AdmittedWindow:
    def __init__(self, ledger: AdmissionLedger, *, bound: int, max_lag: int, wait_s: float) -> None:
        self.ledger = ledger
        self.bound = bound  # (max_lag + 1) * learner batch, the workers' admission bound
        self.max_lag = max_lag
        self.wait_s = wait_s
        self._read = 0  # claims of the ledger taken in (its position)
        self._outstanding: deque[str] = deque()  # claimed attempts in ticket order, oldest first
        self._consumed: set[str] = set()  # consumed out of ticket order, not yet at the front
        self._consumed_at: dict[int, int] = {}  # policy version -> samples consumed reported with it
        self._holding: tuple[str, float] | None = None  # the attempt waited for, since when
        self.waits = 0  # attempts waited for

    def start(self, consumed: int) -> None:
        """Forget the attempts a previous incarnation consumed: tickets within what it consumed."""
        self._take_claims()
        while self._outstanding and (self.ledger.ticket(self._outstanding[0]) or 0) <= consumed:
            self._outstanding.popleft()

    def consumed(self, key: str) -> None:
        self._consumed.add(key)

    def reported(self, version: int, consumed: int) -> None:
        self._consumed_at[version] = max(self._consumed_at.get(version, 0), consumed)
        for v in [v for v in self._consumed_at if v < version - 64]:  # far older than any window
            del self._consumed_at[v]

    def _take_claims(self) -> None:
        claimed, self._read = self.ledger.claimed_since(self._read)
        self._outstanding.extend(claimed)

    def hold(self, version: int, consumed: int, present: set[str]) -> bool:
        """Whether a step from ``version`` must wait for an attempt the workers started and the
        learner has not seen (``present``: attempts it holds samples of, which its batches take
        oldest first, or wait for as stragglers). Attempts are looked at in ticket order: a later
        ticket was started no earlier, so the first one not at risk ends the search."""
        self._take_claims()
        while self._outstanding and self._outstanding[0] in self._consumed:
            self._consumed.discard(self._outstanding.popleft())
        if not self.wait_s:
            return False
        for key in list(self._outstanding):
            if key in self._consumed or key in present:
                continue
            ticket = self.ledger.ticket(key)
            if ticket is None:  # so old the ledger forgot it: consumed, or long given up on
                self._outstanding.remove(key)
                continue
            if ticket - consumed > self.bound:
                return False  # not started yet, nor anything after it
            admitted_from = [v for v, c in self._consumed_at.items() if c >= ticket - self.bound]
            if version + 1 - min(admitted_from, default=version) <= self.max_lag:
                return False
            now = time.monotonic()
            if self._holding is None or self._holding[0] != key:
                self._holding = (key, now)
                self.waits += 1
            if now - self._holding[1] <= self.wait_s:
                return True
            self._outstanding.remove(key)  # waited long enough: it no longer holds the learner back
            self._holding = None
        return False
