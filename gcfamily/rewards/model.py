"""The learned reward model r_phi(q, o): a transformer with a scalar head, trained on preference pairs.

Bradley-Terry (Bradley & Terry 1952; the RLHF reward model of Ouyang et al. 2022, section 3.5):

    P(o_w > o_l | q) = sigmoid(r(q, o_w) - r(q, o_l)),   loss = -log sigmoid(r(q, o_w) - r(q, o_l))

The score of (q, o) is the head applied to the hidden state of the last real token (the completion's
EOS), so one forward scores a whole sequence. On disk a reward model is a Hugging Face
`*ForSequenceClassification` checkpoint with `num_labels = 1` (config.json, model.safetensors and the
tokenizer): `RewardModel.load` needs only transformers, and such folders made elsewhere (TRL's
RewardTrainer) load too. Scores are read here at the last attended token, which is the same token
Hugging Face picks for right-padded rows whose pad differs from EOS.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gcfamily.core.engine import position_ids_from_mask
from gcfamily.data.batches import default_pad_id
from gcfamily.data.encoding import Formatter
from gcfamily.errors import GcfError


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_w - r_l) per pair [P]."""
    return -F.logsigmoid(chosen - rejected)


class RewardModel(nn.Module):
    """r_phi(q, o): backbone + scalar head on the last real token; `score` and `reward_fn` for on-policy methods."""

    def __init__(self, model: nn.Module, tokenizer: Any, max_length: int = 1024) -> None:
        super().__init__()
        self.model = model  # a *ForSequenceClassification with num_labels = 1
        self.tokenizer = tokenizer
        self.max_length = max_length
        head = self.head
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise GcfError(
                f"{type(model).__name__} has no scalar `score` head; a reward model needs a *ForSequenceClassification with num_labels=1."
            )

    @property
    def backbone(self) -> nn.Module:
        """The transformer under the head (returns hidden states)."""
        return getattr(self.model, self.model.base_model_prefix)

    @property
    def head(self) -> nn.Module:
        """The scalar head: `score` in most Hugging Face classes, `classifier` in some."""
        return getattr(self.model, "score", None) or getattr(self.model, "classifier", None)

    # -- building, saving, loading ---------------------------------------------------
    @classmethod
    def from_causal_lm(cls, policy: nn.Module, tokenizer: Any, max_length: int = 1024) -> "RewardModel":
        """A reward model seeded with a causal LM's backbone (a copy) and a zero head: r = 0 on every input at the start."""
        from transformers import AutoModelForSequenceClassification

        config = copy.deepcopy(policy.config)
        config.num_labels, config.architectures = 1, None
        config.pad_token_id = default_pad_id(tokenizer)
        param = next(policy.parameters())
        model = AutoModelForSequenceClassification.from_config(config)
        getattr(model, model.base_model_prefix).load_state_dict(policy.get_decoder().state_dict())
        rm = cls(model.to(device=param.device, dtype=param.dtype), tokenizer, max_length)
        nn.init.zeros_(rm.head.weight)  # both sides of a pair score 0: the loss starts at log 2, accuracy at chance
        return rm

    def save(self, out_dir: str | Path) -> None:
        """config.json + model.safetensors + tokenizer, loadable with `RewardModel.load` or transformers alone."""
        out = Path(out_dir)
        self.model.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        (out / "reward_model.json").write_text(
            json.dumps({"kind": "bradley-terry", "score": "last real token", "max_length": self.max_length}, indent=2)
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: Optional[torch.dtype] = None,
        trust_remote_code: bool = False,
    ) -> "RewardModel":
        """A saved reward model, frozen, in eval mode; a folder that is not one is a clear error. A folder that ships its
        own code (auto_map) is refused unless trust_remote_code (every load passes the flag: transformers never prompts)."""
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        p = Path(path)
        if not (p / "config.json").is_file():
            raise GcfError(
                f"Reward model folder {path} has no config.json; pass the output folder of `gcf run --method reward-model`."
            )
        from gcfamily.models import check_source, refuse_remote_code

        check_source(str(p))  # a damaged config or weights, or pickle weights (never unpickled): one sentence
        refuse_remote_code(str(p), trust_remote_code, "Reward model folder")
        try:
            config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise GcfError(
                f"Reward model folder {path} has an unreadable config.json ({str(e).splitlines()[0][:160]})."
            ) from e
        archs = getattr(config, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in archs) or config.num_labels != 1:
            raise GcfError(
                f"{path} is not a reward model (architectures {archs}, num_labels {config.num_labels}); train one with `gcf run --method reward-model`."
            )
        try:
            tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                p,
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                **({"dtype": dtype} if dtype is not None else {}),
            )
        except (OSError, ValueError, RuntimeError) as e:
            raise GcfError(f"Reward model folder {path} could not be loaded ({str(e).splitlines()[0][:200]}).") from e
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        meta = p / "reward_model.json"
        max_length = int(json.loads(meta.read_text()).get("max_length", 1024)) if meta.is_file() else 1024
        rm = cls(model.to(device), tok, max_length)
        rm.eval().requires_grad_(False)
        return rm

    # -- scoring ---------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores [B] (float32) of padded rows, read at each row's last attended token."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # [B, L, H]
        L = attention_mask.shape[1]
        last = (attention_mask.long() * torch.arange(L, device=attention_mask.device)).argmax(-1)  # [B]
        h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
        return self.head(h).squeeze(-1).float()

    def encode(self, prompt: Any, completion: str) -> list[int]:
        """Prompt + completion as in training (encoding.Formatter at the default chat_format); the end is kept if too long (the score reads it)."""
        fmt = Formatter(self.tokenizer)
        ids = fmt.prompt_ids(prompt) + fmt.completion_ids(prompt, completion)
        return ids[-self.max_length :]

    @torch.inference_mode()
    def score_ids(self, sequences: Sequence[list[int]], batch_size: int = 16) -> list[float]:
        """Scores of token-id sequences, length-sorted into right-padded batches."""
        device = self.head.weight.device
        pad = default_pad_id(self.tokenizer)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = [0.0] * len(sequences)
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            L = max(len(sequences[i]) for i in idx)
            ids = torch.full((len(idx), L), pad, dtype=torch.long)  # [b, L]
            mask = torch.zeros(len(idx), L, dtype=torch.long)  # [b, L]
            for b, i in enumerate(idx):
                ids[b, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[b, : len(sequences[i])] = 1
            for i, v in zip(idx, self(ids.to(device), mask.to(device)).cpu().tolist()):
                out[i] = float(v)
        return out

    def score(self, prompts: Sequence[Any], completions: Sequence[str], batch_size: int = 16) -> list[float]:
        """r(q, o) for each (prompt, completion), batched, without grad."""
        if len(prompts) != len(completions):
            raise GcfError(
                f"got {len(prompts)} prompts for {len(completions)} completions; pass one prompt per completion."
            )
        was_training = self.training
        self.eval()
        try:
            return self.score_ids([self.encode(p, c) for p, c in zip(prompts, completions)], batch_size)
        finally:
            self.train(was_training)

    def reward_fn(self, batch_size: int = 16) -> Any:
        """A reward function fn(prompts, completions, **columns) -> list[float]; a completion may be a message list."""

        from gcfamily.rewards.verifiable import completion_text

        def reward_model(prompts: list, completions: list, **columns: Any) -> list[float]:
            # conversational: the message's text
            return self.score(prompts, [completion_text(c) for c in completions], batch_size)

        return reward_model


def load_reward_model(
    path: str,
    device: str | torch.device = "cpu",
    dtype: Optional[torch.dtype] = None,
    batch_size: int = 16,
    trust_remote_code: bool = False,
) -> Any:
    """`--reward-model DIR` as a reward function: the saved model, frozen, scoring in batches."""
    return RewardModel.load(path, device, dtype, trust_remote_code).reward_fn(batch_size)
