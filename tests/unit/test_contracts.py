from __future__ import annotations

import msgspec
import pytest

from conveyor.contracts import (
    ClaimRef,
    DecodeError,
    Feedback,
    LearnerProgress,
    Rollout,
    ScoredRollout,
    Task,
    VersionSegment,
    WeightsAnnouncement,
    decode,
    decode_any,
    decode_or_claim,
    encode,
    float32_array,
    int32_array,
    rollout_id,
    to_builtins,
    uint8_array,
)


def make_rollout(n: int = 5, sample_index: int = 0) -> Rollout:
    task = Task(task_id="t1", run_id="r", prompt="def f():", group_size=4)
    return Rollout(
        rollout_id=rollout_id("t1", sample_index),
        task_id="t1",
        run_id="r",
        sample_index=sample_index,
        group_size=4,
        prompt_token_ids=int32_array([1, 2, 3]),
        completion_token_ids=int32_array(range(n)),
        behaviour_logprobs=float32_array([-0.5] * n),
        loss_mask=uint8_array([1] * n),
        version_segments=[VersionSegment(start=0, end=n, policy_version=3)],
        task=task,
    )


def test_every_message_round_trips():
    r = make_rollout()
    messages = [
        r.task,
        r,
        ScoredRollout(rollout=r, reward=1.0, verdict="pass", feedback=Feedback(message="ok")),
        WeightsAnnouncement(run_id="r", version=2, key="k", uri="s3://b/k", sha256="ab" * 32),
        LearnerProgress(run_id="r", samples_consumed=10, policy_version=2),
        ClaimRef(key="claims/x", uri="s3://b/claims/x", sha256="00", size=1, message_type="rollout"),
    ]
    for msg in messages:
        back = decode(encode(msg), type(msg))
        assert back == msg
        assert back.schema_version == 1 and back.created_at == msg.created_at
        assert decode_any(encode(msg)) == msg


def test_rollout_id_is_deterministic_and_distinct():
    assert rollout_id("t", 0) == rollout_id("t", 0)
    ids = {rollout_id("t", i, a) for i in range(8) for a in range(3)}
    assert len(ids) == 24
    assert rollout_id("t", 1) != rollout_id("t1", 0)


def test_token_arrays_are_packed_on_the_wire():
    r = make_rollout(n=4000)
    raw = encode(r)
    # 4000 int32 + 4000 float32 + 4000 uint8 = 36 KB; msgpack lists of ints/doubles would be ~50 KB+.
    assert len(raw) < 37_000
    back = decode(raw, Rollout)
    assert back.completion_token_ids.tolist() == list(range(4000))
    assert back.behaviour_logprobs.format == "f" and back.behaviour_logprobs[0] == -0.5
    assert back.loss_mask.format == "B"


def test_constructors_accept_plain_sequences():
    import array

    r = make_rollout(n=3)
    same = msgspec.structs.replace(r, completion_token_ids=[0, 1, 2], behaviour_logprobs=array.array("f", [-0.5] * 3))
    assert same == r
    assert same.completion_token_ids.format == "i"


def test_messages_are_frozen():
    t = Task(task_id="t", run_id="r", prompt="p")
    with pytest.raises(AttributeError):
        t.task_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"t": "task", "task_id": 1})],
)
def test_garbage_is_a_decode_error(raw):
    with pytest.raises(DecodeError):
        decode(raw, Task)


def test_wrong_message_type_is_a_decode_error():
    raw = encode(LearnerProgress(run_id="r", samples_consumed=1, policy_version=0))
    with pytest.raises(DecodeError, match="Task"):
        decode(raw, Task)


def test_misaligned_rollout_arrays_are_rejected_on_decode():
    r = make_rollout()
    builtins = msgspec.msgpack.decode(encode(r))
    builtins["loss_mask"] = b"\x01\x01"  # 2 entries for 5 tokens
    with pytest.raises(DecodeError, match="disagree"):
        decode(msgspec.msgpack.encode(builtins), Rollout)


def test_a_rollout_with_completion_tokens_and_no_prompt_tokens_is_rejected():
    """The learner reads a completion's first log-prob at the prompt's last position: without
    one it would read another row's. Refused at construction and on decode (dead letter)."""
    with pytest.raises(ValueError, match="no prompt tokens"):
        msgspec.structs.replace(make_rollout(), prompt_token_ids=int32_array([]))
    builtins = msgspec.msgpack.decode(encode(make_rollout()))
    builtins["prompt_token_ids"] = b""
    with pytest.raises(DecodeError, match="no prompt tokens"):
        decode(msgspec.msgpack.encode(builtins), Rollout)
    assert (
        len(msgspec.structs.replace(make_rollout(0), prompt_token_ids=int32_array([])).prompt_token_ids) == 0
    )  # nothing to predict


def test_packed_array_with_torn_bytes_is_rejected():
    builtins = msgspec.msgpack.decode(encode(make_rollout()))
    builtins["completion_token_ids"] = b"\x01\x02\x03"  # not a multiple of 4
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode(builtins), Rollout)


def test_task_needs_a_prompt():
    with pytest.raises(ValueError):
        Task(task_id="t", run_id="r")


def test_decode_or_claim_tells_a_claim_from_the_message():
    ref = ClaimRef(key="k", uri="u", sha256="s", size=1, message_type="rollout")
    assert isinstance(decode_or_claim(encode(ref), Rollout), ClaimRef)
    assert isinstance(decode_or_claim(encode(make_rollout()), Rollout), Rollout)


def test_to_builtins_is_json_friendly():
    import json

    view = to_builtins(make_rollout())
    json.dumps(view)
    assert view["completion_token_ids"] == [0, 1, 2, 3, 4]
    assert view["version_segments"] == [[0, 5, 3]]
