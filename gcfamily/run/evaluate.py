"""Held-out evaluation: greedy completions of held-out prompts, scored by a reward.

On a built-in task the reward is the task's and the figure is accuracy (the share of prompts whose
completion scores >= 1). On your own data (`gcf eval --dataset D --reward R`, or `eval_dataset`
during training) the figures are the mean reward and, where the rows carry a reference `answer`,
accuracy in the same sense; prompts go through the same Formatter as training.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gcfamily.data.formats import Formatter, encode
from gcfamily.core.onednn import packed_linears


@torch.no_grad()
def evaluate_rows(
    model: Any,
    formatter: Formatter,
    rows: list[dict[str, Any]],
    reward: Any,
    max_new_tokens: int = 32,
    batch_size: int = 128,
    n: Optional[int] = None,
    accuracy: Optional[bool] = None,
    details: Optional[list[dict[str, Any]]] = None,
) -> dict[str, float]:
    """eval/reward_mean, eval/reward_failed and eval/accuracy (with accuracy=None: where the rows carry an `answer`) over the first n rows.

    rows are prompt-only or prompt-completion rows; `reward` is a rewards.Rewards or any reward function.
    `details`, when given, receives one {index, prompt, completion, reward} per row (reward None where it failed),
    what `gcf bench` pairs across methods and seeds.
    """
    from gcfamily.rewards import as_rewards
    from gcfamily.rollout import SamplingSettings, generate

    data = encode("prompts", rows[: n if n is not None else len(rows)], formatter, 1 << 30, "skip", "evaluation")
    rewards = as_rewards(reward)
    model.eval()
    settings = SamplingSettings(greedy=True, max_new_tokens=max_new_tokens)
    total, ok, correct = 0.0, 0, 0
    with packed_linears(model, batch_size):  # the CPU weights packed once for every batch, not once a batch
        for s in range(0, len(data.rows), batch_size):
            part = data.rows[s : s + batch_size]
            out = generate(model, formatter.tokenizer, data.examples[s : s + batch_size], 1, settings)
            columns = {k: [r.get(k) for r in part] for k in part[0] if k not in ("prompt", "completion")}
            scored = rewards.score([r["prompt"] for r in part], out.completions, None, columns)
            for j, (r, valid) in enumerate(zip(scored.rewards.tolist(), scored.valid.tolist())):
                if valid:
                    total, ok, correct = total + r, ok + 1, correct + (r >= 1.0)
                if details is not None:
                    details.append(
                        {
                            "index": s + j,
                            "prompt": part[j]["prompt"],
                            "completion": out.completions[j],
                            "reward": r if valid else None,
                        }
                    )
    m = len(data.rows)
    metrics = {"eval/reward_mean": total / max(ok, 1), "eval/reward_failed": float(m - ok), "eval/prompts": float(m)}
    if accuracy or (accuracy is None and "answer" in data.rows[0]):
        metrics["eval/accuracy"] = correct / max(m, 1)
    return metrics


@torch.no_grad()
def heldout_accuracy(
    model: Any,
    tokenizer: Any,
    task: Any,
    n: int = 64,
    max_new_tokens: int = 32,
    batch_size: int = 128,
    formatter: Optional[Formatter] = None,
) -> float:
    """Fraction of the held-out prompts (the first n test rows, each prompt once) of a task whose greedy completion scores >= 1 under the task's reward."""
    rows = task.heldout_rows(n)
    if not rows:
        return 0.0
    return evaluate_rows(
        model, formatter or Formatter(tokenizer), rows, task.reward, max_new_tokens, batch_size, accuracy=True
    )["eval/accuracy"]


@torch.no_grad()
def sampled_pass_at_k(
    model: Any,
    formatter: Formatter,
    rows: list[dict[str, Any]],
    reward: Any,
    k: int,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 0,
    batch_prompts: int = 16,
) -> dict[int, float]:
    """pass@j for j = 1..k: k sampled completions per prompt, c of them scoring >= 1, the unbiased estimator averaged over prompts.

    batch_prompts x k rows are sampled at once: 16 x 8 took 33-36 s for 64 sorting-short prompts on SmolLM2-135M (2 threads),
    8 x 8 43-48 s."""
    from gcfamily.rewards import as_rewards
    from gcfamily.rollout import SamplingSettings, generate
    from gcfamily.core.stats import pass_at_k

    data = encode("prompts", rows, formatter, 1 << 30, "skip", "evaluation")
    rewards = as_rewards(reward)
    model.eval()
    settings = SamplingSettings(temperature=temperature, max_new_tokens=max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    counts = []
    with packed_linears(model, batch_prompts * k):  # the CPU weights packed once for every batch, not once a batch
        for s in range(0, len(data.rows), batch_prompts):
            part = data.rows[s : s + batch_prompts]
            out = generate(model, formatter.tokenizer, data.examples[s : s + batch_prompts], k, settings, gen)
            columns = {
                key: [r.get(key) for r in part for _ in range(k)]
                for key in part[0]
                if key not in ("prompt", "completion")
            }
            scored = rewards.score([r["prompt"] for r in part for _ in range(k)], out.completions, None, columns)
            ok = [(v and r >= 1.0) for r, v in zip(scored.rewards.tolist(), scored.valid.tolist())]
            counts += [sum(ok[i * k : (i + 1) * k]) for i in range(len(part))]
    return {j: sum(pass_at_k(k, c, j) for c in counts) / max(len(counts), 1) for j in range(1, k + 1)}
