"""Tasks with images: the contract's image parts and their schema version, images checked and
stored once by content, and the dataset layouts users keep images in (veRL's multimodal parquet,
Hugging Face's ``Image`` feature, OpenAI's data URLs), each record's faults named by field."""

from __future__ import annotations

import base64
import io
import json

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conveyor.contracts import (
    ChatMessage,
    DecodeError,
    ImagePart,
    Rollout,
    ScoredRollout,
    Task,
    TextPart,
    decode,
    encode,
)
from conveyor.errors import ChecksumMismatch
from conveyor.images import MAX_IMAGE_SIDE, ImageError, check_image, encode_png, load_image, store_image
from conveyor.objectstore import LocalObjectStore
from producers.loaders import RecordRejected, load_tasks


def png(color=(255, 0, 0), size=(24, 16)) -> bytes:
    return encode_png(Image.new("RGB", size, color))


def cut_png() -> bytes:
    """A noisy PNG cut in half: its pixel data ends early."""
    noisy = Image.frombytes("RGB", (64, 64), bytes((i * 7919) % 251 for i in range(64 * 64 * 3)))
    data = encode_png(noisy)
    return data[: len(data) // 2]


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "store")


def image_task(store, **kw) -> Task:
    part = store_image(store, png())
    msg = ChatMessage(role="user", content=[part, TextPart(text="What colour?")])
    return Task(task_id="t1", run_id="r", messages=[msg], **kw)


# ---------------------------------------------------------------- contracts


def test_an_image_task_round_trips_as_schema_version_2(store):
    task = image_task(store)
    assert task.schema_version == 2
    again = decode(encode(task), Task)
    assert again == task
    assert again.images == [task.messages[0].content[0]]
    assert again.messages[0].text == "<image>What colour?"
    # text-only traffic stays version 1, readable by readers that predate images
    assert Task(task_id="t2", run_id="r", prompt="hi").schema_version == 1


def test_a_rollout_and_its_score_carry_their_task_s_version(store):
    task = image_task(store)
    ro = Rollout(
        rollout_id="ro", task_id="t1", run_id="r", sample_index=0, prompt_token_ids=[1, 2],
        completion_token_ids=[3], behaviour_logprobs=[-0.1], loss_mask=[1], version_segments=[], task=task,
    )  # fmt: skip
    scored = ScoredRollout(rollout=ro, reward=1.0, verdict="pass")
    assert ro.schema_version == scored.schema_version == 2
    assert decode(encode(scored), ScoredRollout) == scored


class _OldChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str  # what a reader before image parts expects
    name: str | None = None


class _OldTask(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag="task"):
    schema_version: int = 1
    created_at: float = 0.0
    task_id: str
    run_id: str
    prompt: str | None = None
    messages: list[_OldChatMessage] | None = None


def test_a_reader_that_predates_images_refuses_an_image_task_instead_of_misreading_it(store):
    raw = encode(image_task(store))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=_OldTask, strict=False)
    # and this code refuses a version it does not know, rather than dropping fields
    newer = msgspec.msgpack.encode({**msgspec.msgpack.decode(raw), "schema_version": 3})
    with pytest.raises(DecodeError, match="schema version 3"):
        decode(newer, Task)


def test_image_parts_must_be_well_formed():
    with pytest.raises(msgspec.ValidationError, match="sha256"):
        msgspec.convert({"key": "k", "sha256": "xyz", "media_type": "image/png", "width": 1, "height": 1}, ImagePart)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"key": "k", "sha256": "a" * 64, "media_type": "image/gif", "width": 1, "height": 1}, ImagePart)
    with pytest.raises(msgspec.ValidationError, match="not the key"):
        msgspec.convert({"key": "images/../x", "sha256": "a" * 64, "media_type": "image/png", "width": 1, "height": 1}, ImagePart)
    with pytest.raises(ValueError, match="empty list"):
        ChatMessage(role="user", content=[])


# ---------------------------------------------------------------- checking and storing


def test_images_are_stored_once_by_content_and_read_back_verified(store):
    a, b = store_image(store, png()), store_image(store, png())
    assert a == b and a.key.startswith(f"images/{a.sha256[:2]}/") and a.key.endswith(".png")
    assert (a.width, a.height) == (24, 16)
    assert load_image(store, a).getpixel((0, 0)) == (255, 0, 0)
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(jpeg, format="JPEG")
    assert store_image(store, jpeg.getvalue()).media_type == "image/jpeg"
    store.put(a.key, png((0, 0, 255)))  # the object altered behind the reference
    with pytest.raises(ChecksumMismatch):
        load_image(store, a)
    with pytest.raises(ValueError, match="not the key of its sha256"):  # a reference cannot name another object
        msgspec.structs.replace(a, key="runs/r/weights/v000001/model.safetensors")


