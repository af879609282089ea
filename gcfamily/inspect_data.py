"""`gcf data`: what a method will train on, exactly as tokenised.

It runs the method's own path (the same loader, `Method.task_rows`, `encoding.encode` and Formatter
the trainer uses) on the tokenizer alone, and prints: the source, the format found and the chat
format taken; rows kept and skipped, and why; the token length distribution; and the first rows
decoded piece by piece, with every trained (loss) span between [[ and ]].
"""

from __future__ import annotations

from typing import Any

from gcfamily.errors import GcfError


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of --model, without loading its weights."""
    from gcfamily.models import refuse_remote_code, resolve_source, tiny_tokenizer

    if name == "tiny":
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    source = resolve_source(name)
    refuse_remote_code(source, trust_remote_code)  # transformers would otherwise prompt on stdin
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise GcfError(
            f"The tokenizer of {name} ({source}) could not be loaded ({str(e).splitlines()[0][:160]})."
        ) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def marked(tokenizer: Any, ids: list[int], mask: list[int]) -> str:
    """ids decoded span by span, the spans where mask is 1 between [[ and ]]."""
    out, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or mask[j] != mask[start]:
            text = tokenizer.decode(ids[start:j], skip_special_tokens=False)
            out.append(f"[[{text}]]" if mask[start] else text)
            start = j
    return "".join(out)


def _quantiles(values: list[int]) -> str:
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
    return f"min {v[0]}, median {pick(0.5)}, p90 {pick(0.9)}, max {v[-1]} tokens"


def describe(cfg: Any, n_rows: int = 3) -> str:
    """The report `gcf data` prints for a resolved Config."""
    from gcfamily.data.encoding import Formatter, encode
    from gcfamily.data.formats import FORMATS
    from gcfamily.data.sources import load_rows
    from gcfamily.methods import get_method

    cls = get_method(cfg.method)
    if not cls.data_kind:
        raise GcfError(
            f"Method {cfg.method} reads no dataset of its own (data_kind is empty), so there is nothing to show."
        )
    tok = load_tokenizer(cfg.model, cfg.trust_remote_code)
    fmt = Formatter(tok, cfg.chat_format, cfg.system_prompt, cfg.assistant_only_loss, cfg.chat_template)
    if cfg.dataset:
        rows = load_rows(cfg.dataset, cfg.dataset_split, cfg.dataset_config, cfg.columns)
        source = (
            f"dataset {cfg.dataset}"
            + (f" (config {cfg.dataset_config})" if cfg.dataset_config else "")
            + f", split {cfg.dataset_split}"
        )
    elif cfg.task:
        from gcfamily.tasks import get_task

        rows = cls.task_rows(get_task(cfg.task, seed=cfg.seed, **cfg.task_options), cfg)
        source = f"task {cfg.task} (train split, as {cfg.method} makes its rows)"
    else:
        raise GcfError("gcf data needs --dataset or --task.")
    enc = encode(cls.data_kind, rows, fmt, cfg.max_length, cfg.long_prompts, cfg.method)
    lines = [
        f"{cfg.method} reads {cls.data_kind}: {source}",
        f"format: {FORMATS[enc.format]}, {'conversational' if enc.conversational else 'standard (strings)'}; "
        f"chat_format={cfg.chat_format} -> {enc.mode}"
        + (f"; system_prompt={cfg.system_prompt!r}" if cfg.system_prompt is not None else ""),
        f"rows: {len(rows)} read, {len(enc.examples)} kept, {enc.n_skipped} skipped"
        + "".join(f"\n  skipped {n}: {why}" for why, n in enc.skipped.items()),
    ]
    lengths, trained = _lengths(enc)
    lines.append(
        f"lengths: {_quantiles(lengths)}" + (f"; trained tokens per row: {_quantiles(trained)}" if trained else "")
    )
    lines.append(
        "trained (loss) tokens are between [[ and ]]"
        if enc.kind != "prompts"
        else "prompts only: the completions are sampled by the policy"
    )
    for i, (row, ex) in enumerate(zip(enc.rows[:n_rows], enc.examples[:n_rows])):
        lines.append(f"--- row {i}")
        lines.extend(_show(tok, enc.kind, row, ex))
    return "\n".join(lines)


def _lengths(enc: Any) -> tuple[list[int], list[int]]:
    if enc.kind == "demonstrations":
        return [len(ids) for ids, _ in enc.examples], [sum(m[1:]) for _, m in enc.examples]
    if enc.kind == "prompts":
        return [len(p) for p in enc.examples], []
    if enc.kind == "pairs":
        return [len(p) + max(len(c), len(r)) for p, c, r in enc.examples], [len(c) + len(r) for _, c, r in enc.examples]
    return [len(p) + len(c) for p, c in enc.examples], [len(c) for _, c in enc.examples]


def _show(tok: Any, kind: str, row: dict[str, Any], ex: Any) -> list[str]:
    if kind == "demonstrations":
        ids, mask = ex
        return [f"({len(ids)} tokens, {sum(mask[1:])} trained)", marked(tok, ids, mask)]
    if kind == "prompts":
        cols = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
        return [
            f"({len(ex)} prompt tokens; columns given to the rewards: {cols})",
            tok.decode(ex, skip_special_tokens=False),
        ]
    if kind == "pairs":
        p, c, r = ex
        return [
            f"chosen ({len(p)} + {len(c)} tokens):",
            marked(tok, p + c, [0] * len(p) + [1] * len(c)),
            f"rejected ({len(p)} + {len(r)} tokens):",
            marked(tok, p + r, [0] * len(p) + [1] * len(r)),
        ]
    p, c = ex
    return [
        f"label {'desirable' if row['label'] else 'undesirable'} ({len(p)} + {len(c)} tokens):",
        marked(tok, p + c, [0] * len(p) + [1] * len(c)),
    ]
