"""LoRA adapters (peft, an optional extra): train low-rank updates, keep the base frozen and shared.

With `lora_r > 0` the policy is the base model with adapters on its attention and MLP projections
(peft's "all-linear": every linear layer but the output layer). Three things follow that save the
memory LoRA is for:

- the reference policy (GRPO, PPO) is the same model with its adapters switched off
  (`AdapterOffReference`), so no second copy of the weights exists; at step 0 the adapters' B
  matrices are zero and the two are the same function, as a copied reference would be;
- PPO's critic is a second set of adapters over the same frozen base weights (`shared_base_copy`);
- checkpoints hold the adapters and their optimizer state only; the base is reloaded from --model.

Dropout on the adapters is 0 by default: with dropout the log-probs of a training forward are not
those of the policy that sampled (pi_old, pi_ref), and the ratio of a fresh step is not 1.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from gcfamily.config.rules import require
from gcfamily.errors import GcfError


def enabled(cfg: Any) -> bool:
    """LoRA is on when lora_r > 0."""
    return cfg.lora_r > 0


def validate(cfg: Any, method_cls: Any) -> None:
    """Combinations LoRA cannot run exactly here; one sentence each."""
    if not enabled(cfg):
        return
    if importlib.util.find_spec("peft") is None:
        raise GcfError("lora_r > 0 needs the package peft: run `pip install peft` (or install gcfamily[lora]).")
    checks = [
        (cfg.lora_alpha > 0, "lora_alpha must be > 0"),
        (0 <= cfg.lora_dropout < 1, "lora_dropout must be in [0, 1)"),
        (
            method_cls.trains_policy,
            f"{method_cls.name} trains a model of its own, not the policy; LoRA applies to policy training only",
        ),
        (
            cfg.strategy != "fsdp2",
            "LoRA under FSDP2 is not supported yet; use --strategy ddp (the frozen base is replicated, the adapters are small)",
        ),
        (
            not getattr(cfg.settings, "ref_refresh_every", 0),
            "with LoRA the reference is the base model with the adapters off, which cannot be refreshed; leave ref_refresh_every at 0",
        ),
    ]
    require(checks)


def wrap(model: nn.Module, cfg: Any) -> nn.Module:
    """The model with fresh LoRA adapters (B = 0: the same function as the base); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    targets = list(cfg.lora_target_modules) if cfg.lora_target_modules else "all-linear"
    config = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, config)
    except (ValueError, TypeError) as e:
        raise GcfError(
            f"LoRA could not be applied to {type(model).__name__} ({str(e).splitlines()[0][:200]}); check lora_target_modules."
        ) from e
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise GcfError(f"lora_target_modules={cfg.lora_target_modules} matched no layer of {type(model).__name__}.")
    return peft_model


def is_peft(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def adapter_keys(model: nn.Module) -> set[str]:
    """State-dict names of the trained adapter weights (what a checkpoint holds)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


class _AdaptersOff(nn.Module):
    """The decoder of a peft model run with its adapters disabled (built per call, owns nothing new)."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)  # not a submodule: nothing is registered twice
        self.decoder = peft_model.get_decoder()
        self.config = self.decoder.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.decoder(*args, **kwargs)


class AdapterOffReference:
    """pi_ref as a view of the policy: the same weights with the adapters switched off; no copy.

    Not an nn.Module, so a method's `owned_models` never lists it (DDP must not average the
    policy's adapters a second time); the engine reads it through get_decoder/get_output_embeddings.
    """

    def __init__(self, peft_model: nn.Module) -> None:
        self.peft_model = peft_model

    def get_decoder(self) -> nn.Module:
        return _AdaptersOff(self.peft_model)

    def get_output_embeddings(self) -> nn.Module:
        return self.peft_model.get_output_embeddings()

    @property
    def config(self) -> Any:
        return self.peft_model.config

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.peft_model.parameters()

    @property
    def device(self) -> torch.device:
        return next(self.peft_model.parameters()).device

    def eval(self) -> "AdapterOffReference":
        return self

    def train(self, mode: bool = True) -> "AdapterOffReference":
        return self

    @property
    def training(self) -> bool:
        return False

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """The causal LM with adapters off, for code that calls the whole model (generation)."""
        with self.peft_model.disable_adapter():
            yield self.peft_model


def shared_base_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` that shares its frozen weights and owns copies of its trainable ones.

    Applied to a LoRA policy's decoder it gives a second set of adapters over the same base
    (PPO's critic): the base is held once, the copies of the adapters train on their own.
    """
    frozen = {id(p): p for p in module.parameters() if not p.requires_grad}
    return copy.deepcopy(module, memo=dict(frozen))


def save_final(peft_model: nn.Module, tokenizer: Any, out_dir: Path, merge: bool, save_dtype: str) -> None:
    """The adapter (adapter_config.json, adapter_model.safetensors) and the tokenizer in out_dir; with
    `merge`, the merged model there instead (loadable by from_pretrained) and the adapter in out_dir/adapter."""
    from gcfamily.core import precision

    if merge:
        merged = copy.deepcopy(peft_model).merge_and_unload()  # the run's own model keeps its adapters
        precision.save_pretrained(merged, out_dir, merged.state_dict(), save_dtype)
        peft_model.save_pretrained(Path(out_dir) / "adapter", safe_serialization=True)
    else:
        peft_model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
