"""Loss parity with OpenRLHF 0.11.2: every loss option of its PPO and DPO scripts, mapped to gcfamily and checked against
OpenRLHF's own functions.

    python3 -m venv /tmp/orl-venv
    /tmp/orl-venv/bin/pip install torch==2.13.0               # the CPU build (an unpinned torch pulls CUDA wheels)
    /tmp/orl-venv/bin/pip install --no-deps openrlhf==0.11.2  # nothing else: ray, deepspeed, vllm, transformers stubbed
    PYTHONPATH=.:.venv/lib/python3.11/site-packages /tmp/orl-venv/bin/python benchmarks/openrlhf_parity.py
    .venv/bin/python benchmarks/openrlhf_parity.py --markdown  # docs/openrlhf-mapping.md's table, no OpenRLHF needed

The fourth line runs the check venv's python with the project venv's site-packages first on the path: gcfamily's
dependencies (transformers, einops) and the same torch 2.13.0 come from the project venv, and only `openrlhf` from the
check venv (the project venv never holds it; gcfamily never imports it). Without OpenRLHF the script says so and
exits 0.

What runs on OpenRLHF's side is its real code, loaded from its files without its package `__init__`s (which pull in
transformers, DeepSpeed and Ray): `openrlhf/models/loss.py` (PolicyLoss, aggregate_loss, DPOLoss),
`openrlhf/models/utils.py` (compute_approx_kl, compute_reward), `openrlhf/utils/loss_utils.py`
(iter_grad_accum_global_norm: the step's token and sample counts) and
`RemoteExperienceMaker.compute_advantages_and_returns` of `openrlhf/trainer/ppo_utils/experience_maker.py` (the
advantage estimators), called on an object made with object.__new__ that holds the arguments it reads. The modules
`deepspeed`, `ray`, `openrlhf.trainer.ray.launcher` and `openrlhf.utils.utils` are tiny fakes (`_stub_openrlhf`): the
functions above never call them. The actor's step (`PolicyModelActor.training_step` in
`openrlhf/trainer/ray/ppo_actor.py`: policy loss + kl_ctl * token-mean KL loss) is restated in `orl_policy`, five
lines, because that method needs a DeepSpeed model and strategy.

gcfamily's side: the real method class, built from the row's `--set` string as `gcf run` builds it, then `prepare`,
`engine.normaliser`, `coefficient`, `engine.weighted_loss` and its backward (benchmarks/trl_parity.py's `build_method`
and `_step`). Compared, in float64 and in float32: the loss (OpenRLHF's against minus gcfamily's textbook `objective`)
and the gradient with respect to the current log-probs (OpenRLHF's autograd against the engine's one loss). A row
matches when both differ by at most TOL (float64) or TOL32 (float32); a control row (expect "differ") must differ by at
least CONTROL_MIN in both, so the check is shown able to tell the settings apart.

Every option of OpenRLHF's argument parsers that can change a loss or an advantage (`SCOPE`, read from the source of
openrlhf/cli/train_ppo_ray.py and train_dpo.py with `ast`, each choice of a `choices=` flag on its own) must be a key
(or the start of one) of OPTIONS; the run fails on one that is not, and on a parser flag whose name looks like a loss
option but is in neither SCOPE nor NOT_LOSS. To check a row that is "not expressible" today, give its entry a gcfamily
spelling (`gcf`) and OpenRLHF settings (`orl`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import math
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

TOL, TOL32, CONTROL_MIN = 1e-6, 2e-5, 1e-4
N_PROMPTS, G, P, T = 4, 4, 3, 8  # 4 prompts x 4 samples, prompt 3 tokens, completions <= 8
SQRT20 = math.sqrt(20.0)  # |log(pi/pi_ref)| past which OpenRLHF's k2 (= lr^2 / 2) is clamped to 10


@dataclass(frozen=True)
class Entry:
    """One OpenRLHF option (or combination) and gcfamily's spelling of it."""

    gcf: Optional[str]
    """`--method M --set k=v ...` for gcfamily, or None: not expressible."""
    note: str = ""
    """Why it is not expressible, or what the spelling assumes."""
    orl: dict = field(default_factory=dict)
    """OpenRLHF's settings of the checked row (the arguments of PolicyLoss, the estimator, the KL; see `orl_policy`)."""
    kind: str = "ppo"
    """ppo: PolicyLoss + advantages + KL loss; dpo: DPOLoss."""
    case: str = "far"
    """far: the reference has tokens past every KL clamp; near: none past OpenRLHF's k3 value clamp."""
    expect: str = "match"
    """match; differs (gcfamily's closest spelling, known to differ: the note says how); or differ (a control: a
    near-miss a user might take for OpenRLHF's setting). Both kinds of difference must be at least CONTROL_MIN."""
    compared: bool = True
    """False: a spelling only, not a row of its own (a count, a part of the checked rows, or, as the note says, a loss
    this harness does not compare)."""

    @property
    def status(self) -> str:
        """The static status: checked (the harness decides exact or differs), not compared, or not expressible."""
        if self.gcf is None:
            return "not expressible"
        if not self.compared:
            return "spelling only"
        return {"differ": "control (must differ)", "differs": "checked: differs"}.get(self.expect, "checked")


