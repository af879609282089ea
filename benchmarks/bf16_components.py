"""Where bf16 loses the log-probs: the error of bf16 compute against float32 per token, and which component carries it.

    .venv/bin/python benchmarks/bf16_components.py                        # SmolLM2-135M-Instruct (offline) and families
    .venv/bin/python benchmarks/bf16_components.py --families llama,qwen2 --rows 48

Text: the arithmetic task's first 48 held-out rows, each a chat-templated prompt and its reference answer plus EOS; the
log-probs are those of the answer's tokens only (what SFT trains on and what a ratio or KL of a completion reads).
Reference: the same model in float32. Each bf16 variant runs the trainer's mixed path, the float32 weights under
torch.autocast(bfloat16) (`dtype=bfloat16`, master float32), or pure bf16 weights (`master_dtype=bfloat16`), and
with one component at a time kept in float32 (its forward outside autocast, its inputs cast up), to see which
component carries the error:

    embeddings   the input embedding       norms   every *Norm module
    attention    each self-attention block (projections, rotary, softmax)
    mlp          each MLP block            head    the output layer and the log-softmax after it

Printed per variant: mean and max |logp_bf16 - logp_fp32| over the answer tokens, and the held-out NLL per token.
The families are the tiny random builds of tests/test_family_sampling.py (random weights, gcfamily's character-level
tokenizer on the same text): their errors say how each architecture's bf16 behaves, not what a
trained model of that family loses.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

COMPONENTS = ("embeddings", "norms", "attention", "mlp", "head")
FAMILIES = "llama,qwen2,mistral,gemma,gemma2,phi3,gpt2,olmo2,granite,qwen3"


def members(model: torch.nn.Module, component: str) -> list[str]:
    """The names of the modules that make up `component` (by the transformers naming every family here follows; the
    output layer, "head", is handled apart)."""
    out = []
    for name, mod in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        kind = type(mod).__name__.lower()
        if component == "embeddings" and last in ("embed_tokens", "wte", "word_embeddings", "embed_in"):
            out.append(name)
        elif component == "norms" and "norm" in kind:
            out.append(name)
        elif component == "attention" and last in ("self_attn", "attn", "attention", "self_attention"):
            out.append(name)
        elif component == "mlp" and last in ("mlp", "feed_forward"):
            out.append(name)
    return out


@contextlib.contextmanager
def kept_in_float32(mods: list[torch.nn.Module], back: bool):
    """These modules compute in float32: their forward runs outside autocast with floating inputs cast up (their
    weights are float32); `back` casts their outputs to bf16 (pure bf16: the next module's weights are bf16)."""
    saved = []

    def cast(x, dtype):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        if isinstance(x, tuple):
            return tuple(cast(v, dtype) for v in x)
        return x

    def wrap(mod: torch.nn.Module):
        fwd = mod.forward

        def forward(*args, **kwargs):
            with torch.autocast("cpu", enabled=False):
                out = fwd(
                    *[cast(a, torch.float32) for a in args], **{k: cast(v, torch.float32) for k, v in kwargs.items()}
                )
            if back:
                out = cast(out, torch.bfloat16)
            return out

        mod.forward = forward
        saved.append((mod, fwd))

    for m in mods:
        wrap(m)
    try:
        yield
    finally:
        for m, fwd in saved:
            m.forward = fwd


@contextlib.contextmanager
def alone_in_bf16(mods: list[torch.nn.Module]):
    """These modules, alone, compute under bf16 autocast (the rest of the model in float32); outputs cast back up."""
    saved = []

    def wrap(mod: torch.nn.Module):
        fwd = mod.forward

        def forward(*args, **kwargs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fwd(*args, **kwargs)
            up = lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            return tuple(up(v) for v in out) if isinstance(out, tuple) else up(out)

        mod.forward = forward
        saved.append((mod, fwd))

    for m in mods:
        wrap(m)
    try:
        yield
    finally:
        for m, fwd in saved:
            m.forward = fwd


def answer_logps(model, rows: list[tuple[list[int], list[int]]], mode: str, keep: str | None) -> torch.Tensor:
    """Log-probs (float64, 1-D) of every answer token of every row: float32 ("fp32"), the float32 weights under bf16
    autocast ("autocast"), or pure bf16 weights ("pure"); `keep`, a component kept in float32. The log-softmax always
    reads float32 logits (as the engine's does); "head" in float32 is the output layer's matmul on float32 operands."""
    names = members(model, keep) if keep and keep != "head" else []
    m = model
    if mode == "pure":
        m = copy.deepcopy(model).to(torch.bfloat16)
        for n in names:  # the kept component's own float32 weights, not bf16 ones cast back up
            m.get_submodule(n).load_state_dict({k: v.float() for k, v in model.get_submodule(n).state_dict().items()})
            m.get_submodule(n).float()
    head_w = model.get_output_embeddings().weight.detach()  # float32
    out = []
    scope = (
        alone_in_bf16([m.get_submodule(n) for n in names])
        if mode == "only"
        else kept_in_float32([m.get_submodule(n) for n in names], back=mode == "pure")
    )
    with scope:
        for prompt, answer in rows:
            ids = torch.tensor([prompt + answer])
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
            with torch.no_grad(), ctx:
                hidden = m.get_decoder()(ids).last_hidden_state
                if mode == "only":  # float32 everywhere but `keep`, which alone runs in bf16
                    logits = (
                        torch.nn.functional.linear(hidden, head_w.to(torch.bfloat16) if keep == "head" else head_w)
                        if keep != "head"
                        else torch.nn.functional.linear(hidden.to(torch.bfloat16), head_w.to(torch.bfloat16))
                    )
                elif keep == "head" or mode == "fp32":
                    with torch.autocast("cpu", enabled=False):
                        logits = torch.nn.functional.linear(hidden.float(), head_w)
                elif mode == "pure":  # the output layer in bf16 whatever else is kept (a tied embedding kept apart)
                    logits = torch.nn.functional.linear(hidden.to(torch.bfloat16), head_w.to(torch.bfloat16))
                else:
                    logits = m.get_output_embeddings()(hidden)
            lp = logits.float().log_softmax(-1).double()
            P = len(prompt)
            out.append(lp[0, P - 1 : -1].gather(-1, ids[0, P:, None])[:, 0])
    return torch.cat(out)


def table(model, rows, label: str) -> list[str]:
    ref = answer_logps(model, rows, "fp32", None)
    lines = [f"{label}: float32 NLL per answer token {-ref.mean():.4f} over {len(ref)} tokens"]
    print(lines[-1], flush=True)
    for mode in ("autocast", "pure", "only"):
        for keep in (None, *COMPONENTS) if mode != "only" else COMPONENTS:
            lp = answer_logps(model, rows, mode, keep)
            d = (lp - ref).abs()
            what = (
                f"float32, {keep} alone in bf16"
                if mode == "only"
                else f"{'bf16 autocast' if mode == 'autocast' else 'pure bf16'}, "
                + ("all bf16" if keep is None else f"{keep} in float32")
            )
            lines.append(
                f"  {what:38s} |dlogp| mean {d.mean():.2e} max {d.max():.2e}   NLL {-lp.mean():.4f} ({-lp.mean() + ref.mean():+.4f})"
            )
            print(lines[-1], flush=True)
    return lines


def smollm2_rows(tok, n: int) -> list[tuple[list[int], list[int]]]:
    from gcfamily.tasks import get_task

    rows = get_task("arithmetic").rows("test", n)
    out = []
    for r in rows:
        prompt = list(
            tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)["input_ids"]
        )
        answer = tok(str(r["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((prompt, answer))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--families", default=FAMILIES, help="comma-separated model types, or none")
    ap.add_argument("--no-smollm2", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    if not a.no_smollm2:
        from gcfamily.models import load_model

        model, tok = load_model("smollm2-135m")
        rows = smollm2_rows(tok, a.rows)
        table(model.eval(), rows, f"SmolLM2-135M-Instruct (offline), {a.rows} held-out arithmetic answers")
    if a.families != "none":
        from test_family_sampling import tiny

        from gcfamily.models import load_model as _  # noqa: F401 - the package's families setup
        from gcfamily.models import tiny_tokenizer

        ctok = tiny_tokenizer()  # character-level, 103 ids: inside every tiny family's vocabulary
        from gcfamily.tasks import get_task

        texts = get_task("arithmetic").rows("test", a.rows)
        rows = [
            (ctok(f"Q: {r['prompt']}\nA: ")["input_ids"], ctok(str(r["answer"]), add_special_tokens=False)["input_ids"])
            for r in texts
        ]
        for fam in a.families.split(","):
            try:
                model = tiny(fam).eval()
            except Exception as e:  # noqa: BLE001 - a family that cannot be built here is listed with the reason
                print(f"{fam}: not built ({str(e).splitlines()[0][:120]})")
                continue
            table(model, rows, f"{fam} (tiny random)")


if __name__ == "__main__":
    main()
