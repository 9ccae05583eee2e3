"""The admission ledger: one global order of claimed samples, whoever claims and however often."""

from __future__ import annotations

import pytest

from conveyor.admission import AdmissionLedger, admissible
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