def test_bad_images_are_refused_with_the_reason():
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    cases = {
        b"": "empty",
        b"not an image": "not a PNG, JPEG or WebP",
        gif.getvalue(): "not a PNG, JPEG or WebP",
        cut_png(): "does not decode",
    }
    for data, why in cases.items():
        with pytest.raises(ImageError, match=why):
            check_image(data)


def test_a_decompression_bomb_is_refused_before_its_pixels_are_decoded():
    # a 1-bit image a few KB long that would decode to MAX_IMAGE_SIDE+1 pixels a side
    big = Image.new("1", (MAX_IMAGE_SIDE + 1, 8))
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    with pytest.raises(ImageError, match="limits are"):
        check_image(buf.getvalue())


# ---------------------------------------------------------------- dataset layouts


def verl_vision_rows():
    return [
        {
            "data_source": "shapes",
            "prompt": [{"role": "user", "content": "<image>How many red squares? <image> and here?"}],
            "images": [{"bytes": png((255, 0, 0)), "path": None}, {"bytes": png((0, 255, 0)), "path": None}],
            "reward_model": {"ground_truth": "3", "style": "rule"},
            "extra_info": {"index": 0, "split": "train"},
        }
    ]


def test_a_verl_multimodal_parquet_becomes_image_tasks(tmp_path, store):
    path = tmp_path / "geo.parquet"
    pq.write_table(pa.Table.from_pylist(verl_vision_rows()), path)
    task = load_tasks(path, "r", "verl", put_image=lambda b: store_image(store, b)).tasks[0]
    parts = task.messages[0].content
    assert [type(p).__name__ for p in parts] == ["ImagePart", "TextPart", "ImagePart", "TextPart"]
    assert parts[1].text == "How many red squares? " and parts[3].text == " and here?"
    assert load_image(store, parts[0]).getpixel((1, 1)) == (255, 0, 0)
    assert load_image(store, parts[2]).getpixel((1, 1)) == (0, 255, 0)
    assert task.verifier.data["answer"] == "3" and task.schema_version == 2


def test_hf_image_feature_and_openai_data_urls(tmp_path, store):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png((0, 0, 255)))
    url = "data:image/png;base64," + base64.b64encode(png((9, 9, 9))).decode()
    rows = [
        # HF datasets' Image feature, one image, stored by path (relative to the file), no marker
        {"task_id": "a", "image": {"bytes": None, "path": "pics/a.png"}, "prompt": "Which colour?",
         "verifier": {"kind": "math", "data": {"answer": "blue"}}},
        # the processor's part layout: {"type": "image"} takes the column's next image
        {"task_id": "b", "image": [{"bytes": png(), "path": None}],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
         "verifier": {"kind": "math", "data": {"answer": "red"}}},
        # OpenAI's layout, the image inline as a data URL
        {"task_id": "c", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": url}}]}],
         "verifier": {"kind": "math", "data": {"answer": "grey"}}},
    ]  # fmt: skip
    path = tmp_path / "vqa.jsonl"
    rows[1]["image"][0]["bytes"] = None
    rows[1]["image"][0]["path"] = str(tmp_path / "pics" / "a.png")  # absolute paths too
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tasks = {t.task_id: t for t in load_tasks(path, "r", {"images": "image"}, put_image=lambda b: store_image(store, b)).tasks}
    a, b, c = tasks["a"], tasks["b"], tasks["c"]
    assert a.prompt is None and a.messages[0].text == "<image>Which colour?"
    assert a.images[0] == b.images[0]  # the same picture is one object
    assert b.messages[0].text == "<image>Colour?"
    assert c.messages[0].text == "And this?<image>" and load_image(store, c.images[0]).getpixel((0, 0)) == (9, 9, 9)


