"""The shared settings: every field with its docstring, a numeric field with its range beside it (config/rules.py), and
`validate`, the one check of a whole Config. A method's own settings are its Settings dataclass (MethodSettings)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from gcfamily.config.data import DataSettings
from gcfamily.config.rules import (
    MAX_GROUP,
    MAX_ROWS,
    MAX_SAMPLED_TOKENS,
    MAX_SEQUENCE_TOKENS,
    holds_non_finite,
    names_in,
    range_checks,
    real,
    require,
    setting,
    whole,
)


@dataclass
class Resolution:
    """What resolving a Config adds beside the user's settings, kept apart from them: which settings were given, the
    method's own settings as given, and those settings typed by the method's class. Not a setting: `gcf settings` does
    not list it, a recipe cannot set it, and Config's fields are the user's settings alone."""

    explicit: list = field(default_factory=list)
    method_options: dict = field(default_factory=dict)
    settings: Any = None


@dataclass(init=False)
class Config(DataSettings):
    """The shared settings, plus the run's method settings (`settings`, once the method is known); the data settings are in config/data.py."""

    # --- what to run
    method: str = "sft"
    """Method: a name (see `gcf methods`), module:Class, path/to/file.py:Class, or a name an installed package registers."""
    model: str = "smollm2-135m"
    """Model alias (tiny, smollm2-135m, qwen-0.5b, ...), hub id or local folder."""
    task: Optional[str] = "arithmetic"
    """Built-in offline task: prompts, references and the reward (see `gcf tasks`)."""
    task_options: dict = field(default_factory=dict)
    """Options for the task, e.g. {level: 1d-add}."""
    output_dir: str = "runs/default"
    """Run folder: settings, metrics.jsonl, TensorBoard events, checkpoints and the final model. `gcf run` without it makes runs/METHOD-MODEL-TIME."""
    overwrite: bool = False
    """Allow writing into an output folder that holds another run."""
    seed: int = setting(0, whole(0, 2**63 - 1), "in [0, 2**63)")
    """Seed for data order, sampling and initialisation."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    dtype: str = "auto"
    """Compute dtype of forwards and backwards: float32, bfloat16, or auto (bfloat16 on a GPU that supports it, float32 on CPU).
    Weights and AdamW state stay in master_dtype; see gcfamily/core/precision.py."""
    logprob_error_bound: float = setting(0.01, real(0, lo_open=True), "> 0 nats")
    """With 16-bit compute over float32 weights, the run measures its policy's log-probs of a probe text under dtype
    against float32 at the start; a mean gap past this (nats a token) is said on its first lines (docs/precision.md)."""
    float32_components: str | list = setting(
        "none", names_in("attention", "mlp", "head"), "none or a comma-separated list of attention, mlp, head"
    )
    """Components kept in float32 under dtype=bfloat16 (comma-separated: attention, mlp, head; none): their forwards
    compute as in a float32 run, the rest in bf16 (one process and DDP; docs/precision.md measures what each keeps)."""
    master_dtype: str = "float32"
    """dtype of the trained parameters, their gradients and AdamW's state: float32, or bfloat16 to train in pure bfloat16 on purpose
    (small updates then round away: at lr 1e-6 most weights never move)."""
    save_dtype: str = "master"
    """dtype of the final model folder: master (the master weights as trained), float32, bfloat16 or float16 (a smaller copy).
    Checkpoints always hold the master weights, so a resume is exact."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub model; off unless asked for."""
    threads: str | int = setting("auto", lambda x: x == "auto" or whole(1)(x), "auto or a whole number >= 1")
    """torch's CPU threads: a number, or auto, chosen at the start of the run: the cores this process may use less those
    other processes keep busy right now (measured over 0.3 s; torch's threads spin waiting for one that another process
    pre-empted, 3.6x slower beside one busy process), at most torch's own count (OMP_NUM_THREADS, or one per physical
    core), shared among a run's processes on the machine (gcfamily/core/threads.py). The count is printed with the progress
    bar and logged in the first metrics row; a --resume keeps the count its checkpoint recorded (bitwise equal), unless
    threads is given."""

    # --- the step
    max_steps: int = setting(100, whole(0), ">= 0")
    """Number of training steps (each step draws one batch)."""
    epochs: float = setting(0.0, real(0), ">= 0 and finite (0 = no epoch limit)")
    """Also stop after this many passes over the training rows or prompts (TRL's num_train_epochs; fractions allowed;
    0 = no limit). With epochs given and max_steps not given, max_steps becomes the steps that many passes take."""
    max_time: float = setting(0.0, real(0), ">= 0 and finite (0 = no limit)")
    """Also stop once the training steps have taken this many seconds (evaluation not counted; 0 = no limit).
    Checked after each step, so the last step may overrun; the lr schedule still spans max_steps."""
    max_tokens: int = setting(0, whole(0), ">= 0 (0 = no limit)")
    """Also stop once this many tokens were generated plus trained on (loss tokens; 0 = no limit). Checked after each step."""
    max_flops: float = setting(0.0, real(0), ">= 0 and finite (0 = no limit)")
    """Also stop once the estimated training FLOPs reach this (6 x parameters x loss tokens + 2 x parameters x generated tokens;
    0 = no limit). Checked after each step."""
    batch_size: int = setting(8, whole(1, MAX_ROWS), f"in [1, {MAX_ROWS}]")
    """Examples per step: rows for SFT, prompts for on-policy methods, pairs for DPO."""
    micro_batch_size: int = setting(8, whole(1), ">= 1")
    """Rows per forward/backward; gradient accumulation never changes the gradient."""
    loss_norm: Optional[str] = None
    """token, sequence, sum or constant; None takes the method's default (see engine.py)."""
    norm_constant: float = setting(1.0, real(0, lo_open=True), "> 0 and finite")
    """Per-sequence constant of the "constant" normalisation (Dr. GRPO uses the max length)."""
    chunk_size: int = setting(256, whole(1), ">= 1")
    """Rows of the output projection computed at a time in the log-prob path."""
    share_prefix: bool = True
    """Run a prompt that several rows of a micro-batch share (GRPO's group, a DPO pair) through the model once; same log-probs and gradient."""
    max_length: int = setting(512, whole(2, MAX_SEQUENCE_TOKENS), f"in [2, {MAX_SEQUENCE_TOKENS}] tokens")
    """Longest prompt + completion in tokens for offline data."""
    long_prompts: str = "skip"
    """A prompt longer than max_length: skip (counted and logged) or error."""

    # --- optimizer
    lr: float = setting(1e-5, real(0, lo_open=True), "> 0 and finite", label="lr (learning rate)")
    """Peak learning rate of AdamW."""
    weight_decay: float = setting(0.0, real(0), ">= 0 and finite")
    """AdamW weight decay on matrices."""
    adam_betas: tuple = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = setting(0, whole(0), ">= 0")
    """Linear warm-up steps."""
    lr_schedule: str = "constant"
    """constant, linear or cosine after warm-up."""
    min_lr_ratio: float = setting(0.0, real(0, 1), "in [0, 1]")
    """Final learning rate as a fraction of the peak for linear/cosine."""
    grad_clip: float = setting(1.0, real(0), ">= 0 and finite (0 turns clipping off)")
    """Clip the global gradient norm to this (0 turns clipping off)."""
    max_bad_steps: int = setting(5, whole(1), ">= 1")
    """Stop after this many consecutive optimizer steps with a non-finite loss or gradient, or once more than this many
    were skipped in all; a run that trained no step at all ends non-zero too, naming its first bad step."""

    # --- on-policy sampling and rewards
    group_size: int = setting(8, whole(1, MAX_GROUP), f"in [1, {MAX_GROUP}]")
    """G: completions sampled per prompt."""
    max_new_tokens: int = setting(64, whole(1, MAX_SEQUENCE_TOKENS), f"in [1, {MAX_SEQUENCE_TOKENS}] tokens")
    """Longest completion sampled."""
    temperature: float = setting(1.0, real(0, lo_open=True), "> 0 and finite")
    """Sampling temperature; the policy's log-probs use the same temperature."""
    top_p: float = setting(1.0, real(0, 1, lo_open=True), "in (0, 1]")
    """Nucleus sampling mass."""
    top_k: int = setting(0, whole(0), ">= 0 (0 = off)")
    """Top-k sampling (0 = off)."""
    stop_strings: list = field(default_factory=list)
    """Strings that end a completion."""
    rollout: str = "native"
    """native | vllm: the engine every on-policy sample is drawn with (docs/rollout.md). vllm runs colocated in the run's
    process on a copy of the weights, pushed and checked after every optimizer step (pip install 'gcfamily[vllm]')."""
    vllm_gpu_memory: float = setting(0.3, real(0, 1, lo_open=True), "in (0, 1]")
    """rollout=vllm on a GPU: the share of its memory the engine may take beside the training."""
    vllm_cpu_kv_gb: float = setting(2.0, real(0, lo_open=True), "> 0 GiB")
    """rollout=vllm on the CPU: GiB of KV cache."""
    rollout_check_tol: Optional[float] = setting(None, real(0, lo_open=True), "> 0 nats")
    """rollout=vllm: the largest |engine - trainer| log-prob on the probe sequence after a weight push before the run
    stops; none: 1e-3 in float32, 0.05 in 16-bit."""
    rollout_compile: str = "auto"
    """auto | on | off: decode through a fixed-shape step compiled with torch.compile (CUDA graphs on a GPU; gcfamily/rollout/decode.py);
    auto compiles on CUDA only, where the rollout is launch-bound (on the CPU the compiled step measured slower than eager).
    Models whose layers are not all full attention through SDPA decode eagerly either way."""
    rollout_pack_weights: bool = True
    """CPU float32 sampling and evaluation run the linear layers through oneDNN on a packed copy of their weights, made when a
    rollout starts and freed when it ends (gcfamily/core/onednn.py): 1.2-2.2x faster, but a second copy of the weights while
    sampling (540 MB for SmolLM2-135M). false samples on the plain weights, for the lowest peak memory (LoRA with
    activation checkpointing, where the rollout sets the peak). The same tokens up to float32 rounding either way."""
    reward: Optional[str | list] = None
    """Reward(s): a built-in name (numeric, exact, boxed), module:function or path/file.py:function, or a list of them
    (--reward repeated, reward=[a,b]) summed with reward_weights; None takes the task's reward. Built-ins, the task's reward
    and a reward model run in the trainer's process; module:function and file.py:function run in a worker process, where
    an exception, sys.exit, os._exit or a hang fails the call's samples (counted in reward/failed) instead of ending the process
    (a step in which every sample of every process fails still stops the run, in one sentence naming the function)."""
    reward_weights: list = field(default_factory=list)
    """Weight of each reward in `reward`, in order: the reward is sum_k w_k r_k (with several, each r_k is logged as reward/<name>/mean and /std); empty = 1 each."""
    reward_timeout: float = setting(300.0, real(0), ">= 0 seconds and finite (0 = no limit)")
    """Seconds one call of a module:function or file.py:function reward may take; past it, all the call's samples fail (0 = no limit)."""
    reward_model: Optional[str] = None
    """Folder of a trained reward model to score completions with."""
    env: Optional[str] = None
    """On-policy methods: the environment each sample is an episode with (docs/environments.md): a built-in name
    (calculator, guess, reasoning-gym), module:Class or path/file.py:Class, run in a worker process; none: one turn."""
    env_options: dict = field(default_factory=dict)
    """Keyword arguments for the environment's constructor, besides the row, e.g. {max_value: 100}."""
    env_timeout: float = setting(10.0, real(0), ">= 0 seconds and finite (0 = no limit)")
    """Seconds one environment call on one episode may take; past it that episode fails (0 = no limit)."""
    max_turns: int = setting(4, whole(1), ">= 1")
    """With an environment: the most policy turns an episode takes."""
    max_episode_tokens: Optional[int] = setting(
        None, whole(1, MAX_SEQUENCE_TOKENS), f"in [1, {MAX_SEQUENCE_TOKENS}] tokens"
    )
    """With an environment: the most tokens after the prompt (policy turns and environment answers together); none:
    max_new_tokens * max_turns."""

    # --- logging, evaluation and checkpoints
    log_every: int = setting(1, whole(1), ">= 1")
    """Write metrics every this many steps."""
    eval_every: int = setting(0, whole(0), ">= 0 (0 = only before and after)")
    """Held-out accuracy every this many steps (0 = only before and after)."""
    eval_every_s: float = setting(0.0, real(0), ">= 0 and finite (0 = off)")
    """Held-out accuracy each time this many more seconds of training steps have run (0 = off; evaluation time is not counted)."""
    eval_samples: int = setting(64, whole(1), ">= 1")
    """Held-out prompts used for accuracy."""
    eval_at_ends: bool = False
    """Evaluate held-out accuracy before the first and after the last step."""
    save_every: int = setting(0, whole(0), ">= 0 (0 = only at the end)")
    """Write a resumable checkpoint every this many steps (0 = only at the end)."""
    keep_last: int = setting(2, whole(1), ">= 1")
    """Checkpoints to keep."""
    progress: bool = True
    """Show a progress bar."""
    report_to: str | list = "tensorboard"
    """Where metrics go besides metrics.jsonl (always written): tensorboard, wandb (needs the wandb extra), none, or a list."""
    log_completions_every: int = setting(10, whole(0), ">= 0 (0 = off)")
    """On-policy runs: every this many steps, write a sample of prompts, completions and rewards to completions.jsonl and the trackers (0 = off)."""

    # --- LoRA (gcfamily/models/lora.py; needs peft)
    lora_r: int = setting(0, whole(0), ">= 0 (0 = full fine-tuning)")
    """Rank of LoRA adapters on the attention and MLP projections (0 = full fine-tuning). The reference policy is then the
    base with the adapters off (no copy), PPO's critic a second set of adapters on the same base."""
    lora_alpha: float = setting(32.0, real(0, lo_open=True), "> 0 and finite")
    """LoRA scale numerator: the update is (lora_alpha / lora_r) * B A."""
    lora_dropout: float = setting(0.0, real(0, 1, hi_open=True), "in [0, 1)")
    """Dropout on the adapters' input (0 keeps pi_old, pi_ref and the training forward the same function)."""
    lora_target_modules: list = field(default_factory=list)
    """Module names to adapt, e.g. [q_proj, v_proj]; empty = every linear layer but the output layer."""
    merge_lora: bool = False
    """Save the final model with the adapters merged into its weights (loadable by from_pretrained); the adapter goes to adapter/."""

    # --- the run folder
    allow_changed_settings: bool = False
    """Let --resume continue with settings that change the trajectory (lr, batch, method, data, ...); the change is recorded
    in run_config.json ("changes") and in the metrics. Off: a resume with such a change is refused, naming the differences."""

    # --- distribution
    dist_timeout: float = setting(600.0, real(0, lo_open=True), "> 0 seconds and finite")
    """Seconds a collective waits for the other processes before the run stops with one sentence (a process that died)."""
    strategy: str = "ddp"
    """ddp or fsdp2 when several processes run."""
    activation_checkpointing: bool = False
    """Recompute decoder layers in the backward to save memory."""

    def __init__(self, **values: Any) -> None:
        """Shared settings by name; any other key is kept for the method's own settings (checked by `settings_for`)."""
        object.__setattr__(self, "_resolved", Resolution())
        for f in fields(Config):
            object.__setattr__(self, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)  # type: ignore[misc]
        for k, v in values.items():
            if k == "method_options":
                self.method_options.update(v)
            elif k in ("explicit", "settings"):  # the run's record, given whole (Config(explicit=[...]))
                object.__setattr__(self, k, v)
            elif k in FIELD_NAMES:
                object.__setattr__(self, k, v)
            else:
                self.method_options[k] = v

    # -- the run's record beside the settings (Resolution), read and written through these names
    @property
    def explicit(self) -> list:
        """Settings given by a recipe, the command line or train()'s keywords; a method's own defaults never override them."""
        return self._resolved.explicit

    @explicit.setter
    def explicit(self, value: list) -> None:
        self._resolved.explicit = value

    @property
    def method_options(self) -> dict:
        """The method's own settings as given, before its Settings class types and checks them."""
        return self._resolved.method_options

    @method_options.setter
    def method_options(self, value: dict) -> None:
        self._resolved.method_options = value

    @property
    def settings(self) -> Any:
        """The method's own settings, an instance of its Settings dataclass, once resolved (config.resolve_settings)."""
        return self._resolved.settings

    @settings.setter
    def settings(self, value: Any) -> None:
        self._resolved.settings = value

    def replace(self, **changes: Any) -> "Config":
        """A copy with shared settings changed (dataclasses.replace), carrying a copy of the run's record."""
        out = dataclasses.replace(self, **changes)
        old = self._resolved
        object.__setattr__(out, "_resolved", Resolution(list(old.explicit), dict(old.method_options), old.settings))
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        # one spelling per setting: a method's own settings are cfg.settings.X, never cfg.X
        if name not in FIELD_NAMES and name not in INTERNAL and not name.startswith("_"):
            raise AttributeError(
                f"Config has no shared setting {name!r}; a method's own settings are cfg.settings.{name}"
            )
        object.__setattr__(self, name, value)


