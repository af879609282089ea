"""The central invariant, for every registered method: the engine's gradient is the textbook one.

For each name in the method table (built-in and variants) and a few settings, on random inputs:

(a) grad of engine.weighted_loss(coef, logps, ...) w.r.t. a log-prob leaf equals autograd of
    -method.objective(batch, logps, Z), the method's textbook objective;
(b) on logits [B, L, V] with logps = log_softmax(logits)[target], d loss / d logits equals the
    closed form -(w * GC / Z) * (onehot(target) - softmax) on every token.

A random batch comes from a builder keyed by the method's family (SFT, preference pairs,
on-policy groups, PPO). A method that matches no builder, or whose `objective` is not written,
fails here with a message saying what to add, so every rule registered later is checked. A
method that trains no policy (trains_policy = False) must give GC = 0.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import dataclasses

import torch
from torch import nn

from gcfamily import engine
from gcfamily.config import FIELDS, Config
from gcfamily.methods import METHODS, get_method
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.sft import SFT

B_GROUPS, G, L, V = 3, 4, 7, 5  # on-policy: 3 prompts x 4 samples; sequences of 7 tokens, vocabulary 5


def _masks(B: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """attention and loss masks [B, L]: a prompt of 1-2 tokens, a completion of >= 2, right padding."""
    start = torch.randint(1, 3, (B, 1), generator=gen)
    end = torch.randint(4, L + 1, (B, 1), generator=gen)
    pos = torch.arange(L)[None]
    return (pos < end).long(), ((pos >= start) & (pos < end)).long()


def _rows(B: int, gen: torch.Generator) -> Batch:
    attention_mask, loss_mask = _masks(B, gen)
    return {"input_ids": torch.randint(0, V, (B, L), generator=gen), "attention_mask": attention_mask, "loss_mask": loss_mask}


# ----------------------------------------------------------------------------- batch builders
# builder(cls, settings, logps_fn, gen) -> (method, prepared batch); logps_fn(B) gives the
# current log-probs [B, L] (masked), around which old/ref log-probs are drawn.


def sft_builder(cls: type[Method], settings: dict, logps_fn: Callable, gen: torch.Generator) -> tuple[Method, Batch]:
    return _make(cls, settings), _rows(2 * B_GROUPS, gen)


def dpo_builder(cls: type[Method], settings: dict, logps_fn: Callable, gen: torch.Generator) -> tuple[Method, Batch]:
    B = 2 * B_GROUPS  # pairs: chosen at 2i, rejected at 2i+1
    batch = _rows(B, gen)
    batch["example_weight"] = torch.full((B,), 0.5)
    batch["ref_logps"] = (logps_fn(batch) + 0.5 * torch.randn(B, L, generator=gen, dtype=torch.float64)) * batch["loss_mask"]
    return _make(cls, {"beta": 0.1, **settings}), batch


class _StubTask:
    """The task interface an on-policy setup reads; the builder makes the samples itself."""

    def rows(self, split: str) -> list[dict]:
        return [{"prompt": "p"}]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [0.0] * len(prompts)


class _StubTrainer:
    """What an on-policy method's setup and prepare read from the Trainer. Its no-grad log-probs
    are the current ones plus noise: 0.3 for pi_old (so both clip sides trigger), 0.8 for pi_ref."""

    def __init__(self, cfg: Config, logps_fn: Callable, gen: torch.Generator) -> None:
        self.cfg, self.task, self.tokenizer, self.device = cfg, _StubTask(), None, torch.device("cpu")
        self.policy = nn.Linear(1, 1)
        self.logps_fn, self.gen = logps_fn, gen

    def unwrapped_policy(self) -> nn.Module:
        return self.policy

    def reference(self) -> nn.Module:
        return nn.Linear(1, 1)  # any other model: logprobs gives it pi_ref's noise

    def logprobs(self, model: nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        noise = 0.3 if model is self.policy else 0.8
        lp = self.logps_fn(batch) + noise * torch.randn(batch["input_ids"].shape, generator=self.gen, dtype=torch.float64)
        if model is not self.policy:  # one token far from the reference: past GRPO's clamp of |log rho|
            b, t = batch["loss_mask"].nonzero()[0]
            lp[b, t] -= 25.0
        return lp * batch["loss_mask"]


def _scored_samples(gen: torch.Generator) -> Batch:
    """B_GROUPS groups of G scored samples: a mixed group, a zero-std group, a failed reward."""
    N = B_GROUPS * G
    batch = _rows(N, gen)
    rewards = torch.randint(0, 4, (N,), generator=gen).float() / 3  # in {0, 1/3, 2/3, 1}
    rewards[G : 2 * G] = 0.5  # a zero-std group
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # a mixed group: positive and negative advantages
    valid = torch.ones(N, dtype=torch.bool)
    valid[2 * G + 1] = False  # a failed reward
    batch.update(rewards=rewards, valid=valid, prompt_index=torch.arange(N) // G)
    return batch


def onpolicy_builder(cls: type[Method], settings: dict, logps_fn: Callable, gen: torch.Generator) -> tuple[Method, Batch]:
    m = _make(cls, {"group_size": G, **settings})
    m.setup(_StubTrainer(m.cfg, logps_fn, gen))  # type: ignore[arg-type]
    return m, m.prepare(_scored_samples(gen))


def ppo_builder(cls: type[Method], settings: dict, logps_fn: Callable, gen: torch.Generator) -> tuple[Method, Batch]:
    """PPO's prepare needs its critic; random per-token advantages stand in for GAE's (the identity
    GC = dJ/dlogp holds for any advantages), with pi_old and pi_ref as the stub trainer draws them."""
    m = _make(cls, {"group_size": G, **settings})
    batch = _scored_samples(gen)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=gen) * batch["loss_mask"]  # [N, L]
    stub = _StubTrainer(m.cfg, logps_fn, gen)
    if m.inner_epochs() > 1:
        batch["old_logps"] = stub.logprobs(stub.policy, batch)
    if m.cfg.beta > 0:
        batch["ref_logps"] = stub.logprobs(nn.Identity(), batch)
    return m, batch


# family (a class name in the method's MRO, nearest first) -> builder and the settings each
# method of the family is checked under
BUILDERS: dict[str, tuple[Callable, list[dict]]] = {
    "SFT": (sft_builder, [{}, {"loss_norm": "sequence"}]),
    "DPO": (dpo_builder, [{}, {"beta": 0.5, "label_smoothing": 0.1, "simpo_gamma": 1.0}]),
    "PPO": (ppo_builder, [{"beta": 0.04}, {"mu": 2, "beta": 0.1, "loss_norm": "sequence"}, {"mu": 2, "kl_placement": "reward"}]),
    "OnPolicy": (onpolicy_builder, [{"beta": 0.04}, {"mu": 2, "beta": 0.1, "std": "population", "zero_std": "exclude"},
                                    {"mu": 2, "beta": 0.0, "loss_norm": "token"},
                                    # the KL and normalisation matrix: every estimator, placement, clamp and scale
                                    {"mu": 2, "beta": 0.1, "kl_estimator": "k1", "scale_rewards": "batch", "std_eps": 1e-4},
                                    {"mu": 2, "beta": 0.1, "kl_estimator": "k2", "kl_clamp": None, "scale_rewards": "none"},
                                    {"mu": 2, "beta": 0.1, "kl_estimator": "k3-importance-weighted", "kl_clamp": 0.5},
                                    {"mu": 2, "beta": 0.1, "kl_placement": "reward", "kl_estimator": "k1"}]),
}


def _make(cls: type[Method], settings: dict) -> Method:
    """The method with the family's settings that are its own or shared (a family's list spans its members' settings)."""
    own = {f.name for f in dataclasses.fields(cls.Settings)}
    cfg = Config(method=cls.name, **{k: v for k, v in settings.items() if k in own or k in FIELDS})
    cls.validate(cfg)
    return cls(cfg)


