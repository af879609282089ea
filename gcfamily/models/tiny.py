"""`tiny`: a small random Llama built in code with a character-level tokenizer; no files, no download."""

from __future__ import annotations

from typing import Any

import torch

TINY_CONTEXT = 1024
TINY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + ('<eos>' if m['role'] == 'assistant' else '') + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tiny_tokenizer() -> Any:
    """A character-level tokenizer over printable ASCII with a chat template; built offline."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per char
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=TINY_SPECIALS[4:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2) -> Any:
    """A random Llama small enough for a test to train in seconds on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model
