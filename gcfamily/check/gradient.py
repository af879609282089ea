"""Checks (a) and (b) of a method's gradient on one settings case (the package docstring says what each compares), and
the check of a method that trains no policy."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gcfamily.check.families import EPISODES, RANKS, family_of, own_rule, textbook_choices, textbook_for, unsupported
from gcfamily.check.outcome import Outcome, _diff, _nonfinite, _worse
from gcfamily.check.second import SecondCheck, policyless_check
from gcfamily.check.world import TOL_A, TOL_B, G, N, V, World, make, micro_batches
from gcfamily.core import engine, logprobs
from gcfamily.core.batch import concat
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method

SOFTCAP = 2.0
"""The final-logit soft-cap of (b)'s second pass: small enough that tanh bends the check's logits."""


def _engine_logps(X: torch.Tensor, mb: Batch, tau: float, softcap: float | None = None) -> torch.Tensor:
    """The micro-batch's log-probs through the engine's chunked output layer; the hidden states are the logits
    (identity weight), so d loss / d X is d loss / d logits (with `softcap`, the pre-cap logits)."""
    mask = mb.loss_mask.bool()
    h = X[mb.row_id][mask]  # [tokens, V]
    lp, _ = logprobs._ChunkedTokenLogprob.apply(
        h, torch.eye(V, dtype=X.dtype), None, mb.input_ids[mask], float(tau), 5, False, None, softcap
    )
    return torch.zeros(mask.shape, dtype=lp.dtype).masked_scatter(mask, lp)  # [b, L]


def check_once(cls: type[Method], settings: dict, seed: int, out: Outcome, tb: dict | None) -> None:
    """Checks (a) and (b) on one seed's batch. `tb`: the textbook's choices the batch is designed for (None: none);
    the textbook's gradient is compared only where `out.textbook`, its branches are counted wherever it is known."""
    fam = family_of(cls)
    assert fam is not None
    gen = torch.Generator().manual_seed(seed)
    world = World(N, gen, episodes=settings.get(EPISODES, False))
    if settings.get(EPISODES):
        out.branches["environment tokens inside completions"] += int((world.env_mask.sum(-1) > 0).sum())
        out.required.add("environment tokens inside completions")
    ranks = settings.get(RANKS, 1)
    settings = {k: v for k, v in settings.items() if k not in (RANKS, EPISODES)}
    built = fam.build(cls, settings, world, gen, tb, seed, **({"ranks": ranks} if ranks > 1 else {}))
    m = built.method
    tau, tau_m = built.tau, m.logprob_temperature()  # the textbook's pi, and the temperature of the engine's log-probs
    if tau != 1.0:
        out.branches[f"log-probs at temperature {tau:g}"] += 1
    # each rank's micro-batches; the whole step's rows (every rank's, in rank order) for the per-token comparisons
    parts = [(m_r, micro_batches(b_r, m_r.rows_per_example)) for m_r, b_r in built.ranks()]
    mbs = [mb for _, mbs_r in parts for mb in mbs_r]
    batch = concat([mb.replaced(valid=mb.valid if mb.valid is not None else torch.ones(mb.rows)) for mb in mbs])
    ids = batch.row_id
    out.branches["micro-batches"] += len(mbs)
    out.required.add("micro-batches")
    counts = {engine.normaliser([mb], m.norm, m.cfg.norm_constant) for mb in mbs}
    out.branches["micro-batches of unequal counts"] += int(len(counts) > 1)
    out.required.add("micro-batches of unequal counts")
    if len(parts) > 1:
        out.branches["simulated ranks"] += len(parts)
        out.required.add("simulated ranks")
    # Z of the whole step: each rank's count summed, as the engine's all-reduce sums them
    Z = sum(engine.normaliser(mbs_r, m_r.norm, m_r.cfg.norm_constant) for m_r, mbs_r in parts)
    base = world.logps(tau=tau)  # [n, L] the current policy, as the textbook states it
    seen = world.logps(tau=tau_m)  # [n, L] what the engine's forward gives the method (equal unless it errs)
    # every quantity below is first tested for NaN and inf: a tolerance test is False for NaN, and one NaN
    # coefficient poisons the whole loss even on padding (NaN * 0 is NaN), so a non-finite value fails by name
    _nonfinite("the engine's normaliser Z", Z, out, seed)

    lp = seen.clone().requires_grad_(True)  # (a) the engine, micro-batch by micro-batch, rank by rank (summed)
    coefs = []
    for m_r, mbs_r in parts:
        for mb in mbs_r:
            coefs.append(m_r.coefficient(mb, lp[mb.row_id].detach()))
            engine.weighted_loss(coefs[-1], lp[mb.row_id], mb, m_r.norm, Z).backward()
    _nonfinite("the method's coefficient", torch.cat([c.detach().flatten() for c in coefs]), out, seed)
    got = lp.grad if lp.grad is not None else torch.zeros_like(base)
    _nonfinite("the engine's gradient", got, out, seed)
    lp = seen.clone().requires_grad_(True)
    try:
        J = sum(m_r.objective(b_r, lp[b_r.row_id], Z) for m_r, b_r in built.ranks())
    except NotImplementedError:
        out.errors.append(
            f"{cls.__name__} has no objective: write {cls.__name__}.objective(batch, logps, Z), J to maximise"
        )
        return
    _nonfinite("the method's objective", J, out, seed)
    own = torch.autograd.grad(-J, lp, allow_unused=True)[0]
    own = torch.zeros_like(base) if own is None else own
    _nonfinite("the gradient of the method's own objective", own, out, seed)
    _diff("(a) engine vs own objective", got, own, TOL_A, out, seed)
    want = own
    if built.textbook is not None:
        lp = base.clone().requires_grad_(True)
        t = built.textbook(lp)
        out.branches.update(t.branches)  # a rule of its own is held to the branches of its family's batch too
        out.required |= t.required
    if built.textbook is not None and out.textbook:
        _nonfinite("the textbook's objective", t.J, out, seed)
        want = torch.autograd.grad(-t.J, lp, allow_unused=True)[0]
        want = torch.zeros_like(base) if want is None else want
        _nonfinite("the textbook's gradient", want, out, seed)
        _diff("(a) engine vs textbook", got, want, TOL_A, out, seed)
        _diff("(a) own objective vs textbook", own, want, TOL_A, out, seed)

    X = world.logits.float().requires_grad_(True)  # (b) the real log-prob backward
    coefs = []
    for m_r, mbs_r in parts:
        for mb in mbs_r:
            lp_mb = _engine_logps(X, mb, tau_m)
            coefs.append(m_r.coefficient(mb, lp_mb.detach()))
            engine.weighted_loss(coefs[-1], lp_mb, mb, m_r.norm, Z).backward()
    # on float32 log-probs
    _nonfinite("the method's coefficient", torch.cat([c.detach().flatten() for c in coefs]), out, seed)
    _nonfinite("the engine's gradient d loss/d logits", X.grad, out, seed)
    w = engine.token_weights(batch, m.norm)  # [B, L]
    dJ = -want[ids]  # [B, L] the textbook's dJ/dlogp
    on = w > 0
    gc = torch.zeros_like(dJ)
    gc[on] = dJ[on] * Z / w[on]  # GC = (dJ/dlogp) / (w / Z)
    stray = float(dJ[~on].abs().max()) if (~on).any() else 0.0
    if math.isfinite(stray) and stray > 1e-12:  # a NaN or inf there is named above, with the gradient it is in
        out.errors.append(
            f"(b) the textbook's gradient is {stray:.3g} on a token the engine weighs 0 (a masked row or padding)"
        )
    onehot = F.one_hot(batch.input_ids, V).double()
    soft = torch.softmax(world.logits[ids] / tau, -1)
    closed = torch.zeros_like(world.logits).index_add_(0, ids, -(gc * w / Z)[..., None] * (onehot - soft) / tau)
    source = "textbook" if built.textbook is not None and out.textbook else "own objective"
    _diff(f"(b) d loss/d logits vs {source} GC * w/Z * (onehot - softmax)", X.grad.double(), closed, TOL_B, out, seed)
    env = world.env_mask.bool()  # multi-turn episodes: an environment's tokens are context, never actions
    if env.any():
        leak = float(X.grad[env].abs().max())
        out.diffs["(c) d loss/d logits on the environment's tokens (exactly 0)"] = (leak, 0.0)
        if leak != 0.0:
            out.errors.append(f"(c) an environment token has gradient {leak:.3g}; it is context and must carry none")
    # the same backward through a final-logit soft-cap c * tanh(z / c) (Gemma 2), against autograd of that formula
    Xc = world.logits.float().requires_grad_(True)
    Xr = world.logits.double().requires_grad_(True)
    k = 0
    for m_r, mbs_r in parts:
        for mb in mbs_r:
            c_mb, w_mb = coefs[k].detach(), engine.token_weights(mb, m_r.norm)
            k += 1
            (-(c_mb * w_mb * _engine_logps(Xc, mb, tau_m, SOFTCAP)).sum() / Z).backward()
            capped = SOFTCAP * torch.tanh(Xr[mb.row_id] / SOFTCAP) / tau_m  # [b, L, V]
            lp_ref = torch.log_softmax(capped, -1).gather(-1, mb.input_ids[..., None])[..., 0] * mb.loss_mask
            (-(c_mb.double() * w_mb * lp_ref).sum() / Z).backward()
    _diff(
        "(b) the same through a final-logit soft-cap (Gemma 2) vs autograd", Xc.grad.double(), Xr.grad, TOL_B, out, seed
    )
    coef = torch.cat([c.double() * mb.loss_mask for c, mb in zip(coefs, mbs)])
    scale = float(gc[on].abs().max()) if on.any() else 0.0
    d = float((coef - gc)[on].abs().max()) if on.any() else 0.0
    name = f"    GC: the method's vs the {source}'s (float32 log-probs)"
    old = out.diffs.get(name, (0.0, 0.0))
    out.diffs[name] = (_worse(old[0], d), _worse(old[1], scale))  # shown only: float32 log-probs; a NaN failed above
    if built.second is not None:  # the second model's loss (PPO's critic) on the same micro-batches
        _second(built.second(mbs), out, seed)


