"""TRL's and transformers' argument names, each with gcfamily's spelling: the one table behind the CLI's hint for a TRL
flag or setting name (`--learning_rate` -> `--set lr=...`) and behind the table in docs/trl-mapping.md
(tests/test_trl_names.py checks that the two agree and that every target is a real setting or flag of `gcf run`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spelling:
    """gcfamily's spelling of one TRL argument."""

    target: str | None
    """A flag of `gcf run` ("--model"), a setting ("lr", given as --set lr=...), or None: no equivalent."""
    value: str | None = None
    """The value a TRL switch stands for (--bf16 -> dtype=bfloat16); None: the user's own value."""
    note: str = ""
    """The rest of the sentence: what differs, or where to look when there is no equivalent."""
    always: bool = False
    """True (with target None): nothing to turn on, gcfamily always does it, and the note says how it differs."""

    def spelled(self) -> str:
        """`--model`, `--set lr=...`, `--set dtype=bfloat16`."""
        if self.target is None:
            return ""
        if self.target.startswith("--"):
            return self.target + (f" {self.value}" if self.value else "")
        return f"--set {self.target}={self.value or '...'}"


TRL_NAMES: dict[str, Spelling] = {
    # --- model and data (TRL's ModelConfig and ScriptArguments)
    "model_name_or_path": Spelling("--model", note="an alias, a hub id or a local folder"),
    "torch_dtype": Spelling("dtype", note="the compute dtype; the weights and AdamW stay in master_dtype (float32)"),
    "trust_remote_code": Spelling("--trust-remote-code"),
    "attn_implementation": Spelling(None, note="gcfamily chooses the attention path itself"),
    "dataset_name": Spelling("--dataset", note="a file, a save_to_disk folder or a hub id"),
    "dataset_config": Spelling("--dataset-config"),
    "dataset_train_split": Spelling("dataset_split"),
    "dataset_test_split": Spelling("eval_split", note="of eval_dataset"),
    "dataset_text_field": Spelling("columns", note="columns={text: FIELD} reads the text from FIELD"),
    "chat_template_path": Spelling("chat_template"),
    "assistant_only_loss": Spelling("assistant_only_loss"),
    "completion_only_loss": Spelling(
        None, note="prompt-completion rows always train the completion only (`gcf data` shows which tokens train)"
    ),
    "max_length": Spelling("max_length", note="prompt plus completion of offline rows"),
    "max_seq_length": Spelling("max_length", note="prompt plus completion of offline rows"),
    "max_prompt_length": Spelling(
        None,
        note="max_length caps prompt plus completion, and long_prompts (skip or error) says what a longer prompt does",
    ),
    "packing": Spelling(
        None,
        always=True,
        note="every log-prob pass packs its micro-batch's rows end to end (a prompt they share laid down once), "
        "padding only its packed rows of up to 512 tokens to one length, each row at its own positions under a block-causal mask so that no row attends to another and "
        "every log-prob and gradient is the padded row's (gcfamily/core/packing.py; a plain padded pass for an "
        "attention or family the packed path is not checked on); TRL's packing=True instead concatenates dataset rows into max_length sequences before batching (with its "
        "default packing_strategy='bfd' padding-free as below, with 'wrapped' rows cut and attending to each other), "
        "which changes what a batch counts, and gcfamily never merges rows: batch_size and micro_batch_size count rows",
    ),
    "padding_free": Spelling(
        None,
        always=True,
        note="every log-prob pass already packs its micro-batch's rows end to end under a block-causal mask (see "
        "packing), on any attention that takes a mask (sdpa, eager); TRL's padding_free=True flattens a batch into one sequence and keeps rows apart only under "
        "FlashAttention",
    ),
    # --- the run (transformers' TrainingArguments)
    "output_dir": Spelling("--output-dir"),
    "overwrite_output_dir": Spelling("--overwrite"),
    "resume_from_checkpoint": Spelling("--resume", note="the newest checkpoint, or --resume PATH"),
    "num_train_epochs": Spelling("epochs", note="with max_steps also given, the run stops at whichever comes first"),
    "max_steps": Spelling("--max-steps"),
    "per_device_train_batch_size": Spelling(
        "batch_size",
        note="batch_size is the whole optimizer step's examples over every process (prompts for on-policy methods, "
        "each sampled group_size times) and micro_batch_size the rows of one forward",
    ),
    "gradient_accumulation_steps": Spelling(
        "micro_batch_size", note="a step of batch_size examples runs in forwards of micro_batch_size rows each"
    ),
    "per_device_eval_batch_size": Spelling(
        None, note="the held-out evaluation has no batch setting (eval_samples prompts)"
    ),
    "learning_rate": Spelling("lr"),
    "weight_decay": Spelling("weight_decay"),
    "adam_beta1": Spelling("adam_betas", "[BETA1,BETA2]"),
    "adam_beta2": Spelling("adam_betas", "[BETA1,BETA2]"),
    "optim": Spelling(None, note="the optimizer is AdamW"),
    "max_grad_norm": Spelling("grad_clip"),
    "lr_scheduler_type": Spelling("lr_schedule", note="constant, linear or cosine, decaying to min_lr_ratio"),
    "warmup_steps": Spelling("warmup_steps"),
    "warmup_ratio": Spelling("warmup_steps", note="in steps: warmup_ratio times max_steps"),
    "seed": Spelling("--seed"),
    "data_seed": Spelling(None, note="seed also orders the data"),
    "bf16": Spelling("dtype", "bfloat16", note="bfloat16 compute over float32 master weights"),
    "fp16": Spelling(
        None, note="float16 training needs loss scaling, which gcfamily does not do: use --set dtype=bfloat16"
    ),
    "tf32": Spelling(None, note="float32 matmuls run at torch's default precision"),
    "gradient_checkpointing": Spelling("activation_checkpointing", "true"),
    "logging_steps": Spelling("log_every"),
    "logging_dir": Spelling(None, note="TensorBoard events go to OUTPUT_DIR/tensorboard"),
    "report_to": Spelling("report_to", note="tensorboard, wandb or none; metrics.jsonl is always written"),
    "run_name": Spelling(None, note="the run folder (--output-dir) names the run"),
    "save_steps": Spelling("save_every"),
    "save_strategy": Spelling("save_every", note="a checkpoint every save_every steps and at the end"),
    "save_total_limit": Spelling("keep_last"),
    "eval_strategy": Spelling(
        "eval_every", note="--eval evaluates before and after training, eval_every=N every N steps"
    ),
    "eval_steps": Spelling("eval_every"),
    "do_eval": Spelling("--eval"),
    "eval_on_start": Spelling("--eval"),
    "push_to_hub": Spelling(None, note="the final model is a from_pretrained folder in the output folder"),
    "deepspeed": Spelling(None, note="several processes run with --nproc N and --strategy ddp or fsdp2"),
    "fsdp": Spelling("--strategy", "fsdp2", note="with --nproc N"),
    # --- LoRA (TRL's ModelConfig)
    "use_peft": Spelling("lora_r", "16", note="any rank above 0 turns LoRA on"),
    "lora_r": Spelling("lora_r"),
    "lora_alpha": Spelling("lora_alpha"),
    "lora_dropout": Spelling("lora_dropout"),
    "lora_target_modules": Spelling("lora_target_modules"),
    # --- on-policy sampling and rewards (GRPOConfig)
    "num_generations": Spelling("group_size"),
    "max_completion_length": Spelling("max_new_tokens"),
    "temperature": Spelling("temperature"),
    "top_p": Spelling("top_p"),
    "top_k": Spelling("top_k"),
    "reward_funcs": Spelling("--reward", note="repeat --reward for several"),
    "reward_weights": Spelling("reward_weights"),
    "reward_model_name_or_path": Spelling("--reward-model"),
    "log_completions": Spelling("log_completions_every"),
    "use_vllm": Spelling(
        "rollout",
        "vllm",
        note="colocated in the run's process (TRL's vllm_mode=colocate), the weights pushed and checked after every "
        "optimizer step; TRL's server mode has no equivalent",
    ),
    "vllm_gpu_memory_utilization": Spelling("vllm_gpu_memory"),
    "vllm_importance_sampling_correction": Spelling(
        "tis",
        note="True: tis set to a mode (token_truncate, token_mask, sequence_truncate, sequence_mask); False: tis=off, "
        "gcfamily's default; TRL's default True acts only with use_vllm, in its default mode sequence_mask",
    ),
    "vllm_importance_sampling_mode": Spelling("tis", note="TRL's four mode names, for every on-policy method"),
    "vllm_importance_sampling_clip_max": Spelling(
        "tis_max", note="3.0 by default, as TRL's; TRL's None (no upper bound) has no equivalent: give a large bound"
    ),
    "vllm_importance_sampling_clip_min": Spelling("tis_min", note="none by default (no lower bound), as TRL's"),
    "num_iterations": Spelling("mu"),
    "steps_per_generation": Spelling(
        "num_minibatches", note="a generation split into this many optimizer steps, in order (TRL shuffles first)"
    ),
    "loss_type": Spelling("--method", note="grpo, dr-grpo, dapo, gspo, dpo, ipo, simpo, ... (docs/trl-mapping.md)"),
    "beta": Spelling("beta", note="the KL or preference weight of the methods that have one"),
    "epsilon": Spelling("epsilon"),
    "epsilon_high": Spelling("epsilon_high"),
    "scale_rewards": Spelling("scale_rewards"),
    "mask_truncated_completions": Spelling(
        "mask_truncated", "true", note="of the GRPO family: no token of a truncated completion trains, its reward stays"
    ),
    "multi_objective_aggregation": Spelling(
        "reward_aggregation",
        note="sum_then_normalize (TRL's default) or normalize_then_sum, which needs scale_rewards=batch",
    ),
    "off_policy_mask_threshold": Spelling(
        "off_policy_mask", note="DeepSeek-V3.2's off-policy sequence mask, on every clipped on-policy rule"
    ),
    "sync_ref_model": Spelling("ref_refresh_every", note="a fresh reference every ref_refresh_every steps"),
    "ref_model_sync_steps": Spelling("ref_refresh_every"),
    "ref_model_mixup_alpha": Spelling(
        "ref_mixup_alpha", note="pi_ref <- alpha * policy + (1 - alpha) * pi_ref at each refresh"
    ),
    "label_smoothing": Spelling(
        "label_smoothing", note="of --method robust-dpo (TRL's robust) and exo-pair; --method cdpo is Mitchell's cDPO"
    ),
    "f_divergence_type": Spelling(
        "f_divergence",
        note="reverse_kl, forward_kl, js_divergence or alpha_divergence, of dpo and the losses TRL shapes",
    ),
    "f_alpha_divergence_coef": Spelling("f_alpha"),
    "ld_alpha": Spelling("ld_alpha", note="LD-DPO's weight of the tokens past the pair's shorter completion"),
    "discopop_tau": Spelling("discopop_tau", note="of --method discopop"),
    "simpo_gamma": Spelling("simpo_gamma", note="of --method simpo"),
    "use_weighting": Spelling(
        None,
        note="WPO's weights need each position's sum of squared probabilities over the vocabulary, which the engine "
        "does not compute",
    ),
    "loss_weights": Spelling(None, note="see docs/trl-mapping.md"),
}
"""TRL argument -> gcfamily's spelling."""


def sentence(name: str, shown: str) -> str | None:
    """One sentence for TRL argument `name` as the user wrote it (`shown`: "--learning_rate" or "setting
    'learning_rate'"); None when `name` is not in the table."""
    s = TRL_NAMES.get(name)
    if s is None:
        return None
    if s.target is None and s.always:
        return f"{shown} is TRL's name, and gcfamily has no setting for it because it always does this: {s.note}."
    if s.target is None:
        return f"{shown} is TRL's name, and gcfamily has no equivalent" + (f": {s.note}." if s.note else ".")
    spelled = s.spelled()
    return f"{shown} is TRL's name; gcfamily spells it {spelled}" + (
        f" ({s.note})." if s.note else "" if spelled.endswith("...") else "."
    )


def markdown_table() -> str:
    """The table docs/trl-mapping.md holds, row for row."""
    lines = ["| TRL / transformers | gcfamily | |", "|---|---|---|"]
    for name, s in TRL_NAMES.items():
        gcf = f"`{s.spelled()}`" if s.target is not None else "always on (no setting)" if s.always else "no equivalent"
        lines.append(f"| `{name}` | {gcf} | {s.note} |")
    return "\n".join(lines)
