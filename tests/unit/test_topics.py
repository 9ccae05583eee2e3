import pytest

from conveyor.contracts import Rollout, Task
from conveyor.topics import Topics, message_type_of


def test_names_are_namespaced_by_run():
    t = Topics("run-1")
    assert t.tasks == "conveyor.run-1.tasks"
    assert t.dead_letter == "conveyor.run-1.dead-letter"
    assert len(set(t.all())) == 8
    assert message_type_of(t.tasks) is Task and message_type_of(t.rollouts) is Rollout
    assert message_type_of("unrelated") is None
    specs = {s.name: s for s in t.specs(partitions=8)}
    assert specs[t.rollouts].partitions == 8 and not specs[t.rollouts].compacted
    assert specs[t.weights].partitions == 1 and specs[t.weights].compacted
    assert specs[t.admissions].partitions == 1  # the ledger is read in one order by every reader


@pytest.mark.parametrize("bad", ["", "a b", "-x", "a.b", "x" * 65])
def test_bad_run_ids_are_refused(bad):
    with pytest.raises(ValueError):
        Topics(bad)
