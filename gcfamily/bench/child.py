"""One `gcf bench` run, in its own process: a normal Trainer run plus what the trainer does not record.

    python -m gcfamily.bench.child OUT/METHOD/bench_spec.json      # what gcfamily/bench/suite.py launches

- the GC distribution (GCRecorder, the run's `on_coefficients` hook): the GC of every loss token of the effective mask
  kept (a random subsample past 200,000);
- KL to the reference, the same way for every method (kl_to_reference);
- pass@k and maj@k (majority vote, where the task reads answers) from the same k sampled completions per held-out
  prompt, beside the greedy accuracy;
- the evaluation before the first step taken from an earlier run with the same start (start_evaluation_of, given to
  the run as its `start_evaluation` hook).

The run is configured with these hooks (gcfamily/run/hooks.py); nothing of the trainer or the method is patched.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.run.launch import die_with_parent

if TYPE_CHECKING:
    from gcfamily.run.hooks import StartEvaluation

GC_KEEP = 200_000


class GCRecorder:
    """Keeps the GC of every loss token, per step: the run's `on_coefficients` hook."""

    def __init__(self) -> None:
        import torch

        self.values, self.per_step, self.n = [], {}, 0
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, step: int, parts: list) -> None:
        for coef, mask in parts:  # per micro-batch: GC [b, L] and the effective mask [b, L]
            self.per_step.setdefault(step, []).append(coef[mask.bool()].float().cpu())

    def summary(self) -> dict[str, Any]:
        """Per-step quantiles, overall quantiles and a 40-bin histogram of the recorded GC values."""
        import torch

        qs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
        steps = {}
        for step, parts in sorted(self.per_step.items()):
            v = torch.cat(parts)
            if v.numel():
                steps[step] = dict(zip(["p5", "p25", "p50", "p75", "p95"], _quantiles(v, qs)))
        allv = torch.cat([torch.cat(p) for p in self.per_step.values()]) if self.per_step else torch.zeros(0)
        if allv.numel() > GC_KEEP:
            allv = allv[torch.randperm(allv.numel(), generator=self.gen)[:GC_KEEP]]
        if not allv.numel():
            return {"per_step": steps, "tokens": 0}
        lo, hi = float(allv.min()), float(allv.max())
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5, hi + 0.5
        counts = torch.histc(allv.double(), bins=40, min=lo, max=hi)
        return {
            "per_step": steps,
            "tokens": int(allv.numel()),
            "quantiles": dict(zip(["p5", "p25", "p50", "p75", "p95"], _quantiles(allv, qs))),
            "mean": float(allv.mean()),
            "std": float(allv.std()) if allv.numel() > 1 else 0.0,
            "zero_frac": float((allv == 0).float().mean()),
            "hist": {"counts": [int(c) for c in counts.tolist()], "lo": lo, "hi": hi},
        }