def _ppo(**kw: Any) -> dict:
    """OpenRLHF's defaults of the checked PPO rows, with mu = 2 (pi_old != pi) and the KL off."""
    return {
        "estimator": "group_norm",
        "gamma": 1.0,
        "lambd": 1.0,
        "eps": (0.2, 0.2),
        "dual_clip": None,
        "agg": "token-mean",
        "policy_loss_type": "ppo",
        "is_level": "off",
        "is_mode": "mask",
        "is_gating": "ratio",
        "is_threshold": (0.5, 5.0),
        "use_kl_loss": False,
        "kl_coef": 0.0,
        "kl_estimator": "k1",
        "unbiased_gradient": False,
        **kw,
    }


BASE = "--method grpo --set mu=2 std_eps=1e-9 loss_norm=token"  # group_norm, token-mean
GN = BASE + " beta=0"
KL = "--algo.kl.use_loss --algo.kl.init_coef 0.05"
OPTIONS: dict[str, Entry] = {
    # -- advantage estimators (experience_maker.py, compute_advantages_and_returns), token-mean, no KL
    "--algo.advantage.estimator group_norm": Entry(GN, "(R - mean) / (sample std + 1e-9) over the group", _ppo()),
    "--algo.advantage.estimator rloo": Entry(
        "--method rloo --set mu=2 beta=0 loss_norm=token", "R - mean of the other samples", _ppo(estimator="rloo")
    ),
    "--algo.advantage.estimator dr_grpo": Entry(
        "--method grpo-shift --set mu=2 beta=0 loss_norm=token",
        "R - group mean; OpenRLHF keeps its token-mean aggregation (gcfamily's dr-grpo divides by a constant)",
        _ppo(estimator="dr_grpo"),
    ),
    "--algo.advantage.estimator reinforce_baseline": Entry(
        "--method reinforce-pp-baseline --set mu=2 beta=0 loss_norm=token std=population",
        "R - group mean, then centred and divided by the population std over every action token of the batch (floored "
        "at 1e-8), as gamma = 1 makes every token's return R",
        _ppo(estimator="reinforce_baseline"),
    ),
    "--algo.advantage.estimator reinforce": Entry(
        "--method reinforce-pp --set mu=2 beta=0 loss_norm=token std=population",
        "the return R on every token (gamma = 1, no KL in the reward) whitened over the batch's action tokens; with "
        "gamma < 1 or the KL in the reward the returns differ per token, which reinforce-pp does not build",
        _ppo(estimator="reinforce"),
    ),
    "--algo.advantage.estimator flash_reinforce": Entry(
        None, "R - the mean of this rollout batch; gcfamily's reinforce-baseline subtracts a mean of past steps"
    ),
    "--algo.advantage.estimator gae": Entry(
        "--method ppo --set mu=2 beta=0 loss_norm=token gamma=1 lam=0.95",
        "GAE on the same critic values, then whitened over the batch's tokens: OpenRLHF divides by the population "
        "std (rsqrt of the variance clamped at 1e-8), gcfamily's PPO by the sample std + 1e-8, so A_t differs by a "
        "factor sqrt((n-1)/n)",
        _ppo(estimator="gae", lambd=0.95),
        expect="differs",
    ),
    "--algo.advantage.gamma": Entry(
        "--method ppo --set gamma=...", "GAE (above); 1 for the group estimators", compared=False
    ),
    "--algo.advantage.lambd": Entry("--method ppo --set lam=...", "GAE only (above)", compared=False),
    "--algo.advantage.no_std_norm": Entry(
        "--method reinforce-pp-baseline --set mu=2 beta=0 loss_norm=token whiten=false",
        "reinforce and reinforce_baseline: centred over the tokens, not divided (checked on reinforce_baseline); gae: "
        "gcfamily's PPO whitens or not (whiten), never centres only",
        _ppo(estimator="reinforce_baseline", no_std_norm=True),
    ),
    # -- the clipped surrogate (PolicyLoss)
    "--actor.eps_clip": Entry(GN + " epsilon=0.2", "symmetric clip", _ppo()),
    "--actor.eps_clip_low_high": Entry(
        "--method grpo --set mu=2 beta=0 std_eps=1e-9 loss_norm=token epsilon=0.1 epsilon_high=0.3",
        "",
        _ppo(eps=(0.1, 0.3)),
    ),
    "--actor.dual_clip": Entry(
        GN + " dual_clip=3",
        "dual-clip PPO: a negative-advantage token's loss capped at dual_clip * |A|, no gradient past it",
        _ppo(dual_clip=3.0),
    ),
    "--actor.loss_agg_mode token-mean": Entry(GN, "one mean over the step's tokens", _ppo()),
    "--actor.loss_agg_mode seq-mean-token-mean": Entry(
        "--method grpo --set mu=2 beta=0 std_eps=1e-9 loss_norm=sequence",
        "each sequence's token mean, then the mean over sequences",
        _ppo(agg="seq-mean-token-mean"),
    ),
    "--actor.policy_loss_type ppo": Entry(
        GN, "a ratio per token (log-ratio clamped to +-20: never reached here)", _ppo()
    ),
    "--actor.policy_loss_type gspo": Entry(
        "--method gspo --set mu=2 beta=0 std_eps=1e-9 epsilon=0.2 epsilon_high=0.2 loss_norm=sequence",
        "OpenRLHF forces the sequence-mean aggregation for gspo",
        _ppo(policy_loss_type="gspo", agg="seq-mean-token-mean"),
    ),
    "--actor.entropy_coef": Entry(None, "an entropy bonus is no gcfamily setting (0 only logs it: gcfamily's default)"),
    "--actor.aux_loss_coef": Entry(None, "a mixture-of-experts balancing loss: gcfamily trains no MoE router loss"),
    # -- KL (compute_approx_kl; in the loss with use_loss, else in the reward through compute_reward)
    f"--algo.kl.estimator k1 {KL}": Entry(
        BASE + " beta=0.05 kl_estimator=k1 kl_clamp=10",
        "OpenRLHF clamps the KL value to [-10, 10]: for k1 that is kl_clamp=10",
        _ppo(use_kl_loss=True, kl_coef=0.05, kl_estimator="k1"),
    ),
    f"--algo.kl.estimator k2 {KL}": Entry(
        BASE + f" beta=0.05 kl_estimator=k2 kl_clamp={SQRT20!r}",
        "the value clamp at 10 is |log(pi/pi_ref)| <= sqrt(20): kl_clamp=4.47213595499958",
        _ppo(use_kl_loss=True, kl_coef=0.05, kl_estimator="k2"),
    ),
    f"--algo.kl.estimator k3 {KL} (no token past k3 = 10)": Entry(
        BASE + " beta=0.05 kl_estimator=k3 kl_clamp=none",
        "exact while every token has log(pi_ref/pi) in [-11.0, 2.61]; past it OpenRLHF clamps k3 to 10 (gradient 0), "
        "an asymmetric clamp that kl_clamp (symmetric in log(pi_ref/pi)) cannot express",
        _ppo(use_kl_loss=True, kl_coef=0.05, kl_estimator="k3"),
        case="near",
    ),
    "--algo.kl.use_loss": Entry(
        "--set kl_placement=loss",
        "the KL loss is always token-mean: with seq-mean-token-mean see the control rows",
        compared=False,
    ),
    "--algo.kl.init_coef": Entry(
        "--set beta=...", "OpenRLHF's default is 0.01, in the reward unless --algo.kl.use_loss", compared=False
    ),
    "--algo.kl.init_coef (KL in the reward)": Entry(
        None,
        "OpenRLHF adds -coef * KL_t to each token's reward after the group baseline, so A_t carries the KL still to "
        "come (gamma = 1); gcfamily's kl_placement=reward subtracts the sequence's KL before the baseline",
    ),
    "--algo.kl.unbiased_gradient": Entry(
        None,
        "the value of the estimator with the gradient of w * (log pi/pi_ref)^2 / 2, w = pi/pi_old clamped at 10: "
        "no gcfamily estimator has that gradient (k2 with kl_clamp=none has it at w = 1 only)",
    ),
    "--algo.kl.target": Entry(None, "the adaptive KL controller (Ziegler et al.): gcfamily's beta is fixed"),
    "--algo.kl.horizon": Entry(None, "the adaptive KL controller's horizon: gcfamily's beta is fixed"),
    # -- the train/rollout mismatch correction (PolicyLoss's is_correction_*)
    "--algo.advantage.is_correction_level off": Entry(GN + " tis=off", "", _ppo()),
    "--algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip": Entry(
        GN + " tis=token_truncate tis_min=0.5 tis_max=5",
        "TIS: rho = pi_old/pi_rollout clamped into the threshold",
        _ppo(is_level="token", is_mode="clip"),
    ),
    "--algo.advantage.is_correction_level token --algo.advantage.is_correction_mode mask": Entry(
        GN + " tis=token_mask tis_min=0.5 tis_max=5",
        "ICEPOP: rho kept inside the threshold, 0 outside",
        _ppo(is_level="token", is_mode="mask"),
    ),
    "--algo.advantage.is_correction_level seq": Entry(
        None,
        "gates each sequence on the geometric mean of rho and keeps the survivors' per-token rho; gcfamily's "
        "sequence_* weigh a row by the product of rho",
    ),
    "--algo.advantage.is_correction_mode clip": Entry(
        "--set tis=token_truncate", "token level only (above)", compared=False
    ),
    "--algo.advantage.is_correction_mode mask": Entry(
        "--set tis=token_mask", "token level (above); seq: not expressible", compared=False
    ),
    "--algo.advantage.is_correction_gating ratio": Entry(
        "--set tis=...", "the gate reads rho itself (above)", compared=False
    ),
    "--algo.advantage.is_correction_gating binary_kl": Entry(
        None, "a gate on the sampled token's binary KL between rollout and train policy: no gcfamily setting"
    ),
    "--algo.advantage.is_correction_gating tv": Entry(
        None, "a gate on the sampled token's total variation between rollout and train policy: no gcfamily setting"
    ),
    "--algo.advantage.is_correction_threshold": Entry(
        "--set tis_min=LOW tis_max=HIGH", "one value HIGH is tis_min=none tis_max=HIGH", compared=False
    ),
    # -- rewards
    "--reward.clip_range": Entry(None, "rewards clamped to [-10, 10] by default: gcfamily clips no reward (none here)"),
    "--reward.normalize_enable": Entry(None, "running reward normalisation: no gcfamily setting"),
    "--reward.overlong_buffer_len": Entry(None, "DAPO's overlong penalty: no gcfamily setting (a reward function can)"),
    "--reward.overlong_penalty_factor": Entry(None, "DAPO's overlong penalty: no gcfamily setting"),
    "--reward.stop_properly_penalty_coef": Entry(None, "ProRL's truncation penalty: no gcfamily setting"),
    "--algo.dynamic_filtering_enable": Entry(
        None, "DAPO's dynamic sampling refills the batch; gcfamily's zero_std=exclude drops groups without refilling"
    ),
    "--algo.dynamic_filtering_range": Entry(None, "DAPO's dynamic sampling: no gcfamily setting"),
    "--rollout.n_samples_per_prompt": Entry("--set group_size=...", "G", compared=False),
    "--train.max_epochs": Entry("--set mu=...", "passes over each rollout batch (checked rows use 2)", compared=False),
    "--critic.value_clip": Entry(
        "--method ppo --set value_clip=...",
        "PPO's clipped value loss; not compared (a critic's loss, not the policy's; OpenRLHF halves it)",
        compared=False,
    ),
    # -- DPO (train_dpo.py, DPOLoss on summed log-probs, the mean over pairs)
    "--model.beta": Entry("--method dpo --set beta=0.1", "", {"beta": 0.1}, kind="dpo"),
    "--model.label_smoothing": Entry(
        "--method cdpo --set beta=0.1 label_smoothing=0.1",
        "OpenRLHF's label smoothing is cDPO",
        {"beta": 0.1, "label_smoothing": 0.1},
        kind="dpo",
    ),
    "--model.ipo_enable": Entry(
        "--method ipo --set beta=0.1", "IPO on summed log-ratios", {"beta": 0.1, "ipo": True}, kind="dpo"
    ),
    "--model.nll_loss_coef": Entry(
        None, "DPO plus an NLL term on the chosen completions' per-token mean: gcfamily's dpo has no such term"
    ),
    "--model.aux_loss_coef": Entry(None, "a mixture-of-experts balancing loss: gcfamily trains no MoE router loss"),
    "KTO": Entry(None, "OpenRLHF 0.11.2 has no KTO (no train_kto.py, no KTOLoss); gcfamily's kto has nothing to match"),
    # -- controls: near-misses that must differ
    "control: group_norm with gcfamily's std_eps=0 and loss_norm=sequence": Entry(
        "--method grpo --set mu=2 beta=0", "", _ppo(), expect="differ"
    ),
    "control: dr_grpo as --method dr-grpo (constant normaliser)": Entry(
        "--method dr-grpo --set mu=2 beta=0", "", _ppo(estimator="dr_grpo"), expect="differ"
    ),
    "control: k1 KL loss with gcfamily's kl_clamp=20": Entry(
        BASE + " beta=0.05 kl_estimator=k1",
        "",
        _ppo(use_kl_loss=True, kl_coef=0.05, kl_estimator="k1"),
        expect="differ",
    ),
    "control: k3 KL loss with tokens past k3 = 10": Entry(
        BASE + " beta=0.05 kl_estimator=k3 kl_clamp=none",
        "",
        _ppo(use_kl_loss=True, kl_coef=0.05, kl_estimator="k3"),
        expect="differ",
    ),
    "control: seq-mean-token-mean with the KL loss (OpenRLHF's KL stays token-mean)": Entry(
        "--method grpo --set mu=2 std_eps=1e-9 loss_norm=sequence beta=0.05 kl_estimator=k1 kl_clamp=10",
        "",
        _ppo(agg="seq-mean-token-mean", use_kl_loss=True, kl_coef=0.05, kl_estimator="k1"),
        expect="differ",
    ),
    "control: KL in the reward (k1, 0.05) vs kl_placement=reward": Entry(
        BASE + " beta=0.05 kl_placement=reward kl_estimator=k1 kl_clamp=10",
        "",
        _ppo(kl_coef=0.05, kl_estimator="k1"),
        expect="differ",
    ),
    "control: seq-level mask vs tis=sequence_mask": Entry(
        GN + " tis=sequence_mask tis_min=0.5 tis_max=5", "", _ppo(is_level="seq", is_mode="mask"), expect="differ"
    ),
    "control: --model.ipo_enable as --method dpo": Entry(
        "--method dpo --set beta=0.1", "", {"beta": 0.1, "ipo": True}, kind="dpo", expect="differ"
    ),
}