def _family(cls: type[Method]) -> str | None:
    return next((b.__name__ for b in cls.__mro__ if b.__name__ in BUILDERS), None)


def _builder(name: str, cls: type[Method]) -> tuple[Callable, list[dict]]:
    family = _family(cls)
    if family is not None:
        return BUILDERS[family]
    pytest.fail(f"method '{name}' ({cls.__name__}) matches no batch builder in tests/test_exactness.py; "
                f"add one for its family to BUILDERS so that its gradient is checked.")


# ----------------------------------------------------------------------------- the two checks


def check_exactness(name: str, cls: type[Method], settings: dict, seed: int) -> None:
    """(a) engine gradient == autograd of the textbook objective; (b) the closed form on logits."""
    if not getattr(cls, "trains_policy", True):  # e.g. the reward model: it must leave the policy alone
        return check_trains_no_policy(name, cls)
    build, _ = _builder(name, cls)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * B_GROUPS * G, L, V, generator=gen, dtype=torch.float64)  # enough rows for any builder

    def logps_of(logits_: torch.Tensor, batch: Batch) -> torch.Tensor:
        B = batch["input_ids"].shape[0]
        lp = torch.log_softmax(logits_[:B], -1).gather(-1, batch["input_ids"][:, :, None]).squeeze(-1)  # [B, L]
        return lp * batch["loss_mask"]

    try:
        m, batch = build(cls, settings, lambda b: logps_of(logits, b).detach(), gen)
    except Exception as e:  # a family member whose setup or prepare needs more than the builder gives
        pytest.fail(f"the batch builder for '{name}' could not set it up ({type(e).__name__}: {e}); give its family a builder in tests/test_exactness.py.")
    Z = engine.normaliser([batch], m.norm, m.cfg.norm_constant)
    base = logps_of(logits, batch).detach()  # [B, L] the current policy's log-probs

    # (a) against autograd of the textbook objective
    lp = base.clone().requires_grad_(True)
    try:
        J = m.objective(batch, lp, Z)
    except NotImplementedError:
        pytest.fail(f"method '{name}' has no textbook objective: write {cls.__name__}.objective(batch, logps, Z) "
                    "(J to maximise, with the method's aggregation) so that its coefficient can be checked against autograd.")
    (want,) = torch.autograd.grad(-J, lp)
    lp = base.clone().requires_grad_(True)
    coef = m.coefficient(batch, lp.detach())  # [B, L]
    (got,) = torch.autograd.grad(engine.weighted_loss(coef, lp, batch, m.norm, Z), lp)
    scale = float(want.abs().max())
    assert scale > 0, f"{name} {settings}: the objective's gradient is identically zero on this batch"
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7 * scale), (
        f"{name} {settings}: engine gradient != autograd of the objective; max |diff| {float((got - want).abs().max()):.3g}")

    # (b) d loss / d logits == -(w * GC / Z) * (onehot - softmax), token by token
    B = batch["input_ids"].shape[0]
    x = logits[:B].clone().requires_grad_(True)
    lp = logps_of(x, batch)
    coef = m.coefficient(batch, lp.detach())
    (g_logits,) = torch.autograd.grad(engine.weighted_loss(coef, lp, batch, m.norm, Z), x)
    w = engine.token_weights(batch, m.norm)  # [B, L]
    onehot = nn.functional.one_hot(batch["input_ids"], V).to(x.dtype)
    closed = -(w * coef / Z)[..., None] * (onehot - torch.softmax(x.detach(), -1))  # [B, L, V]
    assert torch.allclose(g_logits, closed, rtol=1e-6, atol=1e-9 * float(closed.abs().max())), (
        f"{name} {settings}: d loss / d logits differs from GC * (onehot - softmax)")


