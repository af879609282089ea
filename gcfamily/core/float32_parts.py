"""Components of a model kept in float32 under bf16 autocast (`float32_components`).

Under `torch.autocast(bfloat16)` every matmul rounds its operands to bf16 (8-bit mantissa); the residual stream, norms
and embeddings stay float32 (autocast does not touch them: measured, docs/precision.md). A kept component computes
as in a float32 run: its forward runs with autocast off and its floating inputs cast up to float32, so its weights (the
float32 masters) meet float32 activations. Its output stays float32; the next bf16 component casts it down again.

    attention   every self-attention block: q/k/v/o projections, rotary, softmax (and its KV cache, in float32)
    mlp         every MLP / feed-forward block
    head        the output layer and the log-softmax (the engine's chunked head, and the sampler's logits)

The hooks are module hooks, so a deep copy of the model (the frozen reference) keeps them; the forward hook runs
also when the forward raises (always_call), so autocast is never left off.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import torch
from torch import nn

from gcfamily.errors import GcfError

COMPONENTS = ("attention", "mlp", "head")

_NAMES = {
    "attention": ("self_attn", "attn", "attention", "self_attention"),
    "mlp": ("mlp", "feed_forward"),
}
_OFF = threading.local()  # the autocast contexts the kept forwards now running have left, innermost last


def parse(value: Any) -> tuple[str, ...]:
    """float32_components as a tuple of component names (a list, or a comma-separated string; none or empty: ()); one
    sentence for a name that is not one."""
    items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
    names = tuple(dict.fromkeys(n for n in (str(s).strip() for s in items) if n and n != "none"))
    bad = [n for n in names if n not in COMPONENTS]
    if bad:
        raise GcfError(
            f"float32_components={bad[0]!r} is not one of {', '.join(COMPONENTS)} (comma-separated), or none."
        )
    return names


def modules_of(model: nn.Module, component: str) -> list[nn.Module]:
    """The modules that make up `component` (by the transformers naming every family here follows): the outermost
    module named as an attention or MLP block in each layer, or the output layer."""
    if component == "head":
        return [model.get_output_embeddings()]
    names = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in _NAMES[component]]
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return [model.get_submodule(n) for n in outer]


def _up(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32:
        return x.float()
    if isinstance(x, tuple):
        return tuple(_up(v) for v in x)
    return x


def _enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    dev = module.weight.device.type if isinstance(getattr(module, "weight", None), torch.Tensor) else None
    dev = dev or next(module.parameters()).device.type
    stack = _OFF.__dict__.setdefault("stack", [])
    if not torch.is_autocast_enabled(dev):
        stack.append(None)
        return None
    ctx = torch.autocast(dev, enabled=False)
    ctx.__enter__()
    stack.append(ctx)
    return _up(args), {k: _up(v) for k, v in kwargs.items()}


def _leave(module: nn.Module, args: tuple, output: Any) -> None:
    ctx = _OFF.stack.pop()
    if ctx is not None:
        ctx.__exit__(None, None, None)


def keep_float32(model: nn.Module, components: Iterable[str]) -> int:
    """Keep `components` of `model` in float32 under autocast; returns how many modules were hooked. The head is also
    marked (`gcf_float32`) so the engine's chunked head computes on float32 operands."""
    n = 0
    for c in components:
        mods = modules_of(model, c)
        if not mods or any(m is None for m in mods):
            raise GcfError(
                f"float32_components={c}: {type(model).__name__} has no module named as one "
                f"({', '.join(_NAMES.get(c, ('get_output_embeddings()',)))}); leave {c} out."
            )
        for m in mods:
            if kept(m):
                continue
            if any(p.dtype != torch.float32 for p in m.parameters()):
                raise GcfError(f"float32_components={c} needs float32 weights (master_dtype=float32).")
            m.register_forward_pre_hook(_enter, with_kwargs=True)
            m.register_forward_hook(_leave, always_call=True)
            m.gcf_float32 = True
            n += 1
    return n


def kept(module: nn.Module | None) -> bool:
    """Is `module` kept in float32 (keep_float32)?"""
    return bool(getattr(module, "gcf_float32", False))
