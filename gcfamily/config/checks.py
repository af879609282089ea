"""Range and choice checks of the shared settings: every numeric setting has a range, every choice its values, and a
value outside is one sentence naming the setting, the rule and the value. A method checks its own in Method.validate.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from gcfamily.config import FIELDS, Config
from gcfamily.errors import GcfError


# Caps far past any run one machine can hold; past them a setting is a typo (1e9 for 1e3), refused before any allocation.
MAX_SEQUENCE_TOKENS = 2**20
"""max_length and max_new_tokens: no model gcfamily can train has a longer context (1,048,576 tokens)."""
MAX_ROWS = 2**20
"""batch_size, and batch_size * group_size rows sampled per step (the sampler holds a [rows, vocabulary] logits tensor)."""
MAX_GROUP = 2**16
"""group_size."""
MAX_SAMPLED_TOKENS = 2**31
"""batch_size * group_size * max_new_tokens: the sampler holds a [rows, max_new_tokens] token buffer and a KV cache as long."""


def _whole(lo: int, hi: Optional[int] = None) -> Any:
    """An int (never a bool) in [lo, hi]."""
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and lo <= x and (hi is None or x <= hi)


def _real(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False) -> Any:
    """A finite number (never a bool) between lo and hi; NaN and infinities fail every test."""
    def ok(x: Any) -> bool:
        if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)):
            return False
        return (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)

    return ok


# Every numeric shared setting: (test, the rule the sentence states). A float rule says "finite": NaN and inf are refused.
RANGES: dict[str, tuple[Any, str]] = {
    "seed": (_whole(0, 2**63 - 1), "in [0, 2**63)"),
    "task_seed": (_whole(0, 2**63 - 1), "in [0, 2**63) or none"),
    "max_steps": (_whole(0), ">= 0"),
    "max_time": (_real(0), ">= 0 and finite (0 = no limit)"),
    "max_tokens": (_whole(0), ">= 0 (0 = no limit)"),
    "max_flops": (_real(0), ">= 0 and finite (0 = no limit)"),
    "validation_rows": (_whole(0), ">= 0 (0 = evaluate on the test split)"),
    "batch_size": (_whole(1, MAX_ROWS), f"in [1, {MAX_ROWS}]"),
    "micro_batch_size": (_whole(1), ">= 1"),
    "norm_constant": (_real(0, lo_open=True), "> 0 and finite"),
    "chunk_size": (_whole(1), ">= 1"),
    "max_length": (_whole(2, MAX_SEQUENCE_TOKENS), f"in [2, {MAX_SEQUENCE_TOKENS}] tokens"),
    "lr": (_real(0, lo_open=True), "> 0 and finite"),
    "weight_decay": (_real(0), ">= 0 and finite"),
    "warmup_steps": (_whole(0), ">= 0"),
    "min_lr_ratio": (_real(0, 1), "in [0, 1]"),
    "grad_clip": (_real(0), ">= 0 and finite (0 turns clipping off)"),
    "max_bad_steps": (_whole(1), ">= 1"),
    "group_size": (_whole(1, MAX_GROUP), f"in [1, {MAX_GROUP}]"),
    "max_new_tokens": (_whole(1, MAX_SEQUENCE_TOKENS), f"in [1, {MAX_SEQUENCE_TOKENS}] tokens"),
    "temperature": (_real(0, lo_open=True), "> 0 and finite"),
    "top_p": (_real(0, 1, lo_open=True), "in (0, 1]"),
    "top_k": (_whole(0), ">= 0 (0 = off)"),
    "reward_timeout": (_real(0), ">= 0 seconds and finite (0 = no limit)"),
    "log_every": (_whole(1), ">= 1"),
    "eval_every": (_whole(0), ">= 0 (0 = only before and after)"),
    "eval_every_s": (_real(0), ">= 0 and finite (0 = off)"),
    "eval_samples": (_whole(1), ">= 1"),
    "save_every": (_whole(0), ">= 0 (0 = only at the end)"),
    "keep_last": (_whole(1), ">= 1"),
    "log_completions_every": (_whole(0), ">= 0 (0 = off)"),
    "lora_r": (_whole(0), ">= 0 (0 = full fine-tuning)"),
    "lora_alpha": (_real(0, lo_open=True), "> 0 and finite"),
    "lora_dropout": (_real(0, 1, hi_open=True), "in [0, 1)"),
    "dist_timeout": (_real(0, lo_open=True), "> 0 seconds and finite"),
}
LABELS = {"lr": "lr (learning rate)"}


def _ranges(cfg: Config) -> list[tuple[bool, str]]:
    """The numeric checks: each setting's range, AdamW's betas, then the per-step sizes together."""
    checks = []
    for k, (ok, rule) in RANGES.items():
        if k in FIELDS:  # a setting may be added to the table before its field lands
            value = getattr(cfg, k)
            checks.append((ok(value) or (value is None and FIELDS[k].default is None), f"{LABELS.get(k, k)} must be {rule} (got {value!r})"))
    betas = cfg.adam_betas
    checks.append((isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_real(0, 1, hi_open=True)(b) for b in betas),
                   f"adam_betas must be two numbers in [0, 1), e.g. [0.9, 0.999] (got {betas!r})"))
    if all(ok for ok, _ in checks):  # sizes are checked one by one above, so the products below are of sane ints
        rows = cfg.batch_size * cfg.group_size
        tokens = rows * cfg.max_new_tokens
        checks += [
            (rows <= MAX_ROWS, f"batch_size * group_size = {rows} rows sampled per step is over {MAX_ROWS}; lower batch_size or group_size"),
            (tokens <= MAX_SAMPLED_TOKENS, f"batch_size * group_size * max_new_tokens = {tokens} tokens sampled per step is over "
                                           f"{MAX_SAMPLED_TOKENS}, more than one machine can hold; lower one of them"),
        ]
    return checks


def validate(cfg: Config) -> None:
    """Range checks shared by every method; a method checks its own fields in Method.validate."""
    rewards = [] if cfg.reward is None else [cfg.reward] if isinstance(cfg.reward, str) else cfg.reward
    n_rewards = len(rewards) if isinstance(rewards, (list, tuple)) and rewards else 1  # the task's or a reward model's is one
    weights = cfg.reward_weights if isinstance(cfg.reward_weights, list) else [None]
    checks = [
        *_ranges(cfg),
        (cfg.long_prompts in ("skip", "error"), "long_prompts must be skip or error"),
        (cfg.strategy in ("ddp", "fsdp2"), "strategy must be ddp or fsdp2"),
        (cfg.lr_schedule in ("constant", "linear", "cosine"), "lr_schedule must be constant, linear or cosine"),
        (cfg.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype must be auto, float32, bfloat16 or float16"),
        (cfg.master_dtype in ("float32", "bfloat16"), "master_dtype must be float32 or bfloat16"),
        (cfg.save_dtype in ("master", "float32", "bfloat16", "float16"), "save_dtype must be master, float32, bfloat16 or float16"),
        (isinstance(cfg.stop_strings, list) and all(isinstance(s, str) and s for s in cfg.stop_strings),
         "stop_strings must be a list of non-empty strings"),
        (isinstance(rewards, (list, tuple)) and (cfg.reward is None or bool(rewards)) and all(isinstance(x, str) and x.strip() for x in rewards),
         "reward must be a reward name (numeric, module:function, path/file.py:function) or a list of them"),
        (all(_real(-math.inf)(w) for w in weights), f"reward_weights={cfg.reward_weights} must be a list of finite numbers"),
        (len(weights) in (0, n_rewards), f"reward_weights has {len(weights)} values for {n_rewards} reward(s); give one weight per reward"),
        (cfg.chat_format in ("auto", "chat", "raw"), "chat_format must be auto, chat or raw"),
        (cfg.rollout_compile in ("auto", "on", "off"), "rollout_compile must be auto, on or off"),
        (isinstance(cfg.columns, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in cfg.columns.items()),
         "columns must map names to column names, e.g. {prompt: question}"),
        (isinstance(cfg.report_to, (str, list)) and all(r in ("tensorboard", "wandb", "none") for r in ([cfg.report_to] if isinstance(cfg.report_to, str) else cfg.report_to)),
         "report_to must be tensorboard, wandb, none or a list of them"),
    ]
    for ok, msg in checks:
        if not ok:
            raise GcfError(f"Invalid setting: {msg}.")