# OpenRLHF's parser flags that can change a loss or an advantage: each must be covered by an OPTIONS key
SCOPE = {
    "train_ppo_ray.py": (
        "--algo.advantage.estimator",
        "--algo.advantage.gamma",
        "--algo.advantage.lambd",
        "--algo.advantage.no_std_norm",
        "--algo.advantage.is_correction_level",
        "--algo.advantage.is_correction_mode",
        "--algo.advantage.is_correction_gating",
        "--algo.advantage.is_correction_threshold",
        "--actor.eps_clip",
        "--actor.eps_clip_low_high",
        "--actor.dual_clip",
        "--actor.loss_agg_mode",
        "--actor.policy_loss_type",
        "--actor.entropy_coef",
        "--actor.aux_loss_coef",
        "--algo.kl.estimator",
        "--algo.kl.use_loss",
        "--algo.kl.init_coef",
        "--algo.kl.unbiased_gradient",
        "--algo.kl.target",
        "--algo.kl.horizon",
        "--reward.clip_range",
        "--reward.normalize_enable",
        "--reward.overlong_buffer_len",
        "--reward.overlong_penalty_factor",
        "--reward.stop_properly_penalty_coef",
        "--algo.dynamic_filtering_enable",
        "--algo.dynamic_filtering_range",
        "--rollout.n_samples_per_prompt",
        "--train.max_epochs",
        "--critic.value_clip",
    ),
    "train_dpo.py": (
        "--model.beta",
        "--model.label_smoothing",
        "--model.ipo_enable",
        "--model.nll_loss_coef",
        "--model.aux_loss_coef",
    ),
}
LOSSY = re.compile(
    r"kl|clip|loss|advantage|entropy|beta|ipo|smooth|nll|correction|filter|gamma|lambd|penalty|overlong|normal|samples|epoch"
)
"""A flag name that looks like a loss option: it must be in SCOPE or NOT_LOSS."""
NOT_LOSS = re.compile(
    r"adam\.betas|max_norm|\.num_nodes|num_gpus|max_samples|save_value_network|freezing_steps|data\.|eval\.|ckpt\.|"
    r"logger\.|\.lr|gradient_checkpointing|ema_beta|packing_samples|max_epochs|train\.batch_size|micro_batch_size|loss_mask"
)
"""Flags that match LOSSY but change no loss: gradient clipping, sample counts, logging, data fields."""


