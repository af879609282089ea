"""The Method API: a data source, a prepare step, and the gradient coefficient.

A method never computes a loss for the policy; the engine does, from the coefficient:

    logps = engine.token_logprobs(policy, batch)       # [B, L], with grad
    coef  = method.coefficient(batch, logps.detach())  # [B, L], no grad
    loss  = -(coef * w * logps * mask).sum() / Z       # grad == -grad J

Every method also states its textbook objective J in `objective` so that the exactness
suite can check, on random inputs, that the engine's gradient equals autograd of J.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator

import torch

from gcfamily.config import FIELD_NAMES, Config, MethodSettings, resolve_settings
from gcfamily.core.batch import ROW, STEP, TOKEN, Batch
from gcfamily.core.engine import effective_mask, example_weights, token_weights
from gcfamily.data.batches import epoch_indices
from gcfamily.methods.services import LocalServices, Services

__all__ = ["Batch", "EXTREMES", "GENERATED", "Method", "ROW", "STEP", "Stats", "TOKEN", "extreme", "heldout_normaliser"]

if TYPE_CHECKING:
    from gcfamily.data.encoding import Encoded

Stats = dict[str, float]
"""A step's statistics, returned beside its batch by `data` and `prepare` and logged under their names."""
GENERATED = "tokens/generated"
"""The statistic in which a data source that samples reports how many tokens it generated (budgets and FLOPs count it)."""
EXTREMES: dict[str, Callable[[Iterable[float]], float]] = {"_max": max, "_min": min}
"""A figure whose name ends so is a maximum or a minimum (tis/ratio_max, rollout/logp_diff_max): where the figures of
several micro-batches (run/step.py) or ranks (run/distributed.py) make one, it is their max or min, never their mean.
No other figure's name may end so."""


def extreme(key: str) -> Callable[[Iterable[float]], float] | None:
    """max for a figure named ..._max, min for ..._min (EXTREMES); None for a figure that is averaged."""
    return next((f for end, f in EXTREMES.items() if key.endswith(end)), None)


DRAWN_FROM = ("examples", "pairs", "pool_prompts", "rows")
"""The lists the built-in methods draw each step's examples from (step_indices(len(...))): encoded rows (sft, kto),
pairs (dpo and its variants, reward-model), the pool's prompts (rft-offline), the prompts (on-policy methods)."""


