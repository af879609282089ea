"""Every causal-LM family of the installed transformers, built tiny from its config class and run through gcfamily:
log-probs against the model's own forward on each unpadded row, the gradient finite, and sampling (greedy, checked
against the model's own `generate` on each unpadded prompt, and each recorded log-prob against its forward).

    .venv/bin/python benchmarks/families_table.py                       # the table, then the counts
    .venv/bin/python benchmarks/families_table.py --write docs/families.md

The tiny models are tests/test_family_sampling.py's (`tiny`: SIZES where the config has the field, OVERRIDES per
family), the rows tests/test_families.py's (left-padded prompts, right-padded completions of several lengths). A
family whose config names its sizes otherwise (it would be built at its full size) or that transformers cannot build
here is listed apart, with the reason.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import transformers as tf
from test_families import PAD, V, distinct_batch, tokenizer
from test_family_sampling import OVERRIDES, SIZES, oracle_logps, tiny
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from gcfamily.core import engine, families
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.rollout import SamplingSettings, generate, recompute

TOL = 1e-4  # float32: the engine's chunked log-softmax against the model's own logits
MAX_PARAMS = 40_000_000  # past this a config whose sizes go by other names is near its full size: listed apart, not run
EXTRA = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    ffn_dim=64,
    n_heads=4,
    n_layers=2,
    d_ff=64,
    n_inner=64,
)
"""Size fields of other names (encoder-decoder families and older decoders), tried here only."""


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # type: ignore[no-untyped-def]
    raise _Timeout


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}".replace("|", "/")


def _size(model_type: str) -> int:
    """Parameters of the family at the tiny settings, counted on the meta device (0 where that cannot be counted)."""
    try:
        cfg_cls = CONFIG_MAPPING[model_type]
        d = cfg_cls()
        config = cfg_cls(**{**{k: v for k, v in SIZES.items() if hasattr(d, k)}, **OVERRIDES.get(model_type, {})})
        with torch.device("meta"):
            model = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - the real build below says what is wrong
        return 0


def run(model_type: str) -> dict:
    """One family's row: what was built, the training figures, the sampling figures, or why not."""
    row: dict = {"family": model_type}
    n = _size(model_type)
    if n > MAX_PARAMS:
        return {**row, "apart": f"its config names its sizes otherwise ({n / 1e6:.0f}M parameters at these settings)"}
    try:
        model = tiny(model_type)
    except GcfError as e:
        return {**row, "refused": str(e)}
    except Exception as e:  # noqa: BLE001 - transformers could not build it: listed apart with the reason
        return {**row, "apart": "transformers cannot build it here: " + _one_line(e)}
    row["attention"] = model.config._attn_implementation
    row["sampling path"] = "full forward per token" if families.no_kv_cache(model.config) else "KV cache"
    batch = distinct_batch(torch.Generator().manual_seed(1))
    batch = batch.replaced(input_ids=batch.input_ids % V)
    try:  # training: log-probs and the gradient of a weighted sum of them, against the model's own forward
        w = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2)) * batch.loss_mask
        lp = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 16, True)
        (lp.logps * w).sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        want = oracle_logps(model, batch)
        (want * w).sum().backward()
        oracle = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        row["log-probs"] = float((lp.logps.detach() - want.detach()).abs().max())
        row["gradient finite"] = all(bool(torch.isfinite(g).all()) for g in got.values())
        row["gradient"] = max((float((got[n] - oracle[n]).abs().max()) for n in got if n in oracle), default=0.0)
    except GcfError as e:
        return {**row, "refused": str(e)}
    except Exception as e:  # noqa: BLE001 - a failure the table names
        return {**row, "training error": _one_line(e)}
    try:  # sampling: greedy against the model's own generate on each unpadded prompt
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, V, (k,), generator=g).tolist() for k in (5, 9)]
        ro = generate(model, tokenizer(), prompts, 2, SamplingSettings(greedy=True, max_new_tokens=6), eos_token_ids=[])
        P = ro.input_ids.shape[1] - 6
        rows = Batch(input_ids=ro.input_ids, attention_mask=ro.attention_mask, loss_mask=ro.completion_mask)
        with torch.no_grad():
            row["sample log-probs"] = float((ro.sample_logps - oracle_logps(model, rows)).abs().max())
        # the independent greedy: argmax of a full forward over each unpadded row, token by token
        full = recompute.decode(
            model,
            prompts,
            2,
            SamplingSettings(greedy=True, max_new_tokens=6),
            None,
            torch.tensor([], dtype=torch.long),
            PAD,
        )[0]
        row["greedy = full forward"] = "yes" if torch.equal(ro.input_ids[:, P:], full) else "NO"
        try:
            same = True
            for i, p in enumerate(prompts):
                own = model.generate(
                    torch.tensor([p]), do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=PAD
                )
                same &= ro.input_ids[2 * i, P:].tolist() == own[0, len(p) :].tolist()
            row["greedy = own generate"] = "yes" if same else "NO"
        except Exception as e:  # noqa: BLE001 - the model's own generate failed: our sampling still checked above
            row["greedy = own generate"] = "its own generate fails: " + _one_line(e)
    except GcfError as e:
        row["sampling refused"] = str(e)
    except Exception as e:  # noqa: BLE001 - a failure the table names
        row["sampling error"] = _one_line(e)
    return row


