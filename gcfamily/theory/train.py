"""Training a bandit policy with a real method class, through the real engine.

The bandit replaces the rollout and the reward function; everything else is production code:

    method.setup(runner)                 # GRPO: the frozen reference is a copy of the policy
    batch, _ = method.prepare(batch)     # the method's advantages; pi_ref log-probs via the engine
    logps = engine.token_logprobs(...)   # [N, 2], the log-prob of the output at position 1
    coef  = method.coefficient(batch, logps.detach())
    loss  = engine.weighted_loss(coef * weight, logps, batch, method.norm, Z); loss.backward()

Sampled mode draws groups from the current policy (weight = 1). Exact mode puts every possible
group in the batch and weights each row by its group's probability: the loss is linear in the
coefficient, so its gradient is then exactly the expected gradient of the sampled loss.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch

from gcfamily.check.world import StubFormatter
from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.services import LocalServices
from gcfamily.methods.theory_variants import prediction_for
from gcfamily.models import load_reference
from gcfamily.theory import predictions
from gcfamily.theory.bandit import BanditLM, BanditProblem, GroupEnumeration, make_batch, sample_groups
from gcfamily.theory.steps import CurvatureStep


class BanditRunner(LocalServices):
    """The theory bench's Services (gcfamily/methods/services.py) around a bandit policy: one process, no sampling (the
    bandit draws the groups), the engine's own no-grad log-prob pass, float64 logits used as they are."""

    def __init__(self, cfg: Config, policy: BanditLM, problem: BanditProblem) -> None:
        self.cfg, self.bandit, self.task = cfg, policy, problem
        self.device = torch.device("cpu")
        self.tokenizer = None
        self.formatter = StubFormatter()  # the bandit's prompts are token ids of its own: setup only counts the rows

    def policy(self) -> BanditLM:
        return self.bandit

    def logprobs(self, model: torch.nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """The run's no-grad log-prob pass (pi_old, pi_ref), micro-batched as the settings say."""
        cfg = self.cfg
        return engine.batch_logprobs(
            model, batch, temperature, cfg.micro_batch_size, cfg.chunk_size, cfg.share_prefix, self.device
        )

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: Any) -> Any:
        raise NotImplementedError("the bandit draws its groups itself (theory.bandit.sample_groups)")

    def reference(self) -> torch.nn.Module:
        """A frozen copy of the policy as it is now (GRPO's pi_ref)."""
        return load_reference(self.bandit)


DEFAULT_STD = "sample"  # GRPO's default std setting; trained and predicted policies use the same one


def bandit_config(method: str, G: int, beta: float, std: str = DEFAULT_STD, **settings: Any) -> Config:
    """Settings for a method on a bandit: one-token completions, the whole batch in one pass."""
    if int(G) != G or G < 2:
        raise GcfError(f"group size G={G} must be an integer >= 2.")
    if not beta > 0:
        raise GcfError(f"beta={beta} must be > 0 (the stationary policy needs a KL term).")
    if std not in ("population", "sample"):
        raise GcfError(f"std={std!r} is unknown; use population or sample.")
    cfg = Config(
        method=method,
        task=None,
        group_size=int(G),
        beta=float(beta),
        std=std,
        max_new_tokens=1,
        micro_batch_size=1 << 30,
        chunk_size=1 << 30,
        progress=False,
        **settings,
    )
    get_method(method).validate(cfg)  # fills method defaults (Dr. GRPO's norm_constant = max_new_tokens = 1)
    return cfg


def build_method(
    cfg: Config, problem: BanditProblem, logits: Optional[np.ndarray] = None
) -> tuple[Method, BanditRunner]:
    """The method class of cfg.method, set up on a bandit policy at pi_ref, then moved to `logits`.

    Setup runs at pi_ref because that is where a method takes its reference from (GRPO copies
    the policy it is set up with).
    """
    runner = BanditRunner(cfg, problem.policy(), problem)
    method = get_method(cfg.method)(cfg)
    method.setup(runner)
    if logits is not None:
        with torch.no_grad():
            runner.bandit.head.weight.copy_(torch.as_tensor(np.asarray(logits, dtype=float)).t())
    return method, runner


def backward(method: Method, policy: BanditLM, batch: Batch, Z: float, weight: Optional[torch.Tensor] = None) -> float:
    """The engine's weighted backward on a prepared batch; weight [N] scales each row's coefficient."""
    out = engine.token_logprobs(
        policy,
        batch.input_ids,
        batch.attention_mask,
        batch.loss_mask,
        method.logprob_temperature(),
        method.cfg.chunk_size,
    )
    coef = method.coefficient(batch, out.logps.detach())  # [N, 2]
    if weight is not None:  # the expectation over groups: linear in the coefficient
        coef = coef * weight[:, None]
    loss = engine.weighted_loss(coef, out.logps, batch, method.norm, Z)
    loss.backward()
    return float(loss.detach())


def step_normaliser(method: Method, problem: BanditProblem) -> float:
    """Z of a sampled step with one group per prompt: exact mode's loss is its expectation."""
    G = method.cfg.group_size
    rows = make_batch(
        torch.arange(problem.P).repeat_interleave(G),
        torch.zeros(problem.P * G, dtype=torch.long),
        torch.zeros(problem.P * G),
    )
    return engine.normaliser([rows], method.norm, method.cfg.norm_constant)


