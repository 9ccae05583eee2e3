"""A vision-language model through the engine and the learner: prompts with images tokenized
from their references alone (each image's pads as many as its patches), the reference engine
sampling with the pictures, and the learner's log-probabilities of those samples equal to the
engine's (image pads are context, never loss tokens), then a training step on them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conveyor.config import LearnerConfig
from conveyor.contracts import ChatMessage, Task, TextPart
from conveyor.images import encode_png, load_image, store_image
from conveyor.objectstore import LocalObjectStore
from conveyor.vision import VisionModelError, VisionPrompting, is_vision_model
from learner.trainer import Trainer
from learner.vision import vision_logprobs
from rollout_workers.engine import BatchingEngine, SamplingRequest
from rollout_workers.refusals import TaskLimits, refusal
from rollout_workers.vision_engine import VisionReferenceEngine
from tests.vision_models import create_tiny_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return create_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "store")


def picture(colour, size=(112, 112)):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(img).ellipse((20, 20, 60, 60), fill=colour)
    return img


def image_task(store, img, text="How many circles?", task_id="t1") -> Task:
    part = store_image(store, encode_png(img))
    return Task(task_id=task_id, run_id="r", messages=[ChatMessage(role="user", content=[part, TextPart(text=text)])])


def test_a_prompt_has_as_many_image_pads_as_its_picture_has_merged_patches(vlm, store):
    prompting = VisionPrompting(vlm)
    assert is_vision_model(vlm)
    for size in ((112, 112), (84, 56), (300, 200)):
        task = image_task(store, picture((255, 0, 0), size))
        ids = prompting.encode_prompt(task.messages)
        grid = prompting.pixel_inputs([load_image(store, task.images[0])])["image_grid_thw"][0]
        pads = sum(t == prompting.image_token_id for t in ids)
        assert pads == int(grid.prod()) // prompting.merge_size**2 == prompting.tokens_per_image(*size)
    # what the model itself checks: as many pads as image features
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm).eval()
    pix = prompting.pixel_inputs([load_image(store, task.images[0])])
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        model(input_ids=ids_t, mm_token_type_ids=prompting.image_mask(ids_t), **pix)


def test_a_text_model_directory_is_not_a_vision_model(tmp_path):
    from tests.chat_models import create_tiny_qwen2_chat

    text = create_tiny_qwen2_chat(tmp_path / "text")
    assert not is_vision_model(text)
    with pytest.raises(VisionModelError, match="family 'qwen2' is not handled"):
        VisionPrompting(text)


def test_workers_without_a_vision_model_refuse_image_tasks(store):
    task = image_task(store, picture((0, 0, 255)))
    from conveyor.contracts import SamplingParams

    why = refusal(task, SamplingParams(), 0, TaskLimits())
    assert why is not None and "reads no images" in why
    assert refusal(task, SamplingParams(), 0, TaskLimits(vision=True)) is None


def test_engine_and_learner_log_probabilities_agree_on_image_tasks(vlm, store):
    engine = VisionReferenceEngine(vlm, seed=3)
    assert engine.reads_images
    tasks = [image_task(store, picture(c), task_id=f"t{i}") for i, c in enumerate([(255, 0, 0), (0, 200, 0)])]
    text_only = Task(task_id="t9", run_id="r", messages=[ChatMessage(role="user", content="Say hi")])
    prompts = [engine.encode_prompt(None, t.messages) for t in [*tasks, text_only]]
    images = [[load_image(store, t.images[0])] for t in tasks] + [[]]
    for temperature in (1.0, 0.7):  # log-probabilities of softmax(logits / T), the distribution sampled
        batched = asyncio.run(_generate(BatchingEngine(engine), prompts, images, temperature))
        rows = [(p, c, im) for p, im, group in zip(prompts, images, batched) for c in group]
        assert len(rows) == 6 and all(c.token_ids for _, c, _ in rows)
        assert not any(set(c.token_ids) & set(engine.prompting.placeholder_ids) for _, c, _ in rows)
        learner = vision_logprobs(engine.model, engine.prompting, [r[0] for r in rows], [r[1].token_ids for r in rows],
                                  [r[2] for r in rows], engine.tokenizer.pad_token_id, temperatures=[temperature] * 6)  # fmt: skip
        for lp, (_, c, _) in zip(learner, rows):
            assert torch.allclose(lp, torch.tensor(c.logprobs), atol=2e-5), (lp, c.logprobs)
        # the image pads are prompt tokens: only the completion gets log-probabilities
        assert [len(lp) for lp in learner] == [len(c.token_ids) for _, c, _ in rows]


async def _generate(engine, prompts, images, temperature):
    await engine.start()
    try:
        reqs = [
            SamplingRequest(p, n=2, max_tokens=6, temperature=temperature, images=tuple(im)) for p, im in zip(prompts, images)
        ]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))
    finally:
        await engine.close()


def test_a_training_step_on_image_samples(vlm, store):
    engine = VisionReferenceEngine(vlm, seed=5)
    task = image_task(store, picture((255, 0, 0)))
    prompt = engine.encode_prompt(None, task.messages)
    img = load_image(store, task.images[0])
    (group,) = engine.generate([prompt], 4, max_new_tokens=5, images=[[img]])
    cfg = LearnerConfig(lr=1e-2, pack_tokens=0)
    trainer = Trainer(engine.model, engine.tokenizer.pad_token_id, cfg, vision=engine.prompting)
    work = {
        "prompts": [prompt] * 4,
        "completions": [c.token_ids for c in group],
        "behaviour": [torch.tensor(c.logprobs) for c in group],
        "advantages": [1.0, -1.0, 0.5, -0.5],
        "masks": [torch.ones(len(c.token_ids)) for c in group],
        "fresh": [True] * 4,
        "temps": [1.0] * 4,
        "images": [[img]] * 4,
    }
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stats = trainer.step(work)
    assert stats["logprob_mismatch_max"] < 1e-4  # the learner sees what the engine sampled from
    assert stats["tokens"] == sum(len(c.token_ids) for c in group)
    changed = {k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])}
    assert any(k.startswith("model.visual") for k in changed)  # the vision tower trains too
    with pytest.raises(ValueError, match="one process"):
        Trainer(engine.model, 0, cfg, ranks=object(), vision=engine.prompting)


def test_the_vllm_engine_gets_one_placeholder_per_image_and_the_pictures(vlm, store):
    from rollout_workers.vllm_engine import VLLMEngine

    engine = VLLMEngine(vlm)  # not started: what it would hand vLLM is what is tested (vLLM's vision models need torchvision)
    assert engine.reads_images
    task = image_task(store, picture((255, 0, 0)))
    ids = engine.encode_prompt(None, task.messages)
    assert ids == VisionPrompting(vlm).encode_prompt(task.messages)  # the ids the rollout keeps, as the learner reads them
    img = load_image(store, task.images[0])
    given = engine.engine_prompt(SamplingRequest(ids, images=(img,)))
    pad = engine.prompting.image_token_id
    assert given["prompt_token_ids"].count(pad) == 1 and given["multi_modal_data"] == {"image": [img]}
    assert [t for t in given["prompt_token_ids"] if t != pad] == [t for t in ids if t != pad]
    assert engine.engine_prompt(SamplingRequest([5, 6])) == {"prompt_token_ids": [5, 6]}