def _cell(x: object) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


def table(rows: list[dict]) -> str:
    ran = [r for r in rows if "apart" not in r and "refused" not in r]
    lines = [
        (
            "| family | attention | log-probs max diff | gradient finite | gradient max diff | sampling path | "
            "sample log-probs max diff | greedy = full forward | greedy = own generate |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ran:
        if "training error" in r:
            lines.append(f"| {r['family']} | {r['attention']} | training error: {r['training error']} | | | | | | |")
            continue
        samp = r.get("sampling error") or r.get("sampling refused")
        tail = (
            f"{r['sampling path']} | sampling failed: {samp} | | |"
            if samp
            else f"{r['sampling path']} | {_cell(r['sample log-probs'])} | {r['greedy = full forward']} | "
            f"{r['greedy = own generate']} |"
        )
        lines.append(
            f"| {r['family']} | {r['attention']} | {_cell(r['log-probs'])} | {'yes' if r['gradient finite'] else 'NO'} | "
            f"{_cell(r['gradient'])} | {tail}"
        )
    refused = [r for r in rows if "refused" in r]
    if refused:
        lines += ["", "| refused family | the sentence |", "|---|---|"]
        lines += [f"| {r['family']} | {r['refused']} |" for r in refused]
    apart = [r for r in rows if "apart" in r]
    if apart:
        lines += ["", "| not built here | why |", "|---|---|"]
        lines += [f"| {r['family']} | {r['apart']} |" for r in apart]
    return "\n".join(lines)


def counts(rows: list[dict]) -> str:
    ran = [r for r in rows if "apart" not in r and "refused" not in r]
    c = Counter()
    for r in ran:
        c["trained"] += "log-probs" in r
        c["log-probs exact"] += r.get("log-probs", 1.0) <= TOL
        c["gradient finite"] += bool(r.get("gradient finite"))
        c["sample"] += "sample log-probs" in r
        c["sample log-probs exact"] += r.get("sample log-probs", 1.0) <= TOL
        c["greedy = own generate"] += r.get("greedy = own generate") == "yes"
        c["greedy = full forward"] += r.get("greedy = full forward") == "yes"
        c["full forward per token"] += r.get("sampling path") == "full forward per token"
    return (
        f"{len(rows)} causal-LM families in transformers; {len(ran)} built and run, "
        f"{sum('refused' in r for r in rows)} refused in one sentence, {sum('apart' in r for r in rows)} not built here. "
        f"Of the {len(ran)}: log-probs exact (<= {TOL:g}) {c['log-probs exact']}, gradient finite {c['gradient finite']}, "
        f"sampling works {c['sample']} (its log-probs exact {c['sample log-probs exact']}, greedy equal to the argmax of a "
        f"full forward {c['greedy = full forward']}, to the model's own generate {c['greedy = own generate']}), {c['full forward per token']} sampled by the full forward per token."
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", type=Path, help="also write the table and the counts into this markdown file")
    ap.add_argument("--only", nargs="*", help="these model types only")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per family")
    args = ap.parse_args()
    torch.set_num_threads(2)
    SIZES.update({k: v for k, v in EXTRA.items() if k not in SIZES})
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    for t in args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        t0 = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            rows.append(run(t))
        except _Timeout:
            rows.append({"family": t, "apart": f"ran past {args.timeout} s"})
        finally:
            signal.alarm(0)
        print(f"# {t}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    text, summary = table(rows), counts(rows)
    print(text + "\n\n" + summary)
    if args.write:
        import transformers

        head = (
            "# Model families: trained and sampled exactly, or refused\n\n"
            f"Produced by `python benchmarks/families_table.py --write {args.write}` (CPU float32, torch {torch.__version__}, "
            f"transformers {transformers.__version__}). Every causal-LM family of the installed transformers, built tiny "
            "from its config class: the engine's log-probs and gradient against the model's own forward on each "
            "unpadded row (left-padded prompts, right-padded completions), and sampling through `rollout.generate` "
            "(greedy: its tokens against the model's own `generate` on each unpadded prompt; each recorded log-prob "
            "against the model's forward). State-space, recurrent and linear-attention families sample through a full "
            "forward per token (`gcfamily/rollout/recompute.py`); Gemma 3n runs eager attention (its SDPA backward gives "
            "NaN gradients on left-padded rows). tests/test_family_sampling.py checks a representative subset. The last column compares with "
            "the model's own `generate` at min_new_tokens=6, which suppresses the EOS id: where a row's argmax is that "
            "id the two differ by construction; the column before it (the argmax of a full forward per token) is the "
            "independent check.\n\n"
        )
        args.write.write_text(head + summary + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
