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
