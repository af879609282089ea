"""A rollout backend: what every sampling path of a run calls, whichever engine draws the samples.

    backend = build_backend("native", model, tokenizer)      # once per run (or per evaluation outside one)
    ro = backend.generate(prompt_ids, G, sampling, generator) # Rollout: completion ids and masks, the sampled
                                                              #   tokens' log-probs, and why each completion ended
    backend.weights_changed()                                 # after every optimizer step that moved the policy
    backend.close()                                           # at the end of the run

`Rollout.ended_by` says why each completion ended: "eos", "stop" (a stop string) or "length" (max_new_tokens). The
native backend samples the live policy itself (rollout/native.py), so a weight change needs nothing and its log-probs
are the trainer's; an engine that holds its own copy of the weights (vLLM) must take the new weights in
`weights_changed` and check them. A method never knows which backend runs: it samples through Services.generate.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

import torch

from gcfamily.errors import GcfError
from gcfamily.rollout import native
from gcfamily.rollout.native import Rollout
from gcfamily.rollout.sampling import SamplingSettings
from gcfamily.rollout.vllm_engine import VllmBackend, VllmOptions


@runtime_checkable
class RolloutBackend(Protocol):
    """The interface every engine implements (module docstring)."""

    name: ClassVar[str]

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingSettings,
        generator: Optional[torch.Generator] = None,
    ) -> Rollout:
        """`group_size` completions of each prompt (token ids, unpadded), prompt i's at rows i*G .. i*G+G-1."""
        ...

    def weights_changed(self) -> None:
        """The policy's weights moved (an optimizer step): sample from the new ones from now on."""
        ...

    def close(self) -> None:
        """Free what the backend holds; it is not used again."""
        ...


class NativeBackend:
    """gcfamily's own KV-cached sampler over the live policy (rollout/native.py): no copy of the weights, so nothing
    to push when they change, and the sampled tokens' log-probs are the policy's own."""

    name: ClassVar[str] = "native"

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.model: Optional[torch.nn.Module] = model
        self.tokenizer = tokenizer

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingSettings,
        generator: Optional[torch.Generator] = None,
    ) -> Rollout:
        if self.model is None:
            raise GcfError("This rollout backend was closed; build a new one to sample again.")
        return native.generate(self.model, self.tokenizer, prompt_ids, group_size, sampling, generator)

    def weights_changed(self) -> None:
        """Nothing: the native sampler reads the policy's parameters themselves."""

    def close(self) -> None:
        self.model = None


BACKENDS: dict[str, type] = {"native": NativeBackend, "vllm": VllmBackend}
"""The engines a run can sample with, by the run's `rollout` setting."""


def build_backend(
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    options: Optional[VllmOptions] = None,
    trainer_logps: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> RolloutBackend:
    """The backend `name` over `model`; an unknown name is one sentence naming the known ones. An engine with its own
    copy of the weights (vllm) takes the run's `options` and `trainer_logps(ids [1, L]) -> [1, L]`, the trainer's own
    log-probs, against which it checks every weight push."""
    if name not in BACKENDS:
        raise GcfError(f"Unknown rollout backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}.")
    if name == "native":
        return NativeBackend(model, tokenizer)
    if trainer_logps is None:
        raise GcfError(
            f"The {name} rollout backend checks its weights against the trainer's log-probs; pass trainer_logps."
        )
    return BACKENDS[name](model, tokenizer, options or VllmOptions(), trainer_logps)
