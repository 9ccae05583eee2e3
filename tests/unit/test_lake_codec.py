"""Lake rows: exact round trip, deterministic bytes, names from contents."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from conveyor.contracts import (
    ChatMessage,
    Feedback,
    Rollout,
    ScoredRollout,
    Task,
    Timings,
    ToolCall,
    Turn,
    VerifierSpec,
    VersionSegment,
    float32_array,
    int32_array,
    rollout_id,
    uint8_array,
)
from storage.lake import SCHEMA, parquet_bytes, part_key, rows_from_table


def scored(i: int, n: int = 50, version: int = 3, **kw) -> ScoredRollout:
    task = Task(task_id=f"t{i // 4}", run_id="r", messages=[ChatMessage(role="user", content="hi")], group_size=4,
                verifier=VerifierSpec(kind="math", data={"answer": "2", "tolerance": 0.1}), metadata={"src": "x"})  # fmt: skip
    r = Rollout(
        rollout_id=rollout_id(task.task_id, i % 4),
        task_id=task.task_id,
        run_id="r",
        sample_index=i % 4,
        attempt=1,
        group_size=4,
        prompt_token_ids=int32_array(range(7)),
        completion_token_ids=int32_array(range(i, i + n)),
        behaviour_logprobs=float32_array([-0.125 * k for k in range(n)]),
        loss_mask=uint8_array([1, 0] * (n // 2)),
        version_segments=[
            VersionSegment(start=0, end=n // 2, policy_version=version),
            VersionSegment(start=n // 2, end=n, policy_version=version + 1),
        ],  # fmt: skip
        turns=[Turn(role="assistant", text="x", tool_calls=[ToolCall(name="f", arguments={"a": 1})])],
        finish_reason="length",
        timings=Timings(task_received_at=1.5, generation_started_at=2.5, generation_finished_at=3.25),
        task=task,
    )
    return ScoredRollout(rollout=r, reward=0.1 * i, verdict="fail", feedback=Feedback(message="m", line=3),
                         details={"tests_passed": 1.0}, completion_text=f"answer {i}", **kw)  # fmt: skip


def test_rows_round_trip_exactly():
    rows = [scored(i) for i in range(6)] + [ScoredRollout(rollout=scored(9).rollout, reward=1.0, verdict="pass")]
    back = rows_from_table(pq.read_table(io.BytesIO(parquet_bytes(rows))))
    assert back == rows


def test_columns_are_typed():
    table = pq.read_table(io.BytesIO(parquet_bytes([scored(0)])))
    assert table.schema.equals(SCHEMA)
    assert table.column("completion_token_ids").type.value_type == "int32"
    assert table.column("behaviour_logprobs").type.value_type == "float"
    assert table.column("policy_version_min").to_pylist() == [3] and table.column("policy_version_max").to_pylist() == [4]


def test_token_lists_are_required_and_older_nullable_parts_still_read():
    rows = [scored(i) for i in range(3)]
    table = pq.read_table(io.BytesIO(parquet_bytes(rows)))
    for name in ("prompt_token_ids", "completion_token_ids", "behaviour_logprobs"):
        field = table.schema.field(name)
        assert not field.nullable and not field.type.value_field.nullable, name
    assert table.schema.field("loss_mask").type == pa.binary() and not table.schema.field("loss_mask").nullable
    # A part written before the lists were required (nullable list<item>) decodes to the same rows.
    legacy = pa.schema([pa.field(f.name, pa.list_(f.type.value_type)) if pa.types.is_list(f.type) else f for f in SCHEMA])
    buf = io.BytesIO()
    pq.write_table(table.cast(legacy), buf)
    old = pq.read_table(io.BytesIO(buf.getvalue()))
    assert old.schema.field("completion_token_ids").nullable
    assert rows_from_table(old) == rows


def test_same_rows_same_bytes_and_name():
    rows = [scored(i) for i in range(4)]
    assert parquet_bytes(rows) == parquet_bytes(rows)
    ids = [r.rollout_id for r in rows]
    assert part_key("r", 3, ids) == part_key("r", 3, list(reversed(ids)))
    assert part_key("r", 3, ids) != part_key("r", 3, ids[:3])
    assert part_key("r", 3, ids).startswith("runs/r/lake/policy_version=3/part-")


def test_parts_with_the_loss_mask_as_a_uint8_list_still_read():
    rows = [scored(i) for i in range(5)] + [scored(7, n=0)]
    table = pq.read_table(io.BytesIO(parquet_bytes(rows)))
    masks = pa.array([list(bytes(r.rollout.loss_mask)) for r in rows], pa.list_(pa.uint8()))
    i = table.schema.get_field_index("loss_mask")
    buf = io.BytesIO()
    pq.write_table(table.set_column(i, pa.field("loss_mask", pa.list_(pa.uint8())), masks), buf)
    old = pq.read_table(io.BytesIO(buf.getvalue()))
    assert pa.types.is_list(old.schema.field("loss_mask").type)
    assert rows_from_table(old) == rows
    assert rows_from_table(old.slice(2, 3)) == rows[2:5]  # views honour a sliced table's offsets
    assert rows_from_table(table.slice(2, 3)) == rows[2:5]