def _quantiles(v: Any, qs: Any) -> list[float]:
    import torch

    v = v.double()
    if v.numel() > 1_000_000:  # torch.quantile's limit
        v = v[:: v.numel() // 1_000_000 + 1]
    return [float(x) for x in torch.quantile(v, qs.double())]


def heldout_prompts(trainer: Any, n: int) -> tuple[list[dict[str, Any]], Any]:
    """(up to n held-out rows, the reward scoring them): the task's held-out prompts and its reward, or the first n rows of the
    run's eval_dataset and its rewards (--reward); ([], None) when the run has neither or trains no policy. A run that keeps
    validation rows (a --sweep run) measures on those instead: it never reads the test split."""
    if not trainer.method.trains_policy:
        return [], None
    if trainer.task is not None:
        rows = trainer.evaluation.validation_rows()[:n] if trainer.cfg.validation_rows else trainer.task.heldout_rows(n)
        return rows, trainer.task.reward
    if trainer.eval_dataset is not None:
        return trainer.evaluation.eval_rows()[:n], trainer.evaluation.eval_reward(trainer.method)
    return [], None


def kl_to_reference(trainer: Any, n_prompts: int) -> Optional[float]:
    """Mean k3(pi_ref / pi) over the tokens of one temperature-1 sample per held-out prompt of the final policy.

    In float32, log pi is the log-prob each token was sampled with (the rollout's, at temperature 1 over the full
    distribution), so only pi_ref scores the samples: one forward pass over them instead of two. In a narrower compute
    dtype the sampler's and the scoring pass's roundings differ (they would not cancel as pi nears pi_ref, and k3 would
    gain a positive bias), so both models score the samples through the same pass."""
    import torch

    from gcfamily.models import load_model
    from gcfamily.rollout import SamplingSettings, build_backend

    cfg = trainer.cfg
    rows, _ = heldout_prompts(trainer, n_prompts)
    if not rows:
        return None
    policy = trainer.unwrapped_policy().eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ro = build_backend("native", policy, trainer.tokenizer).generate(
        [trainer.formatter.prompt_ids(r["prompt"]) for r in rows],
        1,
        SamplingSettings(temperature=1.0, max_new_tokens=cfg.max_new_tokens),
        gen,
    )
    batch = Batch(
        input_ids=ro.input_ids.cpu(), attention_mask=ro.attention_mask.cpu(), loss_mask=ro.completion_mask.cpu()
    )
    # the untouched initial model
    ref, _ = load_model(cfg.model, trainer.dtype, trainer.device, cfg.trust_remote_code, cfg.seed)
    float32 = getattr(getattr(trainer, "precision", None), "compute", torch.float32) == torch.float32
    lp = ro.sample_logps.float().cpu() if float32 else trainer.services.logprobs(policy, batch)  # [N, L]
    lr = trainer.services.logprobs(ref.eval(), batch)  # [N, L]
    mask = batch.loss_mask.bool()
    d = (lr - lp).double()[mask]
    return float((torch.expm1(d) - d).mean()) if d.numel() else None


def start_evaluation_of(source: Path, last: bool = False) -> Optional[StartEvaluation]:
    """The evaluation before the first step, from `source`, a run of the same suite that starts from the same policy and
    evaluates the same prompts the same way (the parent's `start_key`), instead of computing it again: greedy decoding
    of the same model on the same prompts gives the same answers. With `last`, source is the run that trained this run's
    starting model (the unified suite's stage 1) and its final evaluation is the one taken, as step 0. None (and the run
    evaluates itself) when source has none."""
    from gcfamily.run.hooks import StartEvaluation
    from gcfamily.run.logger import read_metrics

    try:
        rows = [r for r in read_metrics(source) if any(k.startswith("eval/") for k in r)]
        step = rows[-1]["step"] if last else 0
        figures = next({k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if r.get("step") == step)
        lines = [ln for ln in (source / "eval_details.jsonl").read_text().splitlines() if ln.strip()]
        details = next(ln for ln in reversed(lines) if json.loads(ln)["step"] == step)
        if step != 0:
            details = json.dumps({**json.loads(details), "step": 0})
    except (OSError, ValueError, KeyError, IndexError, StopIteration):
        return None
    return StartEvaluation(figures, details)


def _measure(trainer: Any, cfg: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The finished run's KL to the reference (on kl_prompts held-out prompts, 64 unless the spec says), pass@k and maj@k
    (k = sample_k, else group_size, samples on each of sample_prompts held-out prompts, 64 unless the spec says), with
    their times.

    maj@k is recorded as None where the run has no answer function (its own data scored by reward functions, or a task
    without `answer`)."""
    t1 = time.perf_counter()
    out: dict[str, Any] = {"kl_ref": kl_to_reference(trainer, min(cfg.eval_samples, int(spec.get("kl_prompts", 64))))}
    out["kl_s"] = time.perf_counter() - t1
    rows, reward = heldout_prompts(trainer, min(cfg.eval_samples, int(spec.get("sample_prompts", 64))))
    if rows:  # pass@k and maj@k beside greedy accuracy: k samples per held-out prompt
        from gcfamily.run.heldout import sampled_eval, task_answer

        t2 = time.perf_counter()
        k = int(spec.get("sample_k") or max(cfg.group_size, 1))
        sampled = sampled_eval(
            trainer.unwrapped_policy(),
            trainer.formatter,
            rows,
            reward,
            k,
            cfg.temperature,
            cfg.max_new_tokens,
            cfg.seed + 2,
            answer=task_answer(trainer.task),
        )
        out["pass_at_k"], out["maj_at_k"] = sampled.pass_at_k, sampled.maj_at_k
        # paired comparisons (gcf bench --suite unified)
        out["sampled_k"], out["sampled_per_prompt"] = (
            k,
            sampled.per_prompt,
        )
        out["pass_s"] = time.perf_counter() - t2
    return out


def child(spec_path: str) -> None:
    """Run one method as a normal Trainer run; write the GC record and the KL next to its metrics."""
    import torch

    from gcfamily.core import onednn, threads
    from gcfamily.methods import resolve
    from gcfamily.run.hooks import RunHooks
    from gcfamily.run.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = resolve(None, spec["settings"])  # as `gcf run --set`: these count as given, over any method default
    busy = threads.busy_cores()  # how busy the machine was as this run started, kept beside its timings
    if "threads" not in spec["settings"]:  # the bench's own count (the OMP_NUM_THREADS it set, or torch's default)
        cfg.threads = torch.get_num_threads()
    recorder = GCRecorder()
    source = spec.get("start_eval_from")
    reused = start_evaluation_of(Path(source), bool(spec.get("start_eval_last"))) if source else None
    trainer = Trainer(cfg, hooks=RunHooks(on_coefficients=recorder, start_evaluation=reused))
    t0 = time.perf_counter()
    trainer.run()
    run_s = time.perf_counter() - t0
    with onednn.packing(cfg.rollout_pack_weights):  # the run's setting for the rollouts below too
        extra = _measure(trainer, cfg, spec)
    extra.update(
        {
            "gc": recorder.summary(),
            "run_s": run_s,
            "steps": trainer.step,
            "start_eval_from": source if reused is not None else None,
            "params": sum(p.numel() for p in trainer.unwrapped_policy().parameters()),
            "threads": trainer.threads.count,
            "busy_cores_at_start": None if busy is None else round(busy, 3),
        }
    )
    (Path(cfg.output_dir) / "bench_child.json").write_text(json.dumps(extra))
    # the finished run keeps its final model; its resumable checkpoints (weights and optimizer state) go
    shutil.rmtree(Path(cfg.output_dir) / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    if (
        len(sys.argv) > 2
    ):  # the bench's pid: never outlive it (a SIGKILLed bench left its child training, holding the lock)
        die_with_parent(int(sys.argv[2]))
    try:
        child(sys.argv[1])
    except GcfError as err:  # the parent reports the exit code and points at this log
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))
