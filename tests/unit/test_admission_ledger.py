"""The admission ledger: one global order of claimed samples, whoever claims and however often."""

from __future__ import annotations

import pytest

from conveyor.admission import AdmissionLedger, admissible
from conveyor.contracts import Admission
from conveyor.messaging import ServiceClients
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryBroker, MemoryTransport

pytestmark = pytest.mark.unit


async def _ledgers(broker: MemoryBroker, topics: Topics, *members: str):
    """One ledger per member, each on its own clients (as separate processes would be)."""
    out = []
    for m in members:
        io = ServiceClients(MemoryTransport(broker), topics.dead_letter, m)
        await io.__aenter__()
        out.append((io, await AdmissionLedger.open(io, topics, m)))
    return out


async def test_tickets_are_global_and_each_attempt_counts_once():
    broker, topics = MemoryBroker(), Topics("adm")
    (io_a, a), (io_b, b) = await _ledgers(broker, topics, "worker-a", "worker-b")
    await a.claim([("t1/0", 8), ("t2/0", 8)])
    await b.claim([("t3/0", 4), ("t1/0", 8)])  # t1 again: redelivered to b; it keeps a's ticket
    await a.claim([("t2/0", 8)])  # a's own repeat (not read back yet): appended, ignored by every reader
    for ledger in (a, b):
        await ledger.catch_up(deadline_s=5)
    assert a.tickets == b.tickets == {"t1/0": 8, "t2/0": 16, "t3/0": 20}
    assert a.claimed_samples == b.claimed_samples == 20
    # A reader that starts afterwards (a restarted worker) computes the same tickets.
    ((io_c, c),) = await _ledgers(broker, topics, "worker-c")
    assert await c.catch_up(deadline_s=5)
    assert c.tickets == a.tickets
    for io in (io_a, io_b, io_c):
        await io.__aexit__(None, None, None)


async def test_the_bound_counts_what_every_worker_started():
    broker, topics = MemoryBroker(), Topics("adm2")
    (io_a, a), (io_b, b) = await _ledgers(broker, topics, "worker-a", "worker-b")
    bound = 2 * 16  # (max_lag 1 + 1) * a learner batch of 16 samples
    await a.claim([(f"a{i}/0", 8) for i in range(3)])
    await b.claim([(f"b{i}/0", 8) for i in range(3)])
    await a.catch_up(deadline_s=5)
    started = [k for k, t in sorted(a.tickets.items(), key=lambda kv: kv[1]) if admissible(t, 0, bound)]
    assert started == ["a0/0", "a1/0", "a2/0", "b0/0"]  # 32 samples, split between the workers as claimed
    # The learner consumes 16: two more attempts, whichever worker holds them.
    assert [k for k, t in a.tickets.items() if admissible(t, 16, bound)][-2:] == ["b1/0", "b2/0"]
    for io in (io_a, io_b):
        await io.__aexit__(None, None, None)


async def test_offers_count_until_a_worker_claims_them():
    broker, topics = MemoryBroker(), Topics("adm3")
    (io_p, p), (io_w, w) = await _ledgers(broker, topics, "producer", "worker")
    await p.offer([("t1/0", 8), ("t2/0", 8)])
    assert p.unclaimed_offered == 16  # counted at once, before it is read back
    await w.claim([("t1/0", 8)])
    await p.catch_up(deadline_s=5)
    assert p.unclaimed_offered == 8
    await p.offer([("t1/0", 8)])  # offered again after a producer restart: already claimed, not counted
    assert p.unclaimed_offered == 8
    for io in (io_p, io_w):
        await io.__aexit__(None, None, None)


async def test_a_malformed_claim_is_dead_lettered_and_the_ledger_goes_on():
    broker, topics = MemoryBroker(), Topics("adm4")
    ((io_a, a),) = await _ledgers(broker, topics, "worker-a")
    producer = MemoryTransport(broker).producer()
    await producer.send_and_wait(topics.admissions, b"\x00not msgpack", b"adm4")
    await a.claim([("t1/0", 4)])
    await a.catch_up(deadline_s=5)
    assert a.tickets == {"t1/0": 4}
    assert any(r.key == b"adm4" for part in broker.topics[topics.dead_letter] for r in part)
    await io_a.__aexit__(None, None, None)


def _claim(ledger: AdmissionLedger, *keys: str, samples: int = 4) -> None:
    ledger.apply(Admission(run_id="r", kind="claim", member="rw", keys=list(keys), samples=[samples] * len(keys)))


def test_a_reader_remembers_a_bounded_number_of_attempts():
    ledger = AdmissionLedger("r", "rw", sub=None, pub=None, retain=100)  # type: ignore[arg-type]
    for i in range(1_000):
        _claim(ledger, f"t{i}/0")
        ledger.apply(Admission(run_id="r", kind="offer", member="p", keys=[f"o{i}/0"], samples=[4]))
    assert len(ledger.tickets) < 200 and len(ledger.order) < 200  # between retain and twice retain
    # Offers: a repeat of a recent one is ignored; the oldest is forgotten and counts again.
    before = ledger.unclaimed_offered
    ledger.apply(Admission(run_id="r", kind="offer", member="p", keys=["o999/0", "o0/0"], samples=[4, 4]))
    assert ledger.unclaimed_offered == before + 4
    assert ledger.claimed_samples == 4_000  # the count is not forgotten, only the keys
    assert ledger.ticket("t999/0") == 4_000 and ledger.ticket("t0/0") is None
    # A recent attempt claimed again keeps its ticket; a forgotten one counts as new, behind all others.
    _claim(ledger, "t990/0", "t0/0")
    assert (ledger.ticket("t990/0"), ledger.claims("t990/0")) == (3_964, 2)
    assert ledger.ticket("t0/0") == 4_004


def test_claimed_since_hands_out_every_claim_once_across_forgetting():
    ledger = AdmissionLedger("r", "learner", sub=None, pub=None, retain=10)  # type: ignore[arg-type]
    seen: list[str] = []
    position = 0
    for i in range(95):
        _claim(ledger, f"t{i}/0")
        if i % 7 == 0:
            new, position = ledger.claimed_since(position)
            seen += new
    new, position = ledger.claimed_since(position)
    assert seen + new == [f"t{i}/0" for i in range(95)] and position == 95
    # A reader that fell further behind than the ledger remembers gets what is left, in order.
    late, _ = ledger.claimed_since(0)
    assert late == ledger.order and late[-1] == "t94/0"
