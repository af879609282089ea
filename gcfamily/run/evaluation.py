"""The run's rows and evaluations: what a method trains on, the validation rows kept out of it, and the held-out
figures (eval_at_ends, eval_every, eval_every_s). An object the Trainer holds, given the settings, the data and the
formatter; the policy and the method come with each call.

The held-out figures of a run on eval_dataset (its first eval_samples rows) are two kinds, each where it applies:
- the method's own objective on those rows (`Method.eval_batch` / `Method.eval_metrics`): eval/loss for SFT, and for
  DPO and its variants eval/loss, eval/margin and eval/ranking_accuracy on held-out preference pairs. The method
  turns the rows into a batch once, in `check`, before any update, so that pi_ref's log-probs are the initial
  policy's (the Trainer calls `check` after the method's setup and before a resumed checkpoint is loaded);
- the greedy completions of those rows scored by the run's reward (gcfamily/run/heldout.py: eval/reward_mean, one
  eval/reward/<name> per reward, eval/accuracy where a reward is a correctness check). A method with figures of its
  own needs no reward: without one, no completion is generated.
On a built-in task the figure is the task's held-out accuracy, as before.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from gcfamily.data.sources import load_rows
from gcfamily.errors import GcfError
from gcfamily.run.folder.writes import append_lines


class Evaluation:
    """Training rows, validation rows and held-out evaluation."""

    def __init__(
        self,
        cfg: Any,
        method_cls: type,
        formatter: Any,
        dataset: Any,
        eval_dataset: Any,
        rewards: list | None,
        out_dir: Path,
        is_main: bool,
    ) -> None:
        self.cfg, self.method_cls, self.formatter = cfg, method_cls, formatter
        self.dataset, self.eval_dataset, self.rewards = dataset, eval_dataset, rewards
        self.out_dir, self.is_main = out_dir, is_main
        self.task = self._load_task()
        self._eval_cache: list[dict[str, Any]] | None = None
        self._eval_reward_fn: Any = None
        self.method_batch: Any = None
        """eval_dataset's rows as the method's held-out batch (Method.eval_batch, made in `check`); None: no figures of the
        method's own."""

    def training_rows(self) -> list[dict[str, Any]]:
        """The rows the method trains on: the dataset's (columns renamed), else the task's rows for this method."""
        cfg = self.cfg
        if self.dataset is not None:
            return load_rows(self.dataset, cfg.dataset_split, cfg.dataset_config, cfg.columns)
        if self.task is not None:
            rows = self.method_cls.task_rows(self.task, cfg)
            if cfg.validation_rows:  # the validation prompts never train
                held = {str(r["prompt"]) for r in self.validation_rows()}
                rows = [r for r in rows if str(r["prompt"]) not in held]
                if not rows:
                    raise GcfError(
                        f"validation_rows={cfg.validation_rows} leaves no training rows of task {cfg.task}; lower it."
                    )
            return rows
        raise GcfError(
            f"{cfg.method} needs data: pass --dataset (a file, a save_to_disk folder or a hub id) or --task NAME."
        )

    def validation_rows(self) -> list[dict[str, Any]]:
        """The last validation_rows rows of the task's train split (never trained on when validation_rows > 0)."""
        train = self.task.rows("train")
        if self.cfg.validation_rows >= len(train):
            raise GcfError(
                f"validation_rows={self.cfg.validation_rows} is not smaller than task {self.cfg.task}'s {len(train)} training rows; lower it."
            )
        return train[len(train) - self.cfg.validation_rows :]

    def _load_task(self) -> Any:
        # a dataset replaces the task: its accuracy is never reported
        if self.cfg.task is None or self.dataset is not None:
            return None
        from gcfamily.tasks import get_task

        seed = self.cfg.seed if self.cfg.task_seed is None else self.cfg.task_seed
        return get_task(self.cfg.task, seed=seed, **self.cfg.task_options)

    def evaluate(
        self,
        policy: Any,
        method: Any,
        step: int,
        gathered: contextlib.AbstractContextManager,
        autocast: contextlib.AbstractContextManager,
        bar: Any = None,
    ) -> dict[str, float]:
        """Held-out figures of `policy` (the plain model; `gathered` holds its whole parameters under FSDP2): on
        eval_dataset, the method's own objective (Method.eval_metrics) and the greedy completions' rewards (where the run
        has a reward); else on the task, its accuracy. Nothing when neither exists or the method trains no policy.
        `bar`: a progress bar over the prompts whose completions are generated (console.eval_bar), or None."""
        if not method.trains_policy or (self.task is None and self.eval_dataset is None):
            return {}
        from gcfamily.run.heldout import evaluate_rows

        cfg = self.cfg
        was_training = policy.training
        out: dict[str, float] = {}
        if self.method_batch is not None:  # outside `gathered`: services.logprobs runs an FSDP2 policy through its root
            policy.eval()
            try:
                out.update(method.eval_metrics(method.services, self.method_batch))
            finally:
                policy.train(was_training)
            if not self.scores_completions(method):
                return out
        details: list[dict[str, Any]] = []
        services = getattr(method, "services", None)  # a run with an environment evaluates on greedy episodes
        episodes = (services.envs, services.episode_limits) if getattr(services, "envs", None) is not None else None
        with gathered, autocast:
            if self.eval_dataset is not None:
                out.update(
                    evaluate_rows(
                        policy,
                        self.formatter,
                        self.eval_rows(),
                        self.eval_reward(method),
                        cfg.max_new_tokens,
                        n=cfg.eval_samples,
                        details=details,
                        bar=bar,
                        episodes=episodes,
                    )
                )
            else:  # the task's held-out accuracy: the share of its held-out prompts (heldout_rows) scoring >= 1
                validation = bool(cfg.validation_rows)  # then the test split is never read
                rows = (
                    self.validation_rows()[: cfg.eval_samples]
                    if validation
                    else self.task.heldout_rows(cfg.eval_samples)
                )
                got = evaluate_rows(
                    policy,
                    self.formatter,
                    rows,
                    self.task.reward,
                    cfg.max_new_tokens,
                    accuracy=True,
                    details=details,
                    bar=bar,
                    episodes=episodes,
                )
                out = {"eval/val_accuracy" if validation else "eval/accuracy": got["eval/accuracy"]}
                if episodes is not None:  # an episode's reward may be partial (1 / turns): its mean, and the turns
                    out.update({k: got[k] for k in ("eval/reward_mean", "eval/turns_mean")})
        policy.train(was_training)
        if self.is_main:  # per prompt, for paired comparisons (gcf bench): the same prompts in every run of a task_seed
            append_lines(self.out_dir / "eval_details.jsonl", [json.dumps({"step": step, "rows": details})])
        return out

    def check(self, method: Any) -> None:
        """Refuse, before training, an evaluation that could not run or would report the wrong thing; make the method's
        held-out batch (Method.eval_batch) while the policy is still the initial one."""
        cfg = self.cfg
        wanted = cfg.eval_at_ends or cfg.eval_every or cfg.eval_every_s
        if not wanted or not method.trains_policy:
            return
        if self.eval_dataset is None and self.dataset is not None:
            raise GcfError(
                "Evaluating a run on your own dataset needs held-out rows: pass --set eval_dataset=PATH_OR_HUB_ID (split: eval_split) "
                "and a --reward to score their greedy completions (sft and dpo report their held-out loss without one); "
                "a built-in task's accuracy is never reported for it."
            )
        if self.eval_dataset is not None:
            self.method_batch = method.eval_batch(method.services, self.eval_rows()[: cfg.eval_samples])
            if self.scores_completions(method):
                from gcfamily.data.encoding import encode

                # its format, now rather than after training
                encode("prompts", self.eval_rows(), self.formatter, 1 << 30, "skip", "evaluation")
                self.eval_reward(method)

    def scores_completions(self, method: Any) -> bool:
        """Whether an evaluation on eval_dataset generates and scores completions: always for a method without held-out
        figures of its own (then a missing reward is an error), else only where the run has a reward."""
        if self.method_batch is None:
            return True
        from gcfamily.rewards import reward_specs

        return bool(
            getattr(method, "reward_fn", None) or self._eval_reward_fn or self.rewards or reward_specs(self.cfg.reward)
        )

    def eval_rows(self) -> list[dict[str, Any]]:
        """eval_dataset's rows (columns renamed), read once."""
        if self._eval_cache is None:
            cfg = self.cfg
            self._eval_cache = load_rows(self.eval_dataset, cfg.eval_split, cfg.dataset_config, cfg.columns)
        return self._eval_cache

    def eval_reward(self, method: Any) -> Any:
        """The run's reward: the on-policy method's own, else the rewards given (--reward, or functions from Python)."""
        fn = getattr(method, "reward_fn", None) or self._eval_reward_fn
        if fn is None:
            from gcfamily.rewards import Rewards, reward_specs

            specs = list(self.rewards) if self.rewards is not None else reward_specs(self.cfg.reward)
            if not specs:
                raise GcfError(
                    "Evaluating on eval_dataset needs a reward to score completions with: pass --reward (e.g. numeric)."
                )
            fn = self._eval_reward_fn = Rewards.from_specs(specs, self.cfg.reward_weights, self.cfg.reward_timeout)
        return fn
