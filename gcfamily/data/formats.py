"""TRL's dataset formats in, exact token ids and loss masks out.

Formats, told apart by their columns (standard rows hold strings, conversational rows lists of
`{role, content}` messages):

| format | columns |
|---|---|
| language-modeling | `text`, or `messages` |
| prompt-only | `prompt` |
| prompt-completion | `prompt`, `completion` |
| preference | `prompt`, `chosen`, `rejected`; or `chosen`, `rejected` with an implicit prompt |
| unpaired-preference | `prompt`, `completion`, `label` |

A method reads one kind of data (`Method.data_kind`), and each kind takes some formats:

| kind | methods | formats |
|---|---|---|
| demonstrations | sft | language-modeling, prompt-completion |
| prompts | rft, grpo, ppo and every on-policy method | prompt-only, prompt-completion (the completion is not given to rewards) |
| pairs | dpo, ipo, cdpo, simpo, orpo, reward-model | preference |
| labelled | kto | unpaired-preference, preference (each pair split into a desirable and an undesirable row) |

Any other pairing is one sentence naming the format found and the formats the method takes.

How rows become token ids and loss masks is data/encoding.py's.
"""

from __future__ import annotations

from typing import Any, Sequence

from gcfamily.errors import GcfError

FORMATS = {
    "language-modeling": "language-modeling (text or messages)",
    "prompt-only": "prompt-only (prompt)",
    "prompt-completion": "prompt-completion (prompt, completion)",
    "preference": "preference (prompt, chosen, rejected; or chosen, rejected with an implicit prompt)",
    "unpaired-preference": "unpaired-preference (prompt, completion, label)",
}
KINDS = {
    "demonstrations": ("language-modeling", "prompt-completion"),
    "prompts": ("prompt-only", "prompt-completion"),
    "pairs": ("preference",),
    "labelled": ("unpaired-preference", "preference"),
}
CHAT_FORMATS = ("auto", "chat", "raw")
_TEXT_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "text")

Messages = list[dict[str, str]]
Text = str | Messages


# --------------------------------------------------------------------------- formats


def detect(row: dict[str, Any]) -> str:
    """The TRL format of a row, by its columns; a row that is none of them is one sentence."""
    keys = set(row)
    if {"chosen", "rejected"} <= keys:
        return "preference"
    if {"completion", "label"} <= keys:
        return "unpaired-preference"
    if {"prompt", "completion"} <= keys:
        return "prompt-completion"
    if "prompt" in keys:
        return "prompt-only"
    if "messages" in keys or "text" in keys:
        return "language-modeling"
    raise GcfError(
        f"The rows have columns {', '.join(sorted(keys))}, which are none of TRL's formats "
        f"({'; '.join(FORMATS.values())}); map yours with --set columns='{{prompt: question}}'."
    )


def is_conversational(row: dict[str, Any]) -> bool:
    """Whether a row's text columns are message lists (TRL's conversational form)."""
    return any(isinstance(row.get(k), list) for k in _TEXT_COLUMNS)


def check_format(fmt: str, kind: str, method: str) -> None:
    """Refuse a format the method's kind of data cannot use, naming what it takes."""
    if fmt not in KINDS[kind]:
        takes = " or ".join(FORMATS[f] for f in KINDS[kind])
        raise GcfError(f"{method} cannot train on {FORMATS[fmt]} rows; it takes {takes} rows.")


def _messages(v: Any, col: str, i: int) -> Messages:
    if not (
        isinstance(v, list)
        and v
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)
    ):
        raise GcfError(
            f"Row {i}: '{col}' must be a string or a non-empty list of {{role, content}} messages with text content."
        )
    return [{"role": m["role"], "content": m["content"]} for m in v]


def _text(v: Any, col: str, i: int, messages_ok: bool = True) -> Text:
    """A non-empty string (numbers written out) or, where allowed, a message list; else one sentence naming the row."""
    if isinstance(v, list) and messages_ok:
        return _messages(v, col, i)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str) or not v.strip():
        # a file-backed dataset fills a column absent from one row with None, so both read alike
        raise GcfError(
            f"Row {i} has a missing or empty '{col}'; it needs a non-empty {'text or message list' if messages_ok else 'text'}."
        )
    return v