# ----------------------------------------------------------------------------------
# OpenRLHF's options, read from its parsers


def openrlhf_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("openrlhf")  # locates the package without running its __init__
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def parser_flags(path: Path) -> dict[str, Optional[list]]:
    """Every `parser.add_argument("--x", ..., choices=[...])` of a script: flag -> its choices (None without)."""
    flags: dict[str, Optional[list]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            a = node.args[0]
            name = a.value if isinstance(a, ast.Constant) else None
            if isinstance(a, ast.JoinedStr):  # f"--{prefix}.optim": both prefixes
                name = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in a.values)
            choices = next((k.value for k in node.keywords if k.arg == "choices"), None)
            flags[name] = ast.literal_eval(choices) if choices is not None else None
    return flags


def enumerate_options(root: Path) -> tuple[list[str], list[str], list[str]]:
    """(in-scope options, each choice on its own; those no OPTIONS key covers; flags that look lossy but are unscoped)."""
    options, unclassified = [], []
    for script, scope in SCOPE.items():
        flags = parser_flags(root / "cli" / script)
        for flag, choices in flags.items():
            if flag in scope:
                options += [f"{flag} {c}" for c in choices] if choices else [flag]
            elif LOSSY.search(flag) and not NOT_LOSS.search(flag):
                unclassified.append(f"{script}: {flag}")
        unclassified += [f"{script}: {f} (in SCOPE, not in the parser)" for f in scope if f not in flags]
    missing = [o for o in options if not any(k == o or k.startswith(o + " ") for k in OPTIONS)]
    return options, missing, unclassified


