"""Small Hugging Face models for the demo and tests, made locally.

``create_tiny_llama`` writes a Llama-architecture model and a character-level
tokenizer into one directory (``config.json``, ``model.safetensors``,
``tokenizer.json``), which transformers and vLLM both load.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def char_tokenizer(alphabet: str):
    """A fast tokenizer with one token per character of ``alphabet``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def create_tiny_llama(
    out_dir: str | Path,
    alphabet: str,
    *,
    seed: int = 0,
    hidden_size: int = 96,
    layers: int = 3,
    heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 64,
):
    """Create, save and return ``(model, tokenizer)``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer(alphabet)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's chat layout (ChatML, each image as ``<|vision_start|><|image_pad|><|vision_end|>``)."""


def create_tiny_qwen2_vl(
    out_dir: str | Path,
    tokenizer,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,
    vision_dim: int = 32,
    vision_depth: int = 2,
    max_positions: int = 1024,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112,
) -> Path:
    """A Qwen2-VL-architecture model at a tiny size, random-initialised, saved with ``tokenizer``
    (given the vision and ChatML tokens it lacks, the multimodal chat template, ``<|im_end|>`` as
    EOS) and its image processor (``min_pixels``..``max_pixels``: a 112-pixel picture is 64
    patches, 16 image tokens after the 2x2 merge). Loads with ``AutoModelForImageTextToText``."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer.add_special_tokens(
        {"additional_special_tokens": [t for t in CHAT_TOKENS + VISION_TOKENS if t not in tokenizer.get_vocab()]}
    )
    tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|vision_end|>"
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = hidden_size // heads
    # M-RoPE splits each head's rotary half-dimension over (time, height, width), 1 : 1.5 : 1.5 as Qwen2-VL does
    half = head_dim // 2
    spatial = (half - half // 4) // 2
    section = [half - 2 * spatial, spatial, spatial]
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": vision_depth,
            "embed_dim": vision_dim,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(out)
    return out
