"""Rows in a TRL format (data/formats.py) to exact token ids and loss masks: the Formatter and `encode`.

Tokens (`Formatter`): `chat_format` chat renders rows through the tokenizer's chat template (a
string prompt is a user message, a string completion an assistant message); raw tokenises the
strings as they are (TRL's standard rows): the prompt with the tokenizer's special tokens, the
completion without, then EOS. auto is chat for conversational rows, and for string rows when the
tokenizer has a chat template (an instruct model), raw otherwise. In chat mode a completion's
tokens are the conversation's tokens after the prompt's (rendered with the generation prompt),
which the template must reproduce as a prefix (else the row is refused: its tokens could not be
told apart exactly), ending at the template's last EOS (EOS is appended if the template ends a
turn without it). `text` rows train every token but the first; `messages` rows train every
assistant turn (`assistant_only_loss`, default) or every token.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from gcfamily.core.deadline import Overtime, within
from gcfamily.data.formats import CHAT_FORMATS, Messages, Text, as_kind, is_conversational
from gcfamily.errors import GcfError

RENDER_S = 10.0
"""Seconds one conversation may take to render: jinja's sandbox bounds each loop's range, not the work of loops nested
(two loops of 99,999 render for ever); a real template renders in milliseconds."""


def _template_error(e: Exception, given: bool) -> GcfError:
    why = str(e).splitlines()[0][:160] if str(e).strip() else type(e).__name__
    fix = (
        "fix the chat_template setting"
        if given
        else "fix the row's messages, or pass a chat_template that renders them"
    )
    return GcfError(f"The chat template failed to render a conversation ({why}); {fix}.")


class Formatter:
    """Token ids of prompts, completions and conversations under the run's chat_format (module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        chat_format: str = "auto",
        system_prompt: Optional[str] = None,
        assistant_only_loss: bool = True,
        chat_template: Optional[str] = None,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> None:
        if chat_format not in CHAT_FORMATS:
            raise GcfError(f"chat_format must be auto, chat or raw (got {chat_format!r}).")
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.system_prompt = system_prompt
        self.assistant_only_loss = assistant_only_loss
        self.template_given = bool(chat_template)
        if chat_template:
            path = Path(chat_template).expanduser()
            text = (
                path.read_text()
                if len(chat_template) < 4096 and "{" not in chat_template and path.is_file()
                else chat_template
            )
            if "{" not in text:
                raise GcfError(f"chat_template {chat_template!r} is neither an existing file nor a Jinja template.")
            tokenizer.chat_template = text
        self.eos = tokenizer.eos_token_id
        self.tools = tools  # an environment's tool schemas, for templates that render tools (tools=...)

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def uses_chat(self, conversational: bool) -> bool:
        """Whether rows of this form go through the chat template."""
        if conversational and self.chat_format == "raw":
            raise GcfError(
                "chat_format=raw takes string rows, but this dataset is conversational (message lists); use chat_format=auto or chat."
            )
        chat = conversational or self.chat_format == "chat" or (self.chat_format == "auto" and self.has_template)
        if chat and not self.has_template:
            raise GcfError(
                "The model's tokenizer has no chat template, so conversational rows (or chat_format=chat) cannot be rendered; "
                "pass chat_template (a Jinja string or file), or use string rows with chat_format=raw."
            )
        return chat

    def mode(self, conversational: bool) -> str:
        return "chat" if self.uses_chat(conversational) else "raw"

    # -- pieces
    def _render(self, messages: Messages, generation_prompt: bool, tokenize: bool = True) -> Any:
        extra = {"tools": self.tools} if self.tools else {}
        try:
            with within(RENDER_S):
                ids = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=generation_prompt, tokenize=tokenize, **extra
                )
        except Overtime as e:
            fix = (
                "fix the chat_template setting" if self.template_given else "pass a chat_template that renders quickly"
            )
            raise GcfError(
                f"The chat template did not finish rendering one conversation within {RENDER_S:g} s (loops nested past "
                f"any real template's work); {fix}."
            ) from e
        except Exception as e:  # jinja's TemplateError, the sandbox's SecurityError, a template's raise_exception
            raise _template_error(e, self.template_given) from e
        if not tokenize:
            return ids
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _with_system(self, messages: Messages) -> Messages:
        if self.system_prompt is None or (messages and messages[0]["role"] == "system"):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def _raw(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _end_at_eos(self, ids: list[int]) -> list[int]:
        """A completion up to and including its last EOS; EOS appended where there is none."""
        if self.eos in ids:
            return ids[: len(ids) - ids[::-1].index(self.eos)]
        return ids + [self.eos]

    # -- what methods call
    def prompt_ids(self, prompt: Text) -> list[int]:
        """Token ids of a prompt: the template with the generation prompt, or the raw string with special tokens."""
        if self.uses_chat(isinstance(prompt, list)):
            msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return self._render(self._with_system(msgs), True)
        return self._raw(prompt, True)  # type: ignore[arg-type]

    def completion_ids(self, prompt: Text, completion: Text, i: int = 0) -> list[int]:
        """Token ids of a completion that follow the prompt's ids, EOS-ended."""
        if not self.uses_chat(isinstance(prompt, list)):
            return self._raw(completion, False) + [self.eos]  # type: ignore[arg-type]
        p_msgs = self._with_system(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        c_msgs = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        p, full = self._render(p_msgs, True), self._render(p_msgs + c_msgs, False)
        if full[: len(p)] != p or len(full) == len(p):
            raise GcfError(
                f"Row {i}: the chat template does not render the prompt as the start of the whole conversation, so the "
                "completion's tokens cannot be told apart exactly; use chat_format=raw or a chat_template that keeps earlier turns."
            )
        return self._end_at_eos(full[len(p) :])

    def observation_ids(self, prompt: Text, observation: str, role: str, after_eos: bool) -> list[int]:
        """The tokens between a policy turn's last sampled token and the next turn's first: in chat mode, what the
        template writes after an assistant turn, an `role` message holding `observation`, and the generation prompt
        (the turn's end-of-turn token left out where the policy sampled it: `after_eos`); in raw mode the observation
        as it is. The policy's own tokens are never re-tokenised: an episode trains on exactly what was sampled."""
        if not self.uses_chat(isinstance(prompt, list)):
            return self._raw(observation, False)
        mark = "\u27e6gcf-turn\u27e7"  # stands for the policy's turn, whose tokens are already in the episode
        msgs = self._with_system(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        text = self._render(
            [*msgs, {"role": "assistant", "content": mark}, {"role": role, "content": observation}], True, False
        )
        at = text.rfind(mark)
        if at < 0 or observation not in text[at:]:
            raise GcfError(
                f"The chat template does not render a '{role}' message after an assistant turn, so an environment's answer "
                "cannot be placed; pass a chat_template that renders that role, or an environment whose role it renders."
            )
        tail = text[at + len(mark) :]
        eos_text = self.tokenizer.eos_token or ""
        if after_eos and eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text) :]
        return self._raw(tail, False)

    def pair(self, prompt: Text, completion: Text, i: int = 0) -> tuple[list[int], list[int]]:
        return self.prompt_ids(prompt), self.completion_ids(prompt, completion, i)

    def demonstration(self, row: dict[str, Any], i: int = 0) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a language-modeling or prompt-completion row."""
        if "text" in row:
            ids = self._raw(row["text"], True)
            ids = ids if ids[-1:] == [self.eos] else ids + [self.eos]
            return ids, [0] + [1] * (len(ids) - 1)
        if "messages" in row:
            return self.conversation(row["messages"], i)
        p, c = self.pair(row["prompt"], row["completion"], i)
        return p + c, [0] * len(p) + [1] * len(c)

    def conversation(self, messages: Messages, i: int = 0) -> tuple[list[int], list[int]]:
        """(ids, mask) of a whole conversation: every assistant turn trained (assistant_only_loss), or every token."""
        self.uses_chat(True)
        msgs = self._with_system(messages)
        full = self._render(msgs, False)
        if not self.assistant_only_loss:
            return full, [0] + [1] * (len(full) - 1)
        mask = [0] * len(full)
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = self._render(msgs[:k], True) if k else []
            upto = self._render(msgs[: k + 1], False)
            if upto[: len(before)] != before or full[: len(upto)] != upto:
                raise GcfError(
                    f"Row {i}: the chat template renders earlier turns differently once later ones follow, so assistant turn {k} "
                    "cannot be located exactly; set assistant_only_loss=false or pass a chat_template that keeps earlier turns."
                )
            span = self._end_at_eos(upto[len(before) :]) if self.eos in upto[len(before) :] else upto[len(before) :]
            for j in range(len(before), len(before) + len(span)):
                mask[j] = 1
        if not any(mask[1:]):
            raise GcfError(
                f"Row {i}: the conversation has no assistant message to train on (assistant_only_loss=true)."
            )
        return full, mask


# --------------------------------------------------------------------------- encoding a dataset


@dataclass
class Encoded:
    """A method's data as token ids: examples, the rows they came from, and what was skipped and why."""

    kind: str
    format: str
    conversational: bool
    mode: str
    examples: list[Any] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


def encode(
    kind: str,
    rows: Sequence[dict[str, Any]],
    fmt: Formatter,
    max_length: int,
    long_prompts: str = "skip",
    method: str = "this method",
) -> Encoded:
    """Check, convert and tokenise rows for a kind of data (module docstring); long prompts skipped and counted, or refused.

    Examples: demonstrations (ids, mask); prompts: prompt ids; pairs: (prompt, chosen, rejected) ids; labelled: (prompt, completion) ids.
    """
    form, checked = as_kind(rows, kind, method)
    conv = is_conversational(checked[0])
    # text rows are tokenised as written
    out = Encoded(kind, form, conv, "raw" if "text" in checked[0] else fmt.mode(conv))
    same = 0  # pairs whose chosen and rejected are the same tokens (within max_length): no gradient from them
    for i, row in enumerate(checked):
        if kind == "demonstrations":
            ids, mask = fmt.demonstration(row, i)
            if "prompt" in row and mask.index(1) >= max_length:
                if _long(out, long_prompts, i, mask.index(1), max_length):
                    continue
            ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask[1:]):
                out.skipped["no trained token within max_length"] += 1
                continue
            out.examples.append((ids, mask))
        else:
            p = fmt.prompt_ids(row["prompt"])
            if len(p) >= max_length and _long(out, long_prompts, i, len(p), max_length):
                continue
            room = max_length - len(p)
            if kind == "prompts":
                out.examples.append(p)
            elif kind == "pairs":
                chosen = fmt.completion_ids(row["prompt"], row["chosen"], i)[:room]
                rejected = fmt.completion_ids(row["prompt"], row["rejected"], i)[:room]
                same += chosen == rejected
                out.examples.append((p, chosen, rejected))
            else:
                out.examples.append((p, fmt.completion_ids(row["prompt"], row["completion"], i)[:room]))
        out.rows.append(row)
    if not out.examples:
        raise GcfError(
            f"No row of the data is usable for {method} ({'; '.join(f'{n} {why}' for why, n in out.skipped.items())}); raise max_length."
        )
    if same and same == len(out.examples):
        raise GcfError(
            f"Every one of the {same} preference pairs has chosen equal to rejected (within max_length={max_length} "
            f"tokens), so {method} has nothing to learn from them; check the chosen and rejected columns."
        )
    if same:  # each such pair scores log 2 and contributes no gradient: most likely a data bug, so say so once
        print(
            f"warning: {same} of {len(out.examples)} preference pairs have chosen equal to rejected (within "
            f"max_length={max_length} tokens); they add no gradient.",
            file=sys.stderr,
        )
    return out


def _long(out: Encoded, long_prompts: str, i: int, n: int, max_length: int) -> bool:
    """Count a prompt of n >= max_length tokens as skipped (True), or refuse it."""
    if long_prompts == "error":
        raise GcfError(
            f"Row {i}: the prompt has {n} tokens, at least max_length={max_length}; raise max_length or set long_prompts=skip."
        )
    out.skipped[f"prompt of max_length={max_length} tokens or more"] += 1
    return True