# ----------------------------------------------------------------------------------
# loading OpenRLHF's functions without its package __init__s


def _stub_openrlhf(root: Path) -> dict[str, Any]:
    """OpenRLHF's loss, KL, normaliser and advantage functions, with fake deepspeed / ray / launcher modules."""
    fake = {
        "deepspeed": types.ModuleType("deepspeed"),
        "ray": types.ModuleType("ray"),
        "openrlhf.trainer.ray.launcher": types.ModuleType("openrlhf.trainer.ray.launcher"),
        "openrlhf.utils.utils": types.ModuleType(
            "openrlhf.utils.utils"
        ),  # imports transformers; Experience reads one name
    }
    fake["openrlhf.trainer.ray.launcher"].RayActorGroup = object
    fake["openrlhf.utils.utils"].zero_pad_sequences = None
    for pkg in (
        "openrlhf",
        "openrlhf.models",
        "openrlhf.utils",
        "openrlhf.trainer",
        "openrlhf.trainer.ppo_utils",
        "openrlhf.trainer.ray",
    ):
        m = types.ModuleType(pkg)
        m.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]  # submodules load from disk, __init__.py is skipped
        fake.setdefault(pkg, m)
    for name, m in fake.items():
        sys.modules.setdefault(name, m)
    loss = importlib.import_module("openrlhf.models.loss")
    utils = importlib.import_module("openrlhf.models.utils")
    lu = importlib.import_module("openrlhf.utils.loss_utils")
    em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
    for name in ("deepspeed", "ray"):  # gone again: transformers looks for a real deepspeed by its spec
        if sys.modules.get(name) is fake[name]:
            del sys.modules[name]
    return {"loss": loss, "utils": utils, "loss_utils": lu, "maker": em.RemoteExperienceMaker}


# ----------------------------------------------------------------------------------
# random cases