def check_trains_no_policy(name: str, cls: type[Method]) -> None:
    """A method that trains only a model of its own: GC = 0 and an objective constant in the policy."""
    gen = torch.Generator().manual_seed(0)
    batch = _rows(2 * B_GROUPS, gen)
    m = _make(cls, {})
    lp = (-torch.rand(batch["input_ids"].shape, generator=gen, dtype=torch.float64) * batch["loss_mask"]).requires_grad_(True)
    assert (m.coefficient(batch, lp.detach()) == 0).all(), f"{name} trains no policy but gives it a coefficient"
    (g,) = torch.autograd.grad(m.objective(batch, lp, 1.0), lp, allow_unused=True)
    assert g is None or (g == 0).all(), f"{name} trains no policy but its objective depends on the policy"


def _cases() -> list[Any]:
    cases = []
    for name in METHODS:
        cls = get_method(name)
        family = _family(cls)
        settings_list = BUILDERS[family][1] if family and getattr(cls, "trains_policy", True) else [{}]
        cases += [pytest.param(name, s, id=f"{name}-{i}") for i, s in enumerate(settings_list)]
    return cases


@pytest.mark.parametrize("name, settings", _cases())
def test_engine_gradient_is_the_textbook_gradient(name: str, settings: dict) -> None:
    cls = get_method(name)
    for seed in (0, 1):
        check_exactness(name, cls, settings, seed)


def test_every_method_in_gcf_methods_is_covered() -> None:
    covered = {c.values[0] for c in _cases()}
    assert covered == set(METHODS)


# ----------------------------------------------------------------------------- the suite's own guard


class _NoObjective(SFT):
    name = "no-objective"
    objective = Method.objective  # type: ignore[assignment]


class _NoFamily(Method):
    name = "no-family"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(logps)


class _WrongCoefficient(SFT):
    name = "wrong"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return 2 * torch.ones_like(logps)  # the objective is SFT's, whose GC is 1


@pytest.mark.parametrize("cls, message", [(_NoObjective, "no textbook objective"), (_NoFamily, "no batch builder"),
                                          (_WrongCoefficient, "autograd of the objective")])
def test_a_method_that_cannot_be_checked_fails(cls: type[Method], message: str) -> None:
    with pytest.raises((pytest.fail.Exception, AssertionError), match=message):
        check_exactness(cls.name, cls, {}, 0)
