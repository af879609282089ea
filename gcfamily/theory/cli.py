"""`gcf theory`: train bandit policies with a real method and compare them with the predictions.

One binary question per --p-ref (output a is correct, b is not), trained from pi_ref with the
method class through the engine; the table gives the trained and predicted stationary
probabilities of every output, and a PNG plots pi(a) against pi_ref(a) for several beta: the
predicted curves for G in {2, 4, 8, infinity}, logarithmic pooling, and the trained points.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import click
import numpy as np

from gcfamily.errors import GcfError

CURVE_G = (2, 4, 8, None)  # None: G -> infinity


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GcfError(f"--{name} must be numbers separated by commas (got {text!r}).") from None


@click.command()
@click.option(
    "--method",
    default=None,
    help="grpo, a variant (grpo-shift, grpo-direct-kl, grpo-shift-direct-kl), dapo, dr-grpo, rloo, "
    "or a GRPO subclass of your own (module:Class or path/to/file.py:Class, with --variant).  [default: grpo]",
)
@click.option(
    "--variant",
    type=click.Choice(["grpo", "direct_kl", "shift_only", "shift_only_direct_kl"]),
    default=None,
    help="The prediction variant; picks its method when --method is not given, and is the prediction a "
    "method of your own is compared with.",
)
@click.option("--group-size", "-G", "G", type=int, default=4, show_default=True, help="Group size G.")
@click.option("--beta", type=float, default=0.2, show_default=True, help="KL weight.")
@click.option(
    "--std",
    type=click.Choice(["population", "sample"]),
    default="sample",
    show_default=True,
    help="Group std of the advantage: sample is GRPO's default, population the paper's (the sample std is the "
    "paper's model at beta * sqrt(G/(G-1))); trained and predicted policies use the same one.",
)
@click.option("--exact/--sampled", default=True, show_default=True, help="Exact expected gradients, or sampled groups.")
@click.option("--steps", type=int, default=1000, show_default=True, help="Most steps (exact: stops when converged).")
@click.option(
    "--lr",
    type=float,
    default=None,
    help="Exact: a fixed natural-gradient step size (default: adapted to the curvature each step). "
    "Sampled: the SGD step per prompt (default: 0.1/beta).",
)
@click.option("--groups", type=int, default=64, show_default=True, help="Sampled groups per prompt per step.")
@click.option(
    "--p-ref",
    "p_ref",
    default="0.1,0.3,0.5,0.7,0.9",
    show_default=True,
    help="pi_ref(correct answer), one question each.",
)
@click.option("--rewards", default="1,0", show_default=True, help="Rewards of the correct and the wrong answer.")
@click.option("--bernoulli", is_flag=True, help="The rewards are success probabilities of a 0/1 reward.")
@click.option(
    "--plot-betas",
    default="0.1,0.5,1.0",
    show_default=True,
    help="More beta panels for the plot (--beta is always one).",
)
@click.option("--out", "out_dir", default="runs/theory", show_default=True, help="Folder for the PNG.")
@click.option("--seed", type=int, default=0, show_default=True)
def theory(
    method: Optional[str],
    variant: Optional[str],
    G: int,
    beta: float,
    std: str,
    exact: bool,
    steps: int,
    lr: Optional[float],
    groups: int,
    p_ref: str,
    rewards: str,
    bernoulli: bool,
    plot_betas: str,
    out_dir: str,
    seed: int,
) -> None:
    """Train bandit policies with a method and compare them with the predicted stationary policies."""
    from gcfamily.methods import method_label
    from gcfamily.methods.theory_variants import VARIANT_METHODS, prediction_for
    from gcfamily.theory.bandit import BanditProblem
    from gcfamily.theory.train import bandit_config, predicted_policy, train_bandit

    method = method or VARIANT_METHODS[variant or "grpo"]
    pred = prediction_for(method, variant)  # a method of your own is compared with --variant's prediction
    r = _floats(rewards, "rewards")
    if len(r) != 2:
        raise GcfError(f"--rewards needs two values, for the correct and the wrong answer (got {rewards!r}).")
    if r[0] <= r[1]:
        raise GcfError(f"--rewards: the correct answer must have the larger reward (got {rewards!r}).")
    if groups < 1 or steps < 1:
        raise GcfError("--groups and --steps must be >= 1.")
    problem = BanditProblem.binary(_floats(p_ref, "p-ref"), r, bernoulli)
    betas = sorted({beta, *_floats(plot_betas, "plot-betas")})
    bandit_config(method, G, beta, std)  # checks G, beta and std before any work
    if any(b <= 0 for b in betas):
        raise GcfError(f"--plot-betas must all be > 0 (got {plot_betas!r}).")
    mode = "exact expected gradients" if exact else f"{groups} sampled groups per prompt per step"
    click.echo(
        f"{method} (prediction: {pred.variant}, std {std}), G={G}, {mode}, rewards a={r[0]:g} b={r[1]:g}"
        f"{' (Bernoulli)' if bernoulli else ''}"
    )

    t0 = time.time()
    trained: dict[float, np.ndarray] = {}
    for b in betas:
        res = train_bandit(problem, bandit_config(method, G, b, std), exact, steps, lr, groups, seed)
        trained[b] = res.pi
        if b == beta:
            main_res = res
    want = predicted_policy(problem, method, G, beta, std, variant)
    got = trained[beta]
    status = (
        (
            f"converged: max |expected gradient / pi| {main_res.residual:.1e}"
            if main_res.steps < steps
            else f"NOT converged: max |expected gradient / pi| {main_res.residual:.1e} (raise --steps; with --lr, lower it)"
        )
        if exact
        else "policy averaged over the second half"
    )
    click.echo(f"beta={beta:g}: {main_res.steps} steps, {status}\n")
    click.echo(f"{'prompt':<7}{'output':<8}{'pi_ref':>8}{'trained':>11}{'predicted':>11}{'difference':>12}")
    for q in range(problem.P):
        for o, name in enumerate(("a", "b")):
            click.echo(
                f"q{q:<6}{name:<8}{problem.pi_ref[q, o]:>8.4f}{got[q, o]:>11.6f}{want[q, o]:>11.6f}{got[q, o] - want[q, o]:>+12.2e}"
            )
    diff = np.abs(got - want)
    q, o = np.unravel_index(int(np.argmax(diff)), diff.shape)
    click.echo(f"\nlargest difference: {diff.max():.2e} (q{q}, output {'ab'[o]}, pi_ref(a)={problem.pi_ref[q, 0]:g})")
    for b in betas:
        if b != beta:
            d = np.abs(trained[b] - predicted_policy(problem, method, G, b, std, variant)).max()
            click.echo(f"beta={b:g}: largest difference {d:.2e}")
    path = Path(out_dir) / f"theory-{method_label(method)}-G{G}-beta{beta:g}-{std}.png"
    plot(path, problem, method, G, std, betas, trained, variant)
    click.echo(f"plot: {path}  ({time.time() - t0:.1f} s)")


def _curve(
    p_grid: np.ndarray,
    rewards: np.ndarray,
    bernoulli: bool,
    method: str,
    G: Optional[int],
    beta: float,
    std: str,
    variant: Optional[str] = None,
) -> np.ndarray:
    """Predicted stationary pi(a) over a grid of pi_ref(a); NaN where no stationary point is found."""
    from gcfamily.methods.theory_variants import prediction_for
    from gcfamily.theory import predictions

    pred = prediction_for(method, variant)
    s = pred.adv_scale(G) if G is not None else 1.0
    out = np.full(len(p_grid), np.nan)
    for i, p in enumerate(p_grid):
        try:  # direct KL can flow to a vertex (no finite stationary logits); leave a gap there
            out[i] = predictions.grpo_stationary(
                np.array([p, 1 - p]), rewards, G, beta / s, std, bernoulli, pred.variant, max_steps=80
            ).pi[0]
        except RuntimeError:
            pass
    return out


def plot(
    path: Path,
    problem,
    method: str,
    G: int,
    std: str,
    betas: list[float],  # type: ignore[no-untyped-def]
    trained: dict[float, np.ndarray],
    variant: Optional[str] = None,
) -> None:
    """pi(a) against pi_ref(a), one panel per beta: predicted curves, log pooling, trained points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gcfamily.theory import predictions

    rewards, bern = problem.rewards[0], problem.bernoulli
    p_grid = np.linspace(0.01, 0.99, 40)
    fig, axes = plt.subplots(1, len(betas), figsize=(4 * len(betas), 4), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], betas):
        for g in CURVE_G:
            ax.plot(p_grid, _curve(p_grid, rewards, bern, method, g, b, std, variant), label=f"G={g or chr(8734)}")
        r_mean = rewards  # expected rewards: for Bernoulli the success probabilities
        pool = [predictions.log_pooling(np.array([p, 1 - p]), r_mean, b)[0] for p in p_grid]
        ax.plot(p_grid, pool, "k--", label="log pooling (RLHF)")
        ax.plot(p_grid, p_grid, ":", color="grey", lw=0.8)
        ax.plot(problem.pi_ref[:, 0], trained[b][:, 0], "o", color="black", mfc="none", label=f"trained, G={G}")
        ax.set_title(f"beta = {b:g}")
        ax.set_xlabel("pi_ref(correct)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("stationary pi(correct)")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{method}, std {std}: stationary probability of the correct answer", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