@dataclass
class MethodSettings:
    """Base of a method's own settings: subclass it as `Settings` on the method class, a docstring per field."""


FIELDS = {f.name: f for f in fields(Config)}
FIELD_NAMES = frozenset(FIELDS)
INTERNAL = ("explicit", "method_options", "settings")


def _sizes(cfg: Config) -> list[tuple[bool, str]]:
    """The numeric checks: each setting's range (declared beside its field), AdamW's betas, then the per-step sizes together."""
    checks = range_checks(cfg)
    betas = cfg.adam_betas
    checks.append(
        (
            isinstance(betas, (list, tuple)) and len(betas) == 2 and all(real(0, 1, hi_open=True)(b) for b in betas),
            f"adam_betas must be two numbers in [0, 1), e.g. [0.9, 0.999] (got {betas!r})",
        )
    )
    if all(ok for ok, _ in checks):  # sizes are checked one by one above, so the products below are of sane ints
        rows = cfg.batch_size * cfg.group_size
        tokens = rows * cfg.max_new_tokens
        checks += [
            (
                rows <= MAX_ROWS,
                f"batch_size * group_size = {rows} rows sampled per step is over {MAX_ROWS}; lower batch_size or group_size",
            ),
            (
                tokens <= MAX_SAMPLED_TOKENS,
                f"batch_size * group_size * max_new_tokens = {tokens} tokens sampled per step is over "
                f"{MAX_SAMPLED_TOKENS}, more than one machine can hold; lower one of them",
            ),
        ]
    return checks