def _second(c: SecondCheck, out: Outcome, seed: int) -> None:
    out.branches.update(c.branches)
    out.required |= c.required
    if not _nonfinite(c.name, c.got, out, seed):
        _diff(c.name, c.got, c.want, TOL_A, out, seed)


def check_no_policy(cls: type[Method], out: Outcome, seeds: tuple[int, ...] = (0, 1)) -> None:
    """A method that trains only a model of its own: GC = 0 and an objective constant in the policy; and the loss of
    the model it trains where second.POLICYLESS restates it (the reward model's Bradley-Terry loss)."""
    m, world = make(cls, {}), World(N, torch.Generator().manual_seed(0))
    batch = world.rows(range(N))
    lp = world.logps().requires_grad_(True)
    coef = m.coefficient(batch, lp.detach())
    J = m.objective(batch, lp, 1.0)
    g = torch.autograd.grad(J, lp, allow_unused=True)[0]
    out.diffs["GC (trains no policy)"] = (float(coef.abs().max()), 0.0)
    out.diffs["d objective / d logp (trains no policy)"] = (0.0 if g is None else float(g.abs().max()), 0.0)
    bad = [
        _nonfinite("the method's coefficient", coef, out, 0),
        _nonfinite("the method's objective", J, out, 0),
        g is not None and _nonfinite("the gradient of the method's own objective", g, out, 0),
    ]
    if not any(bad) and ((coef != 0).any() or (g is not None and (g != 0).any())):
        out.errors.append(
            f"{cls.__name__} trains no policy but gives it a coefficient or an objective that depends on it"
        )
    own = policyless_check(cls)
    if own is not None:  # the model it does train: its loss, through its own data, steps and normaliser
        for seed in seeds:
            _second(own(cls, seed), out, seed)


def run_case(cls: type[Method], label: str, settings: dict, seeds: tuple[int, ...] = (0, 1)) -> Outcome:
    """Checks (a) and (b) of one settings case on each seed's batch; branches are counted over the seeds."""
    out = Outcome(label, settings)
    if not cls.trains_policy:
        check_no_policy(cls, out, seeds)
        return out
    if family_of(cls) is None:
        raise GcfError(unsupported(cls))
    tb, _ = textbook_for(cls)
    out.textbook = tb is not None
    # a rule of its own: the batch its family's textbook designs
    design = tb if tb is not None else textbook_choices(cls)[0]
    kind, why = own_rule(cls)
    out.rule = why if kind in ("coefficient", "objective") else ""
    try:
        make(cls, {"group_size": G, **{k: v for k, v in settings.items() if k not in (RANKS, EPISODES)}})
    except GcfError as e:
        out.refused = str(e)
        return out
    for seed in seeds:
        try:
            check_once(cls, settings, seed, out, design)
        except GcfError:
            raise
        except Exception as e:  # the method's own code raised on the check's batch
            out.errors.append(f"seed {seed}: {type(e).__name__}: {e}")
            break
    return out