class Method:
    """Base class. Subclass and override `coefficient` (and `objective`) to add a rule."""

    name: str = ""
    data_source: str = ""
    """One line for `gcf methods`: where the data come from."""
    gc_formula: str = ""
    """One line for `gcf methods`: GC on token t of output o."""
    default_norm: str = "sequence"
    """Aggregation of the textbook objective (engine.py's normalisation contract)."""
    rows_per_example: int = 1
    """Rows that must stay in one micro-batch (2 for a preference pair)."""
    data_kind: str = ""
    """What the method reads from a dataset (formats.KINDS): demonstrations, prompts, pairs or labelled; "" = none."""
    runs_episodes: bool = False
    """True for a method whose data source samples through methods/samples.py, so that --env makes each sample an
    episode (the on-policy methods); a method that trains on data it does not sample refuses --env."""
    trains_policy: bool = True
    """False for a method that trains only a model of its own (the reward model): the trainer then
    runs no policy log-probs or backward, only `auxiliary_step`, and saves via `save_final`."""

    Settings = MethodSettings
    """This method's own settings: a dataclass with a docstring per field. A subclass extends its parent's
    (`class Settings(GRPO.Settings): decay: float = 0.9`); `--set decay=0.5` then reaches it."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = resolve_settings(cfg, type(self))
        self.settings = cfg.settings
        self.norm = cfg.loss_norm or self.default_norm
        self.services: Services = LocalServices()  # one process until setup gives the run's

    # -- lifecycle -------------------------------------------------------------------
    setting_defaults: ClassVar[dict[str, Any]] = {}
    """This method's own defaults, e.g. {"beta": 0.1} for DPO, or a function of the settings
    ({"norm_constant": lambda cfg: cfg.max_new_tokens}). They replace the shared defaults of
    settings that no recipe or command line gave (cfg.explicit), before the settings are saved."""

    @classmethod
    def apply_setting_defaults(cls, cfg: Config) -> None:
        """Fill in setting_defaults for the settings the user did not give."""
        for key, value in cls.setting_defaults.items():
            if key not in cfg.explicit:
                v = value(cfg) if callable(value) else value
                setattr(cfg if key in FIELD_NAMES else resolve_settings(cfg, cls).settings, key, v)

    @classmethod
    def validate(cls, cfg: Config) -> None:
        """Check this method's settings (shared and its own, `cfg.settings`); raise GcfError with one clear sentence."""
        resolve_settings(cfg, cls)

    def setup(self, services: Services) -> None:
        """Called once with the run's services (gcfamily/methods/services.py): policy, tokenizer and task are ready."""
        self.services = services

    @classmethod
    def task_rows(cls, task: Any, cfg: Config, split: str = "train") -> list[dict[str, Any]]:
        """The rows a built-in task gives this method (its prompt-completion rows; DPO and KTO make pairs from them)."""
        return task.rows(split)

    def load_data(self, services: Services) -> "Encoded":
        """The run's rows (its dataset, else its task's), checked against `data_kind` and tokenised (encoding.encode)."""
        from gcfamily.data.encoding import encode

        cfg = self.cfg
        return encode(
            self.data_kind,
            services.training_rows(),
            services.formatter,
            cfg.max_length,
            cfg.long_prompts,
            self.name or cfg.method,
        )

    # -- the three parts of a method -------------------------------------------------
    def data(self, step: int) -> tuple[Batch, Stats]:
        """The batch of `step` and its statistics; deterministic in (seed, step) so a resumed run sees the same data."""
        raise NotImplementedError

    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        """Add what is fixed for the step, without grad (rewards, advantages, old/ref log-probs); returns the batch and
        the statistics of what it computed."""
        return batch, {}

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        """GC[B, L] = dJ/dlogp_t at the current (detached) log-probs."""
        raise NotImplementedError

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        """The textbook objective J (to maximise) with the method's aggregation; used by tests."""
        raise NotImplementedError

    # -- optional hooks --------------------------------------------------------------
    def logprob_temperature(self) -> float:
        """Temperature of the policy's log-probs (on-policy methods use the sampling one)."""
        return 1.0

    def inner_epochs(self) -> int:
        """How many passes over each prepared batch (PPO/GRPO's mu)."""
        return 1

    def examples_per_epoch(self) -> int | None:
        """N, the examples one pass over the training data holds, after setup (what `epochs` counts in passes): by
        default the length of the list the built-in methods draw each step from (`DRAWN_FROM`); None where the method
        has none, and then `epochs` is refused for it. Override where a method draws from elsewhere."""
        for name in DRAWN_FROM:
            drawn = getattr(self, name, None)
            if isinstance(drawn, (list, tuple)):
                return len(drawn)
        return None

    def num_minibatches(self) -> int:
        """Optimizer steps per pass."""
        return 1

    def auxiliary_step(self, batch: Batch) -> dict[str, float]:
        """Backward of a second model's loss (PPO's critic, the reward model) on this micro-batch; returns metrics."""
        return {}

    def auxiliary_step_end(self) -> dict[str, float]:
        """Called once per optimizer step, after the step's micro-batches: step the second model; returns metrics."""
        return {}

    def save_final(self, out_dir: Path) -> bool:
        """Save the run's final model when it is the method's own (the reward model); False: the trainer saves the policy."""
        return False

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        """Method-specific metrics of one micro-batch: means, which the trainer averages weighted by the micro-batches'
        loss tokens, and maxima or minima named ..._max or ..._min, which it combines by max or min (EXTREMES)."""
        return {}

    def after_step(self, step: int) -> dict[str, float]:
        """Called after each training step (e.g. refresh the reference)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Method state to checkpoint (counters, a critic and its optimizer)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""

    def owned_models(self) -> list[torch.nn.Module]:
        """Models the method holds besides the policy: a frozen pi_ref (sharded like the policy under
        FSDP2) or a model it trains (PPO's critic, whose gradients are averaged over the ranks)."""
        return [m for m in vars(self).values() if isinstance(m, torch.nn.Module)]

    # -- held-out figures (gcfamily/run/evaluation.py) --------------------------------
    def eval_batch(self, services: Services, rows: list[dict[str, Any]]) -> Batch | None:
        """The held-out rows (eval_dataset's first eval_samples) as a batch for `eval_metrics`; None (here): the method
        reports no held-out figures of its own. Called once, before any update, so the policy is still pi_ref: a method
        whose objective reads pi_ref's log-probs computes them here."""
        return None

    def eval_metrics(self, services: Services, batch: Batch) -> dict[str, float]:
        """Held-out figures of the policy now on `batch` (eval_batch's), without grad: here eval/loss, -J of `objective`
        with the method's aggregation, every held-out row counted as one step of the training normalisation."""
        logps = services.logprobs(services.policy(), batch, self.logprob_temperature())  # [B, L]
        return {"eval/loss": self.heldout_loss(batch, logps)}

    def heldout_loss(self, batch: Batch, logps: torch.Tensor) -> float:
        """-J on a held-out batch taken as one step: the training loss's value, with no gradient."""
        return -float(self.objective(batch, logps, heldout_normaliser(batch, self.norm, self.cfg.norm_constant)))

    def heldout_encode(self, services: Services, rows: list[dict[str, Any]]) -> Encoded | None:
        """Held-out rows tokenised as this method's data (encoding.encode of `data_kind`); None where they are of a format
        the method does not train on (prompt rows that only a reward scores)."""
        from gcfamily.data.encoding import encode
        from gcfamily.data.formats import KINDS, detect

        if not rows or detect(rows[0]) not in KINDS.get(self.data_kind, ()):
            return None
        cfg = self.cfg
        return encode(
            self.data_kind,
            rows,
            services.formatter,
            cfg.max_length,
            cfg.long_prompts,
            f"{self.name or cfg.method} (its eval_dataset)",
        )

    # -- helpers for subclasses ------------------------------------------------------
    def step_indices(self, n: int, step: int) -> list[int]:
        """This process's examples of `step`: batch_size examples (the global batch, deterministic in
        seed and step), of which rank r of W takes the r-th contiguous 1/W share."""
        idx = epoch_indices(n, self.cfg.seed, step, self.cfg.batch_size)
        world, rank = self.services.world_size, self.services.rank
        per = len(idx) // world  # DistEnv.check makes batch_size divisible
        return idx[rank * per : (rank + 1) * per]

    def aggregate(self, per_token: torch.Tensor, batch: Batch, Z: float) -> torch.Tensor:
        """sum_t w_t * term_t / Z: the aggregation of the contract, for textbook objectives."""
        return (token_weights(batch, self.norm) * per_token).sum() / Z


def heldout_normaliser(batch: Batch, mode: str, norm_constant: float = 1.0) -> float:
    """engine.normaliser's Z for one step made of `batch`, on this process alone: every process evaluates every
    held-out row, so nothing is summed over processes (engine.normaliser would)."""
    if mode == "token":
        z = float(effective_mask(batch).sum())
    else:
        z = float(example_weights(batch).sum()) * (norm_constant if mode == "constant" else 1.0)
    return max(z, 1e-12)


def iter_chunks(seq: list, size: int) -> Iterator[list]:
    """Consecutive slices of a list."""
    for i in range(0, len(seq), size):
        yield seq[i : i + size]
