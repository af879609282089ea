"""What every on-policy method shares: prompts -> G sampled completions each -> rewards.

RFT, GRPO and its variants (and PPO later) differ only in what they make of the scored
samples (`prepare`) and in their coefficient; the data source is this one class:

    prompts  = batch_size rows of the task's train split, picked by (seed, step)
    rollout  = services.generate(prompts, G, sampling)   # the run's generator; eval mode, FSDP2 gathering inside
    rewards  = self.reward_fn.score(...)   # sum_k w_k r_k; a failing sample: valid=False, counted

A sample whose reward failed keeps its row but has valid=False, so the engine gives it no
gradient and leaves it out of the normaliser Z. If every sample of a step fails, on every
process, the run stops with one sentence naming the reward function (rewards.RewardFailure).

Every on-policy method also owns the sampler correction (settings tis, tis_max, tis_min; gcfamily/methods/tis.py):
`sampler_correction` is the weight w_t = rho truncated or masked, rho = pi_old/pi_sampler, that each method's
per-token term is multiplied by, and `metrics` logs the sampler/trainer mismatch of every step that carries the
sampler's log-probs (rollout/logp_diff_mean and _max; with tis on, tis/ratio_mean, _min, _max and tis/masked_frac).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from gcfamily.config import Config, MethodSettings, resolve_settings
from gcfamily.config.rules import require
from gcfamily.core.engine import effective_mask
from gcfamily.errors import GcfError
from gcfamily.methods import tis
from gcfamily.methods.base import GENERATED, Batch, Method, Stats
from gcfamily.methods.samples import sample_scored
from gcfamily.methods.services import Services
from gcfamily.rewards import RewardFailure, RewardFn, Rewards, Term, reward_specs
from gcfamily.rollout import SamplingSettings, context_length


class OnPolicy(Method):
    """Base of the methods that train on their own samples; subclasses write prepare/coefficient."""

    reads_steps: ClassVar[bool] = False
    """True for a method that uses step scores (process supervision): data() then adds step_rewards and step_mask;
    otherwise a reward that scores steps is refused in one sentence."""

    data_source = "the policy's own samples: G completions per prompt, scored by the reward"
    data_kind = "prompts"
    runs_episodes = True

    @dataclass
    class Settings(MethodSettings):
        tis: str = "off"
        """Truncated importance sampling against the sampler (TRL's vllm_importance_sampling_mode): each token's term
        weighed by rho = pi_old/pi_sampler (no gradient), per token (token_truncate, token_mask) or one product per
        row (sequence_truncate, sequence_mask), clamped into [tis_min, tis_max] (*_truncate) or 0 outside it (*_mask);
        off: no weight (docs/methods.md, "Sampler correction")."""
        tis_max: float = 3.0
        """Upper bound of the TIS ratio (TRL's vllm_importance_sampling_clip_max): clamped to it, or masked above it."""
        tis_min: Optional[float] = None
        """Lower bound of the TIS ratio (TRL's vllm_importance_sampling_clip_min); none: no lower bound."""

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.group_size < 1:
            raise GcfError("Invalid setting: group_size must be >= 1.")
        s = resolve_settings(cfg, cls).settings
        require(
            [
                (s.tis in tis.MODES, f"tis must be one of {', '.join(tis.MODES)} (got {s.tis!r})"),
                (s.tis_max > 0, f"tis_max must be > 0 (got {s.tis_max})"),
                (s.tis_min is None or s.tis_min < s.tis_max, f"tis_min must be below tis_max={s.tis_max} or none"),
            ]
        )

    def setup(self, services: Services) -> None:
        super().setup(services)
        cfg = self.cfg
        # prompt-only or prompt-completion rows: their prompts' ids, and the rows for the rewards
        data = self.load_data(services)
        self.rows, self.prompt_tokens, self.skipped = data.rows, data.examples, data.n_skipped
        ctx = context_length(services.policy())
        # a prompt whose completion could run past the model's positions is skipped now, not refused mid-run
        if ctx is not None:
            fits = [i for i, p in enumerate(self.prompt_tokens) if len(p) + cfg.max_new_tokens <= ctx]
            if cfg.long_prompts == "error" and len(fits) < len(self.prompt_tokens):
                i = next(i for i in range(len(self.prompt_tokens)) if i not in set(fits))
                n = len(self.prompt_tokens[i])
                raise GcfError(
                    f"A prompt of {n} tokens plus max_new_tokens={cfg.max_new_tokens} needs {n + cfg.max_new_tokens} positions, past the "
                    f"model's context of {ctx}; shorten it, lower max_new_tokens, or set long_prompts=skip."
                )
            if not fits:
                raise GcfError(
                    f"Every prompt plus max_new_tokens={cfg.max_new_tokens} runs past the model's context of {ctx} tokens; "
                    "lower max_new_tokens or use shorter prompts."
                )
            self.skipped += len(self.prompt_tokens) - len(fits)
            self.rows, self.prompt_tokens = [self.rows[i] for i in fits], [self.prompt_tokens[i] for i in fits]
        self.reward_fn: RewardFn = self.build_reward_fn()
        self.warned_reward = self.warned_cut = False
        self.sampling = sampling_of(cfg)

    def build_reward_fn(self) -> Rewards:
        """The reward hook (`make_rewards`); a method that reads steps takes the task's process reward."""
        return make_rewards(self.cfg, self.services, self.name, self.reads_steps)

    # -- the data source -------------------------------------------------------------
    def data(self, step: int) -> tuple[Batch, Stats]:
        """batch_size prompts (deterministic in seed and step), G samples each, scored."""
        cfg, services = self.cfg, self.services
        G = cfg.group_size
        idx = self.step_indices(len(self.rows), step)  # whole groups stay on one rank
        rows = [self.rows[i] for i in idx]
        got = sample_scored(services, [self.prompt_tokens[i] for i in idx], rows, G, self.sampling, self.reward_fn)
        ro, prompts, ids, scored, reward_s = got.rollout, got.prompts, got.completion_ids, got.scores, got.reward_s
        rewards, valid, errors = scored.rewards, scored.valid, scored.errors  # [N], [N]
        if not self.reads_steps:
            scored.require_outcome(self.name)
        # Every sample failed? Decided over all processes: one rank's failures alone leave it a step without gradient,
        # and a run that is stopping anyway (its samples abandoned) stops at its checkpoint instead.
        counts = services.all_sum(torch.tensor([float(valid.sum()), float(services.stop_requested())]))
        if len(valid) and counts[0] == 0 and counts[1] == 0:
            raise RewardFailure(scored.failure_message())
        ok = valid.float()
        n_ok = max(float(ok.sum()), 1.0)
        mean = float((rewards * ok).sum()) / n_ok
        lengths = ro.completion_lengths.float().cpu()  # [N]
        batch = Batch(
            input_ids=ro.input_ids.cpu(),  # [N, L]
            attention_mask=ro.attention_mask.cpu(),  # [N, L]
            loss_mask=ro.completion_mask.cpu(),  # [N, L]
            sample_logps=ro.sample_logps.cpu(),  # [N, L]
            rewards=rewards,  # [N]
            valid=valid,  # [N]
            prompt_index=ro.prompt_index.cpu(),  # [N]
            completions=ro.completions,
            truncated=ro.truncated.cpu(),  # [N]
            reward_parts=torch.stack([r for r, _ in scored.per_reward.values()], -1) if scored.per_reward else None,
        )
        if (
            self.reads_steps and got.episodes is not None
        ):  # each turn's step reward on its last token, the outcome on the last
            batch.step_rewards, batch.step_mask = episode_steps(got.episodes, scored, batch.loss_mask)
        elif self.reads_steps:  # each step's reward on the token holding its last character: [N, L] each
            batch.step_rewards, batch.step_mask, unplaced = place_steps(
                services.tokenizer, scored, ids, ro.completions, batch.loss_mask
            )
            batch.valid = valid = valid & ~unplaced
            errors = errors + [
                f"the steps of sample {i} could not be placed on its tokens"
                for i in unplaced.nonzero().flatten().tolist()
            ]
        stats: Stats = {
            "reward/mean": mean,
            "reward/std": math.sqrt(float((((rewards - mean) * ok) ** 2).sum()) / n_ok),
            "reward/failed": float(len(errors)),
            **(scored.stats() if len(scored.per_reward) > 1 else {}),  # reward/<name>/mean, /std
            "time/reward_s": reward_s,
            "skipped_long_prompts": float(self.skipped),
            "completion/length_mean": float(lengths.mean()),
            "completion/truncated_frac": float(ro.truncated.float().mean()),
            **ro.stats,  # the rollout backend's own figures (rollout=vllm: the weight push's seconds and probe gap)
            **(got.episodes.stats if got.episodes is not None else {}),  # turns, environment tokens, how episodes ended
            GENERATED: float(lengths.mean())
            * len(lengths),  # as the trainer counted it: mean length times rows sampled
        }
        # the first completion of each of the first 8 prompts, at the metrics' step number
        services.log_samples(
            step + 1,
            [
                {
                    "prompt": prompts[i],
                    "completion": ro.completions[i],
                    "reward": float(rewards[i]) if valid[i] else None,
                    **({"turns": got.episodes.episodes[i].turns} if got.episodes is not None else {}),
                }
                for i in range(0, min(len(prompts), 8 * G), G)
            ],
        )
        if errors and not self.warned_reward:  # once per run; every step's count is in reward/failed
            self.warned_reward = True
            print(
                f"warning: {errors[0]} at step {step} ({len(errors)} of {len(errors) + int(valid.sum())} samples failed); "
                "failed samples get no gradient and are counted in reward/failed.",
                file=sys.stderr,
            )
        if stats.get("episode/obs_truncated") and not self.warned_cut:  # once per run; each step's count is logged
            self.warned_cut = True
            print(
                f"warning: an environment's answer at step {step} was longer than the episode's room left "
                "(max_episode_tokens or the model's context) and was cut; counted in episode/obs_truncated.",
                file=sys.stderr,
            )
        return batch, stats

    def logprob_temperature(self) -> float:
        """Log-probs at the sampling temperature, so the ratio against pi_old starts at exactly 1."""
        return self.cfg.temperature

    # -- the sampler correction (gcfamily/methods/tis.py) ------------------------------
    def sampler_correction(self, batch: Batch, old_logps: torch.Tensor) -> torch.Tensor:
        """w [B, L], no gradient: rho = pi_old/pi_sampler truncated (*_truncate) or masked (*_mask) as the setting tis
        says, 1 everywhere with tis=off. old_logps: pi_old's, the current log-probs where prepare computed none. A
        method multiplies its per-token term by w (its docstring says which term)."""
        s = self.settings
        if s.tis == "off":
            return torch.ones_like(old_logps)
        if batch.sample_logps is None:
            raise GcfError(
                f"tis={s.tis} weighs each token by pi_old/pi_sampler, but this batch has no sampler log-probs "
                "(sample_logps), so there is nothing to correct against; set tis=off for data sampled elsewhere."
            )
        rho = tis.sampler_ratio(s.tis, old_logps, batch.sample_logps, batch.loss_mask)
        return tis.weight(s.tis, rho, s.tis_min, s.tis_max).detach()  # [B, L]

    def mismatch_metrics(self, batch: Batch, old_logps: torch.Tensor) -> Stats:
        """tis.mismatch_metrics over the loss tokens of the valid rows; none for a batch without sample_logps."""
        if batch.sample_logps is None:
            return {}
        s = self.settings
        on = effective_mask(batch)  # [B, L]
        return tis.mismatch_metrics(s.tis, old_logps, batch.sample_logps, batch.loss_mask, on, s.tis_min, s.tis_max)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        """The sampler/trainer mismatch of this micro-batch where pi_old is its forward (one pass over one minibatch).
        Where prepare computed pi_old, every optimizer step of the batch sees the same figures and `prepared_mismatch`
        reports them once for the whole step (the trainer averages over optimizer steps, which no max survives)."""
        return {} if batch.old_logps is not None else self.mismatch_metrics(batch, logps)

    def prepared_mismatch(self, batch: Batch) -> Stats:
        """The whole step's mismatch figures, for prepare's statistics, where prepare computed pi_old; else none."""
        return {} if batch.old_logps is None else self.mismatch_metrics(batch, batch.old_logps)


def make_rewards(cfg: Config, services: Services, method: str, steps: bool = False) -> Rewards:
    """The run's reward: --reward-model DIR, --reward (one or several, weighted by reward_weights), else the task's
    (its process reward when `steps` and it has one).

    A trained reward model (`gcf run --method reward-model`), the task's reward and the built-in rewards run in this
    process; module:function and file.py:function rewards run in a worker process (rewards/guard.py), each call
    limited to reward_timeout seconds.
    """
    task = services.task
    specs = reward_specs(cfg.reward)
    weight = float(cfg.reward_weights[0]) if cfg.reward_weights else 1.0  # a single reward's weight
    if cfg.reward_model:
        if specs:
            raise GcfError(
                f"Both reward={cfg.reward} and reward_model={cfg.reward_model} were given; pass one of --reward and --reward-model."
            )
        from gcfamily.rewards.model import load_reward_model

        fn = load_reward_model(
            cfg.reward_model, services.device, services.dtype, cfg.micro_batch_size, cfg.trust_remote_code
        )
        return Rewards([Term("reward_model", fn=fn, weight=weight)])
    if services.reward_functions is not None:  # objects from Python: functions run in this process
        specs = list(services.reward_functions)
    if specs:
        return Rewards.from_specs(specs, cfg.reward_weights, cfg.reward_timeout)
    if task is not None:
        process = getattr(task, "process_reward", None) if steps else None
        name = (getattr(task, "name", "") or "task") + ("_steps" if process is not None else "")
        # the task's answer check is a correctness reward (eval/accuracy); its per-step reward and partial credit are not
        right = process is None and not getattr(task, "partial", False)
        return Rewards([Term(name, fn=process or task.reward, weight=weight, correctness=right)])
    raise GcfError(f"{method} needs a reward: pass --reward (e.g. numeric or my_rewards.py:fn) for your dataset.")


def sampling_of(cfg: Config) -> SamplingSettings:
    """The run's sampling settings."""
    return SamplingSettings(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        stop_strings=tuple(cfg.stop_strings),
        compile=cfg.rollout_compile,
    )


def place_steps(
    tokenizer: Any, scored: Any, completion_ids: list[list[int]], texts: list[str], loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """step_rewards and step_mask [N, L]: each step's weighted reward on the completion token that holds the step's
    last character, and [N] the samples whose text cannot be laid on their tokens exactly (a decoded prefix that is not a
    prefix of the text), which are then invalid.

    Token j of a completion covers the characters between len(decode(ids[:j])) and len(decode(ids[:j+1])), decoded as
    the rollout decodes (skip_special_tokens); a step ending at character e lands on the first token whose prefix
    reaches e. A prefix that ends inside a character (a multi-byte one split over tokens decodes to U+FFFD) covers
    nothing yet: the character belongs to the token that completes it. A step ending at the completion's end (a number
    is one such step) lands on its last token, the EOS included, so outcome rewards give every token the outcome
    advantage, as outcome supervision does."""
    N, L = loss_mask.shape
    rewards, mask = torch.zeros(N, L), torch.zeros(N, L, dtype=torch.bool)
    unplaced = torch.zeros(N, dtype=torch.bool)
    if scored.steps is not None:
        steps = scored.steps
    else:  # outcome rewards only: one step at each valid sample's end
        steps = [
            [(max(len(t), 1), r)] if ok else []
            for t, r, ok in zip(texts, scored.rewards.tolist(), scored.valid.tolist())
        ]
    for i, row in enumerate(steps):
        positions = loss_mask[i].nonzero().flatten().tolist()  # where the completion's tokens sit in the row
        if not row or not positions:
            continue
        ids, text = completion_ids[i], texts[i]
        inner = [end for end, _ in row if end < len(text)]
        ends: list[int] = []  # characters covered by tokens 0..j, as far as an inner step needs
        for j in range(len(ids)) if inner else []:
            prefix = tokenizer.decode(ids[: j + 1], skip_special_tokens=True)
            if prefix.endswith("\ufffd"):  # inside a character split over tokens
                ends.append(ends[-1] if ends else 0)
                continue
            if len(prefix) < len(text) and not text.startswith(prefix):
                unplaced[i] = True
                break
            ends.append(len(prefix))
            if len(prefix) >= max(inner):
                break
        for end, score in [] if unplaced[i] else row:
            j = len(positions) - 1 if end >= len(text) else next((k for k, e in enumerate(ends) if e >= end), None)
            if j is None or j >= len(positions):
                unplaced[i] = True
                break
            rewards[i, positions[j]] += score
            mask[i, positions[j]] = True
        if unplaced[i]:
            rewards[i], mask[i] = 0.0, False
    return rewards, mask, unplaced


def episode_steps(episodes: Any, scored: Any, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """step_rewards and step_mask [N, L] of episodes: each turn's step reward on that turn's last policy token, and the
    episode's outcome (its final reward) on its last policy token, so that the steps sum to the episode's reward."""
    N, L = loss_mask.shape
    rewards, mask = torch.zeros(N, L), torch.zeros(N, L, dtype=torch.bool)
    for i, ep in enumerate(episodes.episodes):
        positions = loss_mask[i].nonzero().flatten().tolist()  # the policy's tokens in the row
        if not positions or not bool(scored.valid[i]):
            continue
        start = positions[0]  # the episode's first token (a policy turn opens every episode)
        outcome = float(scored.rewards[i]) - sum(score for _, score in ep.steps)
        for at, score in [*ep.steps, (positions[-1] - start, outcome)]:
            rewards[i, start + at] += score
            mask[i, start + at] = True
    return rewards, mask


def masked_group_stats(
    rewards: torch.Tensor, valid: torch.Tensor, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, std and count of the valid rewards of each group; rewards/valid are [n, G] -> [n] each.

    Computed in float64 so that a tiny spread does not round to zero. A group with fewer than two
    valid rewards has std 0 when `unbiased` (the sample std is undefined there).
    """
    r, v = rewards.double(), valid.double()  # [n, G]
    count = v.sum(-1)  # [n]
    mean = (r * v).sum(-1) / count.clamp(min=1)  # [n]
    sq = (((r - mean[:, None]) * v) ** 2).sum(-1)  # [n]
    dof = (count - 1) if unbiased else count
    std = torch.where(dof > 0, sq / dof.clamp(min=1), torch.zeros_like(sq)).sqrt()  # [n]
    return mean, std, count


def all_equal_groups(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[n] bool: groups whose valid rewards are all equal (or that have fewer than two of them)."""
    hi = rewards.masked_fill(~valid, -math.inf).amax(-1)  # [n]
    lo = rewards.masked_fill(~valid, math.inf).amin(-1)  # [n]
    return (valid.sum(-1) < 2) | (hi <= lo)
