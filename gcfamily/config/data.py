"""The data settings: where rows come from and how they become tokens (gcfamily/data/sources.py, gcfamily/data/formats.py, gcfamily/data/encoding.py).

A base of `Config`, kept apart so each file stays readable; `gcf settings` lists these with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gcfamily.config.rules import setting, whole


@dataclass(init=False)
class DataSettings:
    """Datasets, columns and chat formatting, shared by every method."""

    task_seed: Optional[int] = setting(None, whole(0, 2**63 - 1), "in [0, 2**63) or none")
    """Seed of the task's problems and train/test split; None takes the run's seed. `gcf bench --seeds N` fixes it at 0 so that every
    method and seed is evaluated on the same held-out prompts."""
    validation_rows: int = setting(0, whole(0), ">= 0 (0 = evaluate on the test split)")
    """Rows at the end of the task's train split kept out of training as a validation set; with it, the run's evaluations score
    them (eval/val_accuracy) instead of the test split, which the run then never reads (`gcf bench --sweep` chooses on them)."""
    dataset: Optional[str] = None
    """Training rows instead of the task's: a JSONL/JSON/parquet/CSV file, a save_to_disk folder, or a hub id (org/name).
    Any of TRL's formats the method takes (`gcf data` shows what a method makes of it)."""
    dataset_config: Optional[str] = None
    """The hub dataset's configuration (subset), e.g. main for openai/gsm8k."""
    dataset_split: str = "train"
    """Split of the dataset to train on (of a hub dataset, or of a DatasetDict folder)."""
    columns: dict = field(default_factory=dict)
    """Rename the dataset's columns to the ones gcfamily reads: {prompt: question} takes the prompt from `question`."""
    eval_dataset: Optional[str] = None
    """Held-out rows for evaluation on your own data (same kinds of source as dataset); the run's reward scores their greedy completions."""
    eval_split: str = "test"
    """Split of eval_dataset (a hub dataset or a DatasetDict folder)."""
    chat_format: str = "auto"
    """chat (the tokenizer's chat template), raw (strings as they are, then EOS: TRL's standard rows), or auto: chat for
    conversational rows, and for string rows when the tokenizer has a chat template (an instruct model); raw otherwise."""
    system_prompt: Optional[str] = None
    """A system message put first in every chat-formatted prompt that has none; None keeps the template's own default
    (SmolLM2's adds one), and "" replaces that default with an empty system message."""
    chat_template: Optional[str] = None
    """A Jinja chat template (or the path of a file holding one) for a tokenizer without one, or to replace its own."""
    assistant_only_loss: bool = True
    """For `messages` rows: train every assistant turn (true) or every token of the conversation (false, TRL's default)."""