def _same_form(i: int, **cols: Text) -> None:
    kinds = {k: isinstance(v, list) for k, v in cols.items()}
    if len(set(kinds.values())) > 1:
        forms = ", ".join(f"{k}: {'messages' if m else 'string'}" for k, m in kinds.items())
        raise GcfError(f"Row {i} mixes strings and message lists ({forms}); use one form per row.")


def implicit_prompt(chosen: Text, rejected: Text, i: int) -> tuple[Text, Text, Text]:
    """(prompt, chosen, rejected) of a row without a prompt: the part both start with (TRL's extract_prompt)."""
    if isinstance(chosen, list):
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        if k == 0:
            raise GcfError(
                f"Row {i}: chosen and rejected share no first messages, so no prompt can be taken from them; add a 'prompt' column."
            )
        return chosen[:k], chosen[k:], rejected[k:]
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if 0 < k and chosen[k - 1] == " ":
        k -= 1  # the space starts the completion, as in TRL
    if k == 0 or k == len(chosen) or k == len(rejected):
        raise GcfError(
            f"Row {i}: chosen and rejected do not start with a shared prompt followed by different completions; add a 'prompt' column."
        )
    return chosen[:k], chosen[k:], rejected[k:]


def _label(v: Any, i: int) -> bool:
    if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
        return bool(v)
    if not isinstance(v, bool):
        raise GcfError(f"Row {i} needs a boolean 'label' (true: desirable, false: undesirable); it has {v!r}.")
    return v


def normalize(row: dict[str, Any], fmt: str, i: int) -> dict[str, Any]:
    """A row of format fmt with its text columns checked (and an implicit prompt made explicit); other columns kept."""
    extra = {k: v for k, v in row.items() if k not in (*_TEXT_COLUMNS, "label")}
    if fmt == "language-modeling":
        if row.get("messages") is not None:
            return {**extra, "messages": _messages(row["messages"], "messages", i)}
        return {**extra, "text": _text(row.get("text"), "text", i, messages_ok=False)}
    prompt = row.get("prompt")
    if fmt == "preference":
        chosen, rejected = _text(row.get("chosen"), "chosen", i), _text(row.get("rejected"), "rejected", i)
        _same_form(i, chosen=chosen, rejected=rejected)
        if prompt is None:
            prompt, chosen, rejected = implicit_prompt(chosen, rejected, i)
        prompt = _text(prompt, "prompt", i)
        _same_form(i, prompt=prompt, chosen=chosen)
        return {**extra, "prompt": prompt, "chosen": chosen, "rejected": rejected}
    out = {**extra, "prompt": _text(prompt, "prompt", i)}
    if fmt in ("prompt-completion", "unpaired-preference"):
        out["completion"] = _text(row.get("completion"), "completion", i)
        _same_form(i, prompt=out["prompt"], completion=out["completion"])
    if fmt == "unpaired-preference":
        out["label"] = _label(row.get("label"), i)
    return out


def as_kind(rows: Sequence[dict[str, Any]], kind: str, method: str) -> tuple[str, list[dict[str, Any]]]:
    """(format, checked rows) for a method's kind of data; KTO's labelled rows from preference pairs, split."""
    if not rows:
        raise GcfError(f"{method} got no rows.")
    fmt = detect(rows[0])
    check_format(fmt, kind, method)
    out = []
    for i, row in enumerate(rows):
        if detect(row) != fmt:
            raise GcfError(
                f"Row {i} is {FORMATS[detect(row)]}, unlike row 0 ({FORMATS[fmt]}); use one format per dataset."
            )
        out.append(normalize(row, fmt, i))
    if kind == "labelled" and fmt == "preference":
        out = [
            {"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in out
            for k in ("chosen", "rejected")
        ]
    return fmt, out