def policy_case(seed: int, far: bool) -> dict[str, torch.Tensor]:
    """Rewards [B], lengths [B], log-probs [B, P + T] of pi, pi_old, pi_ref and the sampler (float64)."""
    gen = torch.Generator().manual_seed(seed)
    B = N_PROMPTS * G
    rewards = torch.randn(N_PROMPTS, G, generator=gen, dtype=torch.float64)
    rewards[0] = 0.75  # an all-equal group
    rewards[1] = torch.tensor([0.0, 1.0, 1.0, 0.0])  # a binary reward
    rewards = rewards.flatten().float().double()  # float32-exact: gcfamily reads rewards as float32
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[torch.randint(0, B, (1,), generator=gen)] = T  # one full row; the others are padded
    logps = -(0.1 + 2.9 * torch.rand(B, P + T, generator=gen, dtype=torch.float64))  # [B, P+T]
    old = logps + 0.35 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)  # r = e^(+-0.35): both clip sides
    ref = logps + (0.5 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)).clamp(-2.0, 2.0)
    sample = old + 0.3 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)  # the rollout engine's
    full = int(torch.nonzero(lengths == T)[0])
    sample[full, P : P + 2] = old[full, P : P + 2] + 1.0  # rho = e^-1 < 0.5: below the correction's band
    sample[full, P + 2 : P + 4] = old[full, P + 2 : P + 4] - 2.0  # rho = e^2 > 5: above it
    low = 2 * G + int(rewards[2 * G : 3 * G].argmin())  # its advantage is < 0 under every group estimator
    old[low, P] = logps[low, P] - 1.5  # r = e^1.5 > 3 with A < 0: dual-clip's branch (dual_clip=3)
    if far:  # log(pi_ref/pi) = +12 and -12: past k1's clamp at 10, k2's at sqrt(20) and k3's at [-11, 2.61]
        ref[full, P + 4] = logps[full, P + 4] + 12.0
        ref[full, P + 5] = logps[full, P + 5] - 12.0
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [B, T] completion tokens
    values = 0.5 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)  # [B, P+T] a critic's V (gae only)
    return {
        "values": values,
        "rewards": rewards,
        "lengths": lengths,
        "mask": mask,
        "logps": logps,
        "old": old,
        "ref": ref,
        "sample": sample,
    }


# ----------------------------------------------------------------------------------
# OpenRLHF's side


def orl_advantages(o: dict, e: Entry, case: dict, dtype: torch.dtype) -> torch.Tensor:
    """A [B, T] from RemoteExperienceMaker.compute_advantages_and_returns; without use_loss and with a KL coefficient,
    the experience carries make_experience's KL of pi_old to pi_ref, which compute_reward adds to the token rewards."""
    ns = types.SimpleNamespace
    args = ns(
        reward=ns(overlong_buffer_len=None, stop_properly_penalty_coef=None, clip_range=(-10.0, 10.0)),
        rollout=ns(n_samples_per_prompt=G, max_new_tokens=T),
        algo=ns(
            advantage=ns(
                estimator=e.orl["estimator"],
                gamma=e.orl["gamma"],
                lambd=e.orl["lambd"],
                no_std_norm=e.orl.get("no_std_norm", False),
            )
        ),
    )
    maker = object.__new__(o["maker"])
    maker.strategy, maker.args, maker.advantage_estimator = ns(args=args), args, e.orl["estimator"]
    maker.kl_ctl = ns(value=e.orl["kl_coef"])
    mask = case["mask"].bool()
    kl = torch.zeros(mask.shape, dtype=dtype)  # with use_loss (or no coefficient) make_experience stores zeros
    if not e.orl["use_kl_loss"] and e.orl["kl_coef"] > 0:
        old, ref = case["old"][:, P:].to(dtype), case["ref"][:, P:].to(dtype)
        kl = o["utils"].compute_approx_kl(old, ref, kl_estimator=e.orl["kl_estimator"])
    exp = ns(
        rewards=case["rewards"].to(dtype),
        action_mask=mask,
        kl=kl,
        values=case["values"][:, P:].to(dtype),  # the critic's, read by gae only
        index=list(range(len(mask))),
        info={},
    )
    (exp,) = maker.compute_advantages_and_returns([exp])
    return exp.advantages


def orl_policy(o: dict, e: Entry, case: dict, dtype: torch.dtype) -> dict[str, Any]:
    """PolicyModelActor.training_step's loss (ppo_actor.py): PolicyLoss + kl_ctl * aggregate_loss(compute_approx_kl)."""
    s = e.orl
    adv = orl_advantages(o, e, case, dtype)
    mask = case["mask"].bool()
    logps = case["logps"][:, P:].to(dtype).clone().requires_grad_(True)  # [B, T] the leaf
    old, ref, sample = (case[k][:, P:].to(dtype) for k in ("old", "ref", "sample"))
    loss_fn = o["loss"].PolicyLoss(
        clip_eps_low=s["eps"][0],
        clip_eps_high=s["eps"][1],
        dual_clip=s["dual_clip"],
        token_level_loss=s["agg"] == "token-mean",
        policy_loss_type=s["policy_loss_type"],
        is_correction_level=s["is_level"],
        is_correction_mode=s["is_mode"],
        is_correction_gating=s["is_gating"],
        is_correction_threshold=list(s["is_threshold"]),
    )
    # the step's global token and sample counts, as ppo_train gives them (one micro-batch, one process)
    ((_, info),) = list(o["loss_utils"].iter_grad_accum_global_norm([mask], None, 1, lambda m: m))
    actor_loss, *_ = loss_fn(logps, old, adv, action_mask=mask, rollout_log_probs=sample, **info)
    kl_loss = 0.0
    if s["use_kl_loss"] and s["kl_coef"] > 0:
        kl = o["utils"].compute_approx_kl(
            logps, ref, log_probs_old=old, kl_estimator=s["kl_estimator"], unbiased_gradient=s["unbiased_gradient"]
        )
        kl_loss = o["loss"].aggregate_loss(kl, mask, **info)  # token-mean, whatever loss_agg_mode says
    loss = actor_loss + kl_loss * s["kl_coef"]
    loss.backward()
    grad = torch.zeros(case["logps"].shape, dtype=dtype)
    grad[:, P:] = logps.grad
    return {"loss": float(loss.detach()), "grad": grad}