def validate(cfg: Config) -> None:
    """Range checks shared by every method; a method checks its own fields in Method.validate."""
    rewards = [] if cfg.reward is None else [cfg.reward] if isinstance(cfg.reward, str) else cfg.reward
    # the task's or a reward model's is one
    n_rewards = len(rewards) if isinstance(rewards, (list, tuple)) and rewards else 1
    weights = cfg.reward_weights if isinstance(cfg.reward_weights, list) else [None]
    checks = [
        *_sizes(cfg),
        (cfg.long_prompts in ("skip", "error"), "long_prompts must be skip or error"),
        (cfg.strategy in ("ddp", "fsdp2"), "strategy must be ddp or fsdp2"),
        (cfg.lr_schedule in ("constant", "linear", "cosine"), "lr_schedule must be constant, linear or cosine"),
        (cfg.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype must be auto, float32, bfloat16 or float16"),
        (cfg.master_dtype in ("float32", "bfloat16"), "master_dtype must be float32 or bfloat16"),
        (
            cfg.save_dtype in ("master", "float32", "bfloat16", "float16"),
            "save_dtype must be master, float32, bfloat16 or float16",
        ),
        (
            isinstance(cfg.stop_strings, list) and all(isinstance(s, str) and s for s in cfg.stop_strings),
            "stop_strings must be a list of non-empty strings",
        ),
        (
            isinstance(rewards, (list, tuple))
            and (cfg.reward is None or bool(rewards))
            and all(isinstance(x, str) and x.strip() for x in rewards),
            "reward must be a reward name (numeric, module:function, path/file.py:function) or a list of them",
        ),
        (
            all(real(-math.inf)(w) for w in weights),
            f"reward_weights={cfg.reward_weights} must be a list of finite numbers",
        ),
        (
            len(weights) in (0, n_rewards),
            f"reward_weights has {len(weights)} values for {n_rewards} reward(s); give one weight per reward",
        ),
        (cfg.chat_format in ("auto", "chat", "raw"), "chat_format must be auto, chat or raw"),
        (cfg.rollout_compile in ("auto", "on", "off"), "rollout_compile must be auto, on or off"),
        (cfg.rollout in ("native", "vllm"), "rollout must be native or vllm"),
        (
            isinstance(cfg.columns, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in cfg.columns.items()),
            "columns must map names to column names, e.g. {prompt: question}",
        ),
        (
            isinstance(cfg.report_to, (str, list))
            and all(
                r in ("tensorboard", "wandb", "none")
                for r in ([cfg.report_to] if isinstance(cfg.report_to, str) else cfg.report_to)
            ),
            "report_to must be tensorboard, wandb, none or a list of them",
        ),
    ]
    # last, after each setting's own check: a NaN inside a list or dict (task_options, lora_target_modules) means
    # nothing, and run_config.json could hold it only as non-standard JSON
    containers = [f.name for f in fields(Config) if isinstance(getattr(cfg, f.name), (list, tuple, dict, set))]
    bad = next((k for k in containers if holds_non_finite(getattr(cfg, k))), None)
    checks.append(
        (bad is None, f"{bad} must hold finite numbers, not NaN or infinity (got {getattr(cfg, bad or 'seed')!r:.80})")
    )
    require(checks)