@pytest.mark.parametrize(
    "row, field, why",
    [
        ({"images": [{"bytes": b"junk"}]}, "images[0]", "not a PNG, JPEG or WebP"),
        ({"images": [{"bytes": None, "path": "absent.png"}]}, "images[0]", "cannot read image"),
        ({"images": [{"bytes": None, "path": None}]}, "images[0]", "neither bytes nor path"),
        ({"images": ["https://example.com/a.png"]}, "images[0]", "not fetched"),
        ({"prompt": [{"role": "user", "content": "<image><image>?"}]}, "prompt[0].content", "no image left"),
        ({"prompt": [{"role": "user", "content": "<image>?"}], "images": [{"bytes": png()}] * 2}, "images", "2 images but 1"),
        ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]}, "prompt[0].content[0]", "type text, image or image_url"),
    ],
)
def test_bad_image_records_are_refused_naming_the_field(tmp_path, store, row, field, why):
    base = {
        "prompt": [{"role": "user", "content": "<image>How many?"}],
        "images": [{"bytes": png()}],
        "reward_model": {"ground_truth": "1"},
    }
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{**base, **row}]), path)
    with pytest.raises(RecordRejected) as err:
        load_tasks(path, "r", "verl", put_image=lambda b: store_image(store, b))
    assert err.value.error.field == field and why in err.value.error.reason


def test_images_without_an_object_store_are_refused(tmp_path):
    path = tmp_path / "geo.parquet"
    pq.write_table(pa.Table.from_pylist(verl_vision_rows()), path)
    with pytest.raises(RecordRejected, match="no object store"):
        load_tasks(path, "r", "verl")


# ---------------------------------------------------------------- the HTTP API


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def api_task(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {
        "task_id": "v-1",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "How many circles?"}]}],
        "verifier": {"kind": "math", "data": {"answer": "2"}},
    }


def test_the_api_stores_submitted_images_and_refuses_bad_ones_naming_the_part(store):
    import asyncio

    import httpx

    from conveyor.config import ProducerConfig
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryBroker, MemoryTransport
    from producers.api import create_app

    broker = MemoryBroker()
    app = create_app(MemoryTransport(broker), ProducerConfig(suite=None, max_images_per_task=2), store=store)
    bare = create_app(MemoryTransport(MemoryBroker()), ProducerConfig(suite=None))  # no object store

    async def post(app, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
            await c.post("/v1/runs", json={"run_id": "r"})
            return await c.post("/v1/runs/r/tasks", json=body)

    async def go():
        ok = await post(app, {"tasks": [api_task(data_url(png()))]})
        assert ok.status_code == 202, ok.text
        (raw,) = [rec.value for part in broker.topics[Topics("r").tasks] for rec in part]
        task = decode(raw, Task)
        assert task.schema_version == 2 and task.messages[0].text == "<image>How many circles?"
        assert load_image(store, task.images[0]).getpixel((0, 0)) == (255, 0, 0)
        assert len(raw) < 1024  # the record holds the reference, not the pixels
        loc = ["body", "tasks", 0, "messages", 0, "content", 1, "image_url", "url"]
        bad = {
            data_url(b"not a png"): "not a PNG, JPEG or WebP",
            data_url(cut_png()): "does not decode",
            "data:image/png;base64,!!!": "base64 does not decode",
            "https://example.com/cat.png": "not fetched",
            "data:image/gif;base64,R0lG": "expected a data:image/png|jpeg|webp",
        }
        for url, why in bad.items():
            r = await post(app, {"tasks": [api_task(data_url(png()), url)]})
            assert r.status_code == 422, (url, r.text)
            assert r.json()["detail"][0]["loc"] == loc and why in r.json()["detail"][0]["msg"]
        many = await post(app, {"tasks": [api_task(*[data_url(png())] * 3)]})
        assert many.status_code == 422 and "producer.max_images_per_task" in many.text
        assert (await post(bare, {"tasks": [api_task(data_url(png()))]})).status_code == 422
        assert sum(map(len, broker.topics[Topics("r").tasks])) == 1  # nothing of a refused request was published

    asyncio.run(go())


def test_the_lake_keeps_references_and_replay_reads_the_pictures_back(store):
    from storage.columns import rows_from_table, table_from_rows

    task = image_task(store)
    ro = Rollout(
        rollout_id="ro", task_id="t1", run_id="r", sample_index=0, prompt_token_ids=[1, 2],
        completion_token_ids=[3], behaviour_logprobs=[-0.1], loss_mask=[1], version_segments=[], task=task,
    )  # fmt: skip
    table = table_from_rows([ScoredRollout(rollout=ro, reward=1.0, verdict="pass")])
    assert table.nbytes < 4096  # references, not pixels
    (back,) = rows_from_table(table)
    assert back.rollout.task == task
    assert load_image(store, back.rollout.task.images[0]).getpixel((0, 0)) == (255, 0, 0)