def exact_gradient(method: Method, runner: BanditRunner, enum: GroupEnumeration, Z: float) -> torch.Tensor:
    """d loss / d logits [P, K] of the expected loss over groups at the current policy."""
    if method.settings.zero_std == "exclude":
        raise GcfError("exact expected gradients need zero_std=keep: excluding groups makes Z random.")
    policy = runner.bandit
    policy.zero_grad(set_to_none=True)
    batch, _ = method.prepare(enum.batch())
    backward(method, policy, batch, Z, enum.weights(policy))
    return policy.head.weight.grad.t().clone()  # [P, K]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the duration: the bandit's tensors are tiny, and on a busy
    machine waiting for intra-op threads costs far more than the work (about 10x here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class TrainResult:
    """A trained bandit policy and how it got there."""

    pi: np.ndarray  # [P, K] final policy (sampled mode: the average over the last half of the steps)
    steps: int  # steps taken
    residual: float  # exact mode: max over outputs of |expected gradient / pi| at the end, else nan
    history: list[float] = field(default_factory=list)  # residual (exact) or loss (sampled) per step


def train_bandit(
    problem: BanditProblem,
    cfg: Config,
    exact: bool = True,
    steps: int = 1000,
    lr: Optional[float] = None,
    groups_per_prompt: int = 32,
    seed: int = 0,
    tol: float = 1e-5,
) -> TrainResult:
    """Gradient ascent on the bandit's logits with the method of cfg.method, from pi_ref.

    exact: the exact expected gradient; natural-gradient steps theta += eta * grad / pi per
    prompt, eta adapted to the curvature each step (steps.CurvatureStep, which says why) unless
    lr fixes it, stopping once the residual max_o |grad_o / pi(o)| = |c(o) - E_pi c| is below
    tol: it is 0 exactly at a stationary point, where the gradient itself also vanishes at every
    vertex (the engine's float32 log-probs put its floor near 1e-6). Sampled: groups_per_prompt
    groups of G per prompt per step, SGD with lr per prompt (default 0.1/beta; the loss averages
    over the P prompts, so the SGD rate is lr * P), and the policy averaged over the second half
    of the steps (Polyak averaging).
    """
    with one_thread():
        if exact:
            return _train_exact(problem, cfg, steps, lr, tol)
        return _train_sampled(problem, cfg, steps, lr, groups_per_prompt, seed)


def _train_exact(problem: BanditProblem, cfg: Config, steps: int, lr: Optional[float], tol: float) -> TrainResult:
    method, runner = build_method(cfg, problem)
    policy, step_rule = runner.bandit, CurvatureStep(problem.P, fixed=lr)
    Z, enum = step_normaliser(method, problem), GroupEnumeration(problem, cfg.group_size)
    history: list[float] = []
    for step in range(steps):
        h = -exact_gradient(method, runner, enum, Z) * problem.P / policy.probs()  # [P, K] ascent per prompt, / pi
        history.append(float(h.abs().max()))
        if history[-1] < tol:
            return TrainResult(policy.probs().numpy(), step, history[-1], history)
        if not math.isfinite(history[-1]):
            raise GcfError(f"bandit training diverged at step {step}; pass a smaller --lr, or none to adapt it.")
        with torch.no_grad():
            policy.head.weight += step_rule(policy.logits.detach(), h).t()
    return TrainResult(policy.probs().numpy(), steps, history[-1] if history else float("nan"), history)


def _train_sampled(
    problem: BanditProblem, cfg: Config, steps: int, lr: Optional[float], groups_per_prompt: int, seed: int
) -> TrainResult:
    method, runner = build_method(cfg, problem)
    policy = runner.bandit
    lr = lr if lr is not None else 0.1 / cfg.settings.beta
    opt = torch.optim.SGD(policy.parameters(), lr=lr * problem.P)
    gen = torch.Generator().manual_seed(seed)
    history: list[float] = []
    avg, n_avg = np.zeros((problem.P, problem.K)), 0
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        batch, _ = method.prepare(sample_groups(problem, policy, groups_per_prompt, cfg.group_size, gen))
        history.append(backward(method, policy, batch, engine.normaliser([batch], method.norm, cfg.norm_constant)))
        if not math.isfinite(history[-1]):
            raise GcfError(f"bandit training diverged at step {step} (lr {lr:g}); lower the learning rate.")
        opt.step()
        if step >= steps // 2:
            avg, n_avg = avg + policy.probs().numpy(), n_avg + 1
    return TrainResult(avg / max(n_avg, 1), steps, float("nan"), history)


def predicted_policy(
    problem: BanditProblem,
    method: str,
    G: Optional[int],
    beta: float,
    std: str = DEFAULT_STD,
    variant: Optional[str] = None,
) -> np.ndarray:
    """The predicted stationary policy [P, K] of `method` (G=None: G -> infinity); variant: see prediction_for."""
    pred = prediction_for(method, variant)
    s = pred.adv_scale(G) if G is not None else 1.0
    return np.stack(
        [
            predictions.grpo_stationary(
                problem.pi_ref[q], problem.rewards[q], G, beta / s, std, problem.bernoulli, pred.variant
            ).pi
            for q in range(problem.P)
        ]
    )


def predicted_gradient(
    problem: BanditProblem,
    method: str,
    logits: np.ndarray,
    G: int,
    beta: float,
    std: str = DEFAULT_STD,
    variant: Optional[str] = None,
) -> np.ndarray:
    """predictions.expected_gradient [P, K] (ascent, per prompt) for `method` at the given logits."""
    pred = prediction_for(method, variant)
    s = pred.adv_scale(G)
    return np.stack(
        [
            s
            * predictions.expected_gradient(
                logits[q], problem.pi_ref[q], problem.rewards[q], G, beta / s, std, problem.bernoulli, pred.variant
            )
            for q in range(problem.P)
        ]
    )