def orl_dpo(o: dict, e: Entry, case: dict, dtype: torch.dtype) -> dict[str, Any]:
    """DPOLoss on the pairs' summed log-probs (DPOTrainer.concatenated_forward's all_logps_sum), mean over pairs."""
    leaf = case["logps"].to(dtype).clone().requires_grad_(True)  # [B, L], interleaved chosen / rejected
    m = case["loss_mask"].to(dtype)
    seq, ref = (leaf * m).sum(-1), (case["ref"].to(dtype) * m).sum(-1)  # [B]
    fn = o["loss"].DPOLoss(e.orl["beta"], e.orl.get("label_smoothing", 0.0), e.orl.get("ipo", False))
    loss, _, _ = fn(seq[0::2], seq[1::2], ref[0::2], ref[1::2])
    loss.backward()
    return {"loss": float(loss.detach()), "grad": leaf.grad}


# ----------------------------------------------------------------------------------
# gcfamily's side


def _trl_parity() -> Any:
    path = Path(__file__).resolve().parent / "trl_parity.py"
    spec = importlib.util.spec_from_file_location("trl_parity", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["trl_parity"] = mod
    spec.loader.exec_module(mod)
    return mod


def _method(tp: Any, spec: str, shared: dict) -> Any:
    words = spec.split()
    method = words[words.index("--method") + 1]
    sets = " ".join(words[words.index("--set") + 1 :]) if "--set" in words else ""
    return tp.build_method(method, sets, shared)


def gcf_policy(tp: Any, e: Entry, case: dict, dtype: torch.dtype) -> dict[str, Any]:
    from gcfamily.methods.base import Batch

    B = N_PROMPTS * G
    method = _method(tp, e.gcf, {"group_size": G})
    pos = torch.arange(P + T)[None]
    loss_mask = ((pos >= P) & (pos < P + case["lengths"][:, None])).long()  # [B, P+T]
    method.services = tp._Services(case["old"].to(dtype), case["ref"].to(dtype))
    method.ref = "reference" if method.settings.beta > 0 else None
    batch = Batch(
        input_ids=torch.full((B, P + T), 5),
        attention_mask=torch.ones(B, P + T, dtype=torch.long),
        loss_mask=loss_mask,
        rewards=case["rewards"].float(),
        valid=torch.ones(B, dtype=torch.bool),
        sample_logps=case["sample"].to(dtype),
    )
    if method.name == "ppo":  # the critic: the case's values (float32, as ValueModel's head gives them)
        method.critic = _Critic(case["values"])
        method.services.device = torch.device("cpu")
    batch, _ = method.prepare(batch)
    return tp._step(method, batch, case["logps"].to(dtype))


class _Critic:
    """PPO's critic as PPO.critic_values calls it, (ids, attention, loss mask) -> V [b, L], here the case's values."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values, self.start = values, 0

    def __call__(self, ids: torch.Tensor, am: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
        out = self.values[self.start : self.start + len(ids)]
        self.start += len(ids)
        return out


def gcf_dpo(tp: Any, e: Entry, case: dict, dtype: torch.dtype) -> dict[str, Any]:
    words = e.gcf.split()
    row = types.SimpleNamespace(method=words[1], sets=" ".join(words[3:]), validated=True)
    c = {**case, "logps": case["logps"].to(dtype), "ref": case["ref"].to(dtype)}
    return tp.gcf_pairs(row, c)


# ----------------------------------------------------------------------------------
# the comparison


def coverage(case: dict) -> dict[str, int]:
    """Branches a policy case reaches, computed here from the inputs: clipped tokens (group_norm's sign of A is the
    sign of R - mean), rollout ratios outside [0.5, 5], tokens past OpenRLHF's k3 value clamp, padded rows."""
    m = case["mask"].bool()
    R = case["rewards"].view(N_PROMPTS, G)
    sign = torch.sign(R - R.mean(-1, keepdim=True)).flatten()[:, None]  # [B, 1]
    r = torch.exp(case["logps"] - case["old"])[:, P:]
    rho = torch.exp(case["old"] - case["sample"])[:, P:]
    log_rho = (case["ref"] - case["logps"])[:, P:]
    return {
        "clip_low": int(((sign < 0) & (r < 0.8) & m).sum()),
        "clip_high": int(((sign > 0) & (r > 1.2) & m).sum()),
        "rho_out": int((((rho < 0.5) | (rho > 5)) & m).sum()),
        "dual_clip_3": int(((sign < 0) & (r > 3) & m).sum()),
        "past_k3_clamp": int((((log_rho > 2.61) | (log_rho < -11)) & m).sum()),
        "equal_groups": int((R.amax(-1) == R.amin(-1)).sum()),
        "padded_rows": int((case["lengths"] < T).sum()),
    }


def compare(o: dict, tp: Any, e: Entry, seed: int, dtype: torch.dtype) -> dict[str, Any]:
    """|loss diff| and max |grad diff| between OpenRLHF and gcfamily on one random case, in one dtype."""
    if e.kind == "dpo":
        case = tp.pair_case(seed)
        a, b = orl_dpo(o, e, case, dtype), gcf_dpo(tp, e, case, dtype)
        cov: dict[str, int] = {}
    else:
        case = policy_case(seed, far=e.case == "far")
        a, b = orl_policy(o, e, case, dtype), gcf_policy(tp, e, case, dtype)
        cov = coverage(case)
    worst = max(abs(a["loss"] - b["loss"]), float((a["grad"] - b["grad"].to(dtype)).abs().max()))
    return {"diff": worst, "scale": float(a["grad"].abs().max()), "coverage": cov}


def static_rows() -> list[tuple[str, str, str, str]]:
    """(option, gcfamily spelling, status, note) of every OPTIONS entry."""
    return [(k, e.gcf or "", e.status, e.note) for k, e in OPTIONS.items()]


def markdown_table() -> str:
    """docs/openrlhf-mapping.md's table, from OPTIONS alone (no OpenRLHF needed)."""
    lines = ["| OpenRLHF 0.11.2 | gcfamily | status | |", "|---|---|---|---|"]
    for opt, gcf, status, note in static_rows():
        note = note.replace("|", "\\|")  # a table cell
        lines.append(f"| `{opt}` | {f'`{gcf}`' if gcf else '-'} | {status} | {note} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="random cases per row")
    ap.add_argument("--markdown", action="store_true", help="print docs/openrlhf-mapping.md's table and exit")
    ap.add_argument("--rows", default="", help="comma-separated substrings of option names (default: every row)")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown_table())
        return 0
    root = openrlhf_dir()
    if root is None:
        print("OpenRLHF is not installed (pip install --no-deps openrlhf==0.11.2); nothing to compare.")
        return 0
    tp = _trl_parity()  # gcfamily (and transformers) first, before any fake module
    o = _stub_openrlhf(root)
    torch.set_num_threads(1)
    options, missing, unclassified = enumerate_options(root)
    print(
        f"OpenRLHF 0.11.2 at {root}, torch {torch.__version__}; {a.seeds} random case(s) per row, float64 and float32"
    )
    print(f"{len(options)} loss options enumerated from its parsers; tolerance {TOL:g} (float64), {TOL32:g} (float32)")
    w = max(len(k) for k in OPTIONS)
    print(
        f"{'option':<{w}}  {'status':<16} {'fp64 max|diff|':>14} {'fp32 max|diff|':>14} {'max|grad|':>9}  gcfamily / reason"
    )
    counts = {"exact": 0, "differs": 0, "not expressible": 0, "spelling only": 0}
    failed, largest = [], 0.0
    cov: dict[str, int] = {}
    for key, e in OPTIONS.items():
        if a.rows and not any(s in key for s in a.rows.split(",")):
            continue
        if e.gcf is None or not e.compared or not e.orl:
            status = e.status
            counts[status] += 1
            print(f"{key:<{w}}  {status:<16} {'':>14} {'':>14} {'':>9}  {e.gcf or ''} {e.note}".rstrip())
            continue
        res = {dt: [compare(o, tp, e, s, dt) for s in range(a.seeds)] for dt in (torch.float64, torch.float32)}
        d64, d32 = (max(r["diff"] for r in res[dt]) for dt in (torch.float64, torch.float32))
        scale = max(r["scale"] for r in res[torch.float64])
        for r in res[torch.float64]:
            for k, v in r["coverage"].items():
                cov[k] = cov.get(k, 0) + v
        same = d64 <= TOL and d32 <= TOL32
        status = "exact" if same else "differs"
        ok = same if e.expect == "match" else (d64 >= CONTROL_MIN and d32 >= CONTROL_MIN)
        if not ok:
            failed.append(key)
        if e.expect != "differ":
            counts[status] += 1
            largest = max(largest, d64) if same else largest
        shown = (
            status
            + ("" if ok else " FAIL")
            + (" (control)" if e.expect == "differ" else " (known)" if e.expect == "differs" else "")
        )
        print(f"{key:<{w}}  {shown:<16} {d64:14.2e} {d32:14.2e} {scale:9.2e}  {e.gcf}")
    print("Policy cases reached (summed over rows and seeds): " + ", ".join(f"{k} {v}" for k, v in cov.items()))
    print(
        f"Options: {counts['exact']} exact, {counts['differs']} differ, {counts['not expressible']} not expressible, "
        f"{counts['spelling only']} spellings only; largest fp64 difference of an exact row {largest:.2e}"
    )
    for m in missing:
        print(f"UNMAPPED: {m} (an option of OpenRLHF's parser that OPTIONS does not cover)")
    for u in unclassified:
        print(f"UNCLASSIFIED: {u} (looks like a loss option; add it to SCOPE or NOT_LOSS)")
    print("all rows as expected" if not (failed or missing or unclassified) else f"FAILED: {', '.join(failed)}")
    return 1 if failed or missing or unclassified else 0


if __name__ == "__main__":
    sys.exit(main())
