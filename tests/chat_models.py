"""A chat model made locally, as a user's Hub model looks: a small Qwen2-architecture model and a
byte-level BPE tokenizer trained with ``tokenizers``, saved with a ChatML chat template."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS = [
    "What is 12 + 30? The answer is 42.",
    "You are a helpful assistant. Think step by step, then answer.",
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
] * 20


def bpe_chat_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer (trained here) with ChatML special tokens and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's own pre-tokenizer: transformers 5 loads a qwen2 model's tokenizer as Qwen2Tokenizer,
    # which splits text this way whatever tokenizer.json says.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def create_tiny_qwen2_chat(out_dir: str | Path, *, seed: int = 0, tokenizer=None, hidden_size: int = 64,
                           heads: int = 4, max_positions: int = 256) -> Path:  # fmt: skip
    """A Qwen2-architecture causal LM with the chat tokenizer, saved as an HF directory.

    BPE training breaks ties between equally frequent pairs in no fixed order, so two trainings
    may differ: pass ``tokenizer`` to save one already made. vLLM's CPU attention wants a head
    size of 32 or more (``hidden_size / heads``)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tok = tokenizer or bpe_chat_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out
