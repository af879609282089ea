"""TRL's dataset formats in, exact token ids and loss masks out (gcfamily/data/formats.py, gcfamily/data/sources.py).

The oracle is written by hand: the tiny tokenizer has one token per character, and its chat template
renders a message as `<|role|>content` + `<eos>` for the assistant + a newline, with `<|assistant|>`
as the generation prompt. So every expected example below is a literal string, cut into pieces that
are trained (1) or not (0), and turned into ids through the tokenizer's vocabulary one character (or
one special token) at a time, never through the chat template or the code under test.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import metrics_rows

from gcfamily.data.encoding import Formatter, encode
from gcfamily.data.sources import load_rows
from gcfamily.errors import GcfError
from gcfamily.models import TINY_CHAT_TEMPLATE, tiny_tokenizer

TOK = tiny_tokenizer()  # never handed to a Formatter itself: each test gives it a copy (chat_template mutates it)
VOCAB = TOK.get_vocab()
_SPECIAL = re.compile(r"(<eos>|<bos>|<\|system\|>|<\|user\|>|<\|assistant\|>)")


def toks(text: str) -> list[int]:
    """Ids of a hand-written rendering: each special token, then each character, looked up in the vocabulary."""
    out: list[int] = []
    for part in _SPECIAL.split(text):
        out.extend([VOCAB[part]] if _SPECIAL.fullmatch(part) else [VOCAB[c] for c in part])
    return out


def pieces(*parts: tuple[str, int]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of pieces (text, trained)."""
    ids, mask = [], []
    for text, trained in parts:
        t = toks(text)
        ids += t
        mask += [trained] * len(t)
    return ids, mask


def trained_text(ids: list[int], mask: list[int]) -> str:
    return TOK.decode([i for i, m in zip(ids, mask) if m])


def formatter(tok=None, **kw) -> Formatter:
    return Formatter(copy.deepcopy(tok if tok is not None else TOK), **kw)


def no_template():
    tok = copy.deepcopy(TOK)
    tok.chat_template = None
    return tok


def U(c: str) -> dict:
    return {"role": "user", "content": c}


def A(c: str) -> dict:
    return {"role": "assistant", "content": c}


def S(c: str) -> dict:
    return {"role": "system", "content": c}


def P(text: str) -> str:
    """A one-user-message prompt rendered with the generation prompt."""
    return f"<|user|>{text}\n<|assistant|>"


def test_the_oracle_agrees_with_the_tokenizer():
    text = "<|user|>a b?\n<|assistant|>c<eos>\n"
    assert toks(text) == TOK(text, add_special_tokens=False)["input_ids"]
    assert len(toks(text)) == 2 + len("a b?\n") + 1 + len("c") + 1  # one id per character or special token
    assert TOK.apply_chat_template([U("a b?"), A("c")], tokenize=False) == text


# --------------------------------------------------------------------------- the matrix: format x kind

# name -> (rows, TRL's format, conversational)
ROWS = {
    "text": ([{"text": "hello"}], "language-modeling", False),
    "messages": ([{"messages": [U("hi"), A("yo"), U("q?"), A("ok")]}], "language-modeling", True),
    "prompt-only": ([{"prompt": "2+2="}], "prompt-only", False),
    "prompt-only/conv": ([{"prompt": [U("2+2=")]}], "prompt-only", True),
    "prompt-completion": ([{"prompt": "2+2=", "completion": "4"}], "prompt-completion", False),
    "prompt-completion/conv": ([{"prompt": [U("2+2=")], "completion": [A("4")]}], "prompt-completion", True),
    "preference": ([{"prompt": "sky?", "chosen": "blue", "rejected": "red"}], "preference", False),
    "preference/conv": ([{"prompt": [U("sky?")], "chosen": [A("blue")], "rejected": [A("red")]}], "preference", True),
    # implicit prompt: the shared start; the space before the answers starts the completions (TRL's extract_prompt)
    "preference-implicit": ([{"chosen": "Sky? blue", "rejected": "Sky? red"}], "preference", False),
    "preference-implicit/conv": (
        [{"chosen": [U("sky?"), A("blue")], "rejected": [U("sky?"), A("red")]}],
        "preference",
        True,
    ),
    "unpaired": (
        [
            {"prompt": "sky?", "completion": "blue", "label": True},
            {"prompt": "sky?", "completion": "red", "label": False},
        ],
        "unpaired-preference",
        False,
    ),
    "unpaired/conv": (
        [
            {"prompt": [U("sky?")], "completion": [A("blue")], "label": True},
            {"prompt": [U("sky?")], "completion": [A("red")], "label": False},
        ],
        "unpaired-preference",
        True,
    ),
}

# What each accepted (name, kind) gives, per mode ("same" for conversational rows: chat only), by hand.
# demonstrations: pieces (text, trained); prompts: prompt strings; pairs: (prompt, chosen, rejected); labelled: (prompt, completion, label)
_PC_CHAT = [(P("2+2="), 0), ("4<eos>", 1)]  # the completion ends at the template's EOS; its newline is not trained
EXPECTED = {
    "text": {
        "demonstrations": {"chat": [("h", 0), ("ello<eos>", 1)], "raw": [("h", 0), ("ello<eos>", 1)]}
    },  # text is never templated
    "messages": {
        "demonstrations": {"chat": [(P("hi"), 0), ("yo<eos>", 1), ("\n" + P("q?"), 0), ("ok<eos>", 1), ("\n", 0)]}
    },
    "prompt-only": {"prompts": {"chat": [P("2+2=")], "raw": ["2+2="]}},
    "prompt-only/conv": {"prompts": {"chat": [P("2+2=")]}},
    "prompt-completion": {
        "demonstrations": {"chat": _PC_CHAT, "raw": [("2+2=", 0), ("4<eos>", 1)]},
        "prompts": {"chat": [P("2+2=")], "raw": ["2+2="]},
    },
    "prompt-completion/conv": {"demonstrations": {"chat": _PC_CHAT}, "prompts": {"chat": [P("2+2=")]}},
    "preference": {
        "pairs": {"chat": [(P("sky?"), "blue<eos>", "red<eos>")], "raw": [("sky?", "blue<eos>", "red<eos>")]},
        "labelled": {
            "chat": [(P("sky?"), "blue<eos>", True), (P("sky?"), "red<eos>", False)],
            "raw": [("sky?", "blue<eos>", True), ("sky?", "red<eos>", False)],
        },
    },
    "preference/conv": {
        "pairs": {"chat": [(P("sky?"), "blue<eos>", "red<eos>")]},
        "labelled": {"chat": [(P("sky?"), "blue<eos>", True), (P("sky?"), "red<eos>", False)]},
    },
    "preference-implicit": {
        "pairs": {"chat": [(P("Sky?"), " blue<eos>", " red<eos>")], "raw": [("Sky?", " blue<eos>", " red<eos>")]},
        "labelled": {
            "chat": [(P("Sky?"), " blue<eos>", True), (P("Sky?"), " red<eos>", False)],
            "raw": [("Sky?", " blue<eos>", True), ("Sky?", " red<eos>", False)],
        },
    },
    "preference-implicit/conv": {
        "pairs": {"chat": [(P("sky?"), "blue<eos>", "red<eos>")]},
        "labelled": {"chat": [(P("sky?"), "blue<eos>", True), (P("sky?"), "red<eos>", False)]},
    },
    "unpaired": {
        "labelled": {
            "chat": [(P("sky?"), "blue<eos>", True), (P("sky?"), "red<eos>", False)],
            "raw": [("sky?", "blue<eos>", True), ("sky?", "red<eos>", False)],
        }
    },
    "unpaired/conv": {"labelled": {"chat": [(P("sky?"), "blue<eos>", True), (P("sky?"), "red<eos>", False)]}},
}

METHOD = {"demonstrations": "sft", "prompts": "grpo", "pairs": "dpo", "labelled": "kto"}
FOUND = {
    "language-modeling": "language-modeling (text or messages)",
    "prompt-only": "prompt-only (prompt)",
    "prompt-completion": "prompt-completion (prompt, completion)",
    "preference": "preference (prompt, chosen, rejected; or chosen, rejected with an implicit prompt)",
    "unpaired-preference": "unpaired-preference (prompt, completion, label)",
}
TAKES = {
    "demonstrations": f"{FOUND['language-modeling']} or {FOUND['prompt-completion']}",
    "prompts": f"{FOUND['prompt-only']} or {FOUND['prompt-completion']}",
    "pairs": FOUND["preference"],
    "labelled": f"{FOUND['unpaired-preference']} or {FOUND['preference']}",
}


def _check_accepted(e, kind: str, want) -> None:
    if kind == "demonstrations":
        [(ids, mask)] = e.examples
        assert (ids, mask) == pieces(*want)
        assert trained_text(ids, mask) == "".join(t for t, m in want if m)
    elif kind == "prompts":
        assert e.examples == [toks(p) for p in want]
    elif kind == "pairs":
        assert e.examples == [tuple(toks(x) for x in w) for w in want]
    else:
        assert e.examples == [(toks(p), toks(c)) for p, c, _ in want]
        assert [r["label"] for r in e.rows] == [label for _, _, label in want]


@pytest.mark.parametrize("kind", list(METHOD))
@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("chat_format", ["chat", "raw"])
def test_format_by_kind(name, kind, chat_format):
    rows, family, conv = ROWS[name]
    method = METHOD[kind]
    want = EXPECTED[name].get(kind)
    if want is None:  # the format is not one this kind takes: one sentence naming both
        with pytest.raises(GcfError) as err:
            encode(kind, rows, formatter(chat_format=chat_format), 512, method=method)
        assert str(err.value) == f"{method} cannot train on {FOUND[family]} rows; it takes {TAKES[kind]} rows."
        return
    if conv and chat_format == "raw":
        with pytest.raises(GcfError, match=r"chat_format=raw takes string rows, but this dataset is conversational"):
            encode(kind, rows, formatter(chat_format=chat_format), 512, method=method)
        return
    e = encode(kind, rows, formatter(chat_format=chat_format), 512, method=method)
    assert (e.kind, e.format, e.conversational, e.n_skipped) == (kind, family, conv, 0)
    if name != "text":  # text rows are tokenised as they are whatever the mode says
        assert e.mode == chat_format
    _check_accepted(e, kind, want[chat_format])


def test_the_matrix_covers_every_format_and_accepts_what_the_docs_say():
    accepted = {(n, k) for n, by_kind in EXPECTED.items() for k in by_kind}
    assert set(EXPECTED) == set(ROWS)
    by_family = {}
    for n, (_, fam, _) in ROWS.items():
        by_family.setdefault(fam, set()).update(k for k in METHOD if (n, k) in accepted)
    assert by_family == {
        "language-modeling": {"demonstrations"},
        "prompt-only": {"prompts"},
        "prompt-completion": {"demonstrations", "prompts"},
        "preference": {"pairs", "labelled"},
        "unpaired-preference": {"labelled"},
    }


# --------------------------------------------------------------------------- chat_format, templates, system prompts


def bos_tokenizer():
    """The tiny tokenizer adding <bos> as its special token, as many base models' do, and without a template."""
    from tokenizers.processors import TemplateProcessing

    tok = no_template()
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", VOCAB["<bos>"])])
    return tok


def test_raw_prompt_takes_special_tokens_completion_does_not_then_eos():
    tok = bos_tokenizer()
    assert tok("ab")["input_ids"] == toks("<bos>ab")  # the tokenizer does add them
    for chat_format in ("raw", "auto"):  # auto is raw without a template
        f = formatter(tok, chat_format=chat_format)
        e = encode("demonstrations", [{"prompt": "2+2=", "completion": "4"}], f, 512, method="sft")
        assert e.mode == "raw"
        assert e.examples == [pieces(("<bos>2+2=", 0), ("4<eos>", 1))]
        e = encode("pairs", [{"prompt": "sky?", "chosen": "blue", "rejected": "red"}], f, 512, method="dpo")
        assert e.examples == [(toks("<bos>sky?"), toks("blue<eos>"), toks("red<eos>"))]
        e = encode("demonstrations", [{"text": "hello"}], f, 512, method="sft")
        assert e.examples == [pieces(("<bos>", 0), ("hello<eos>", 1))]  # every token but the first; EOS appended


def test_chat_mode_wraps_strings_as_user_and_assistant_messages():
    f = formatter(chat_format="chat")
    e = encode(
        "demonstrations",
        [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}],
        f,
        512,
        method="sft",
    )
    assert e.mode == "chat"
    assert e.examples == [pieces((P("2+2="), 0), ("4<eos>", 1)), pieces((P("3+3="), 0), ("6<eos>", 1))]


def test_auto_is_chat_with_a_template_and_raw_without():
    rows = [{"prompt": "2+2=", "completion": "4"}]
    e = encode("demonstrations", rows, formatter(chat_format="auto"), 512, method="sft")
    assert e.mode == "chat" and e.examples == [pieces((P("2+2="), 0), ("4<eos>", 1))]
    e = encode("demonstrations", rows, formatter(no_template(), chat_format="auto"), 512, method="sft")
    assert e.mode == "raw" and e.examples == [pieces(("2+2=", 0), ("4<eos>", 1))]
    with pytest.raises(GcfError, match=r"no chat template.*pass chat_template"):
        encode("demonstrations", rows, formatter(no_template(), chat_format="chat"), 512, method="sft")


@pytest.mark.parametrize(
    "name", ["messages", "prompt-only/conv", "prompt-completion/conv", "preference/conv", "unpaired/conv"]
)
def test_conversational_rows_need_a_template_unless_one_is_given(name, tmp_path):
    rows, _, _ = ROWS[name]
    kind = next(iter(EXPECTED[name]))
    want = EXPECTED[name][kind]["chat"]
    with pytest.raises(GcfError) as err:
        encode(kind, rows, formatter(no_template()), 512, method=METHOD[kind])
    assert "no chat template" in str(err.value) and "pass chat_template" in str(err.value)
    path = tmp_path / "template.jinja"
    path.write_text(TINY_CHAT_TEMPLATE)
    for given in (TINY_CHAT_TEMPLATE, str(path)):
        e = encode(kind, rows, formatter(no_template(), chat_template=given), 512, method=METHOD[kind])
        assert e.mode == "chat"
        _check_accepted(e, kind, want)


def test_a_chat_template_that_replaces_the_tokenizers_own_is_used():
    template = (
        "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + ('<eos>' if m['role'] == 'assistant' else '') }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'a:' }}{% endif %}"
    )
    e = encode(
        "demonstrations", [{"prompt": "q", "completion": "r"}], formatter(chat_template=template), 512, method="sft"
    )
    assert e.examples == [pieces(("u:qa:", 0), ("r<eos>", 1))]
    with pytest.raises(GcfError, match=r"neither an existing file nor a Jinja template"):
        formatter(chat_template="/no/such/template.jinja")


def test_system_prompt_is_put_first_unless_the_row_has_one():
    sys_ = "<|system|>You are X.\n"
    f = formatter(system_prompt="You are X.")
    e = encode("prompts", [{"prompt": "2+2="}], f, 512, method="grpo")
    assert e.examples == [toks(sys_ + P("2+2="))]
    e = encode("prompts", [{"prompt": [U("3+3=")]}, {"prompt": [S("Be Y."), U("1+1=")]}], f, 512, method="grpo")
    assert e.examples == [toks(sys_ + P("3+3=")), toks("<|system|>Be Y.\n" + P("1+1="))]
    e = encode("demonstrations", [{"prompt": "2+2=", "completion": "4"}], f, 512, method="sft")
    assert e.examples == [pieces((sys_ + P("2+2="), 0), ("4<eos>", 1))]
    e = encode("pairs", [{"prompt": "sky?", "chosen": "blue", "rejected": "red"}], f, 512, method="dpo")
    assert e.examples == [(toks(sys_ + P("sky?")), toks("blue<eos>"), toks("red<eos>"))]
    e = encode("demonstrations", ROWS["messages"][0], f, 512, method="sft")
    assert e.examples == [pieces((sys_ + P("hi"), 0), ("yo<eos>", 1), ("\n" + P("q?"), 0), ("ok<eos>", 1), ("\n", 0))]


def test_assistant_only_loss_trains_both_assistant_turns_or_everything_but_the_first_token():
    rows = [{"messages": [U("hi"), A("yo"), U("q?"), A("ok")]}]
    full = "<|user|>hi\n<|assistant|>yo<eos>\n<|user|>q?\n<|assistant|>ok<eos>\n"
    [(ids, mask)] = encode("demonstrations", rows, formatter(assistant_only_loss=True), 512, method="sft").examples
    assert ids == toks(full)
    assert trained_text(ids, mask) == "yo<eos>ok<eos>"
    assert sum(mask) == len("yo") + 1 + len("ok") + 1  # both turns; no user token, no newline
    [(ids, mask)] = encode("demonstrations", rows, formatter(assistant_only_loss=False), 512, method="sft").examples
    assert ids == toks(full)
    assert mask == [0] + [1] * (len(ids) - 1)
    assert trained_text(ids, mask) == full[len("<|user|>") :]
    with pytest.raises(GcfError, match=r"Row 0: the conversation has no assistant message"):
        encode("demonstrations", [{"messages": [U("hi")]}], formatter(), 512, method="sft")


def test_kto_splits_each_preference_pair_into_a_desirable_and_an_undesirable_row():
    rows = [{"prompt": "a?", "chosen": "yes", "rejected": "no"}, {"prompt": "b?", "chosen": "up", "rejected": "down"}]
    e = encode("labelled", rows, formatter(chat_format="raw"), 512, method="kto")
    assert e.format == "preference"
    assert e.examples == [
        (toks("a?"), toks("yes<eos>")),
        (toks("a?"), toks("no<eos>")),
        (toks("b?"), toks("up<eos>")),
        (toks("b?"), toks("down<eos>")),
    ]
    assert [(r["prompt"], r["completion"], r["label"]) for r in e.rows] == [
        ("a?", "yes", True),
        ("a?", "no", False),
        ("b?", "up", True),
        ("b?", "down", False),
    ]


# --------------------------------------------------------------------------- max_length


def test_long_prompts_are_skipped_and_counted_or_refused():
    skip_key = "prompt of max_length=8 tokens or more"
    raw = formatter(chat_format="raw")
    rows = [
        {"prompt": "1234567", "completion": "abcd"},
        {"prompt": "12345678", "completion": "x"},
        {"prompt": "12", "completion": "ab"},
    ]
    e = encode("demonstrations", rows, raw, 8, method="sft")
    # row 0: a 7-token prompt leaves room for one completion token; row 1's 8-token prompt is skipped
    assert e.examples == [pieces(("1234567", 0), ("a", 1)), pieces(("12", 0), ("ab<eos>", 1))]
    assert e.skipped == {skip_key: 1} and e.n_skipped == 1
    assert [r["prompt"] for r in e.rows] == ["1234567", "12"]
    e = encode("prompts", rows, raw, 8, method="grpo")
    assert e.examples == [toks("1234567"), toks("12")] and e.skipped == {skip_key: 1}
    prefs = [
        {"prompt": "123456", "chosen": "abc", "rejected": "d"},
        {"prompt": "12345678", "chosen": "a", "rejected": "b"},
    ]
    e = encode("pairs", prefs, raw, 8, method="dpo")
    assert e.examples == [(toks("123456"), toks("ab"), toks("d<eos>"))] and e.skipped == {
        skip_key: 1
    }  # completions cut to the room left
    e = encode("labelled", prefs, raw, 8, method="kto")
    assert e.examples == [(toks("123456"), toks("ab")), (toks("123456"), toks("d<eos>"))] and e.skipped == {skip_key: 2}
    # a conversation whose first trained token lies past max_length
    e = encode(
        "demonstrations",
        [{"messages": [U("a" * 20), A("b")]}, {"messages": [U("a"), A("b")]}],
        formatter(),
        12,
        method="sft",
    )
    assert e.skipped == {"no trained token within max_length": 1}
    assert e.examples == [pieces((P("a"), 0), ("b<eos>", 1), ("\n", 0))]
    with pytest.raises(GcfError) as err:
        encode("demonstrations", rows, raw, 8, long_prompts="error", method="sft")
    assert (
        str(err.value)
        == "Row 1: the prompt has 8 tokens, at least max_length=8; raise max_length or set long_prompts=skip."
    )
    with pytest.raises(GcfError, match=r"Row 1: the prompt has 8 tokens"):
        encode("prompts", rows, raw, 8, long_prompts="error", method="grpo")
    with pytest.raises(
        GcfError, match=r"No row of the data is usable for sft \(1 prompt of max_length=8 tokens or more\)"
    ):
        encode("demonstrations", rows[1:2], raw, 8, method="sft")


# --------------------------------------------------------------------------- containers

STD_ROWS = [
    {"prompt": "two plus two", "completion": "four", "answer": "four"},
    {"prompt": "sky colour", "completion": "blue", "answer": "blue"},
]
CONV_ROWS = [{"messages": [U("hi"), A("yo"), U("q?"), A("ok")]}, {"messages": [U("ab"), A("cd")]}]


def _containers(tmp_path: Path, rows: list[dict], with_csv: bool) -> dict:
    import datasets

    out: dict = {"list": rows, "Dataset": datasets.Dataset.from_list(rows)}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    out.update({k: str(tmp_path / f"d.{k}") for k in ("jsonl", "json", "parquet")})
    if with_csv:
        with open(tmp_path / "d.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        out["csv"] = str(tmp_path / "d.csv")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    out["save_to_disk"] = str(tmp_path / "ds")
    return out


@pytest.mark.parametrize("rows, with_csv", [(STD_ROWS, True), (CONV_ROWS, False)], ids=["standard", "conversational"])
def test_every_container_gives_the_same_rows_and_ids(tmp_path, rows, with_csv):
    want = encode("demonstrations", rows, formatter(), 512, method="sft").examples
    if with_csv:
        assert want[0] == pieces((P("two plus two"), 0), ("four<eos>", 1))
    else:
        assert want[1] == pieces((P("ab"), 0), ("cd<eos>", 1), ("\n", 0))
    sources = _containers(tmp_path, rows, with_csv)
    assert len(sources) == (7 if with_csv else 6)
    for name, source in sources.items():
        got = load_rows(source)
        assert got == rows, name
        assert encode("demonstrations", got, formatter(), 512, method="sft").examples == want, name


def test_a_dataset_dict_gives_the_split_asked_for(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(STD_ROWS[:1]), "test": datasets.Dataset.from_list(STD_ROWS)}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    for source in (str(tmp_path / "dd"), dd):  # a DatasetDict.save_to_disk folder, and the object from Python
        assert load_rows(source, "test") == STD_ROWS
        assert load_rows(source, "train") == STD_ROWS[:1]
        with pytest.raises(GcfError) as err:
            load_rows(source, "validation")
        assert "no split 'validation'" in str(err.value) and "its splits are test, train" in str(err.value)


def test_csv_cells_are_trained_as_written(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,completion\nZip code?,007\nPrice?,1.50\n")
    e = encode("demonstrations", load_rows(str(tmp_path / "d.csv")), formatter(chat_format="raw"), 512, method="sft")
    assert e.examples == [pieces(("Zip code?", 0), ("007<eos>", 1)), pieces(("Price?", 0), ("1.50<eos>", 1))]


def test_columns_are_renamed_and_a_missing_one_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in [("1+1=", "2"), ("2+3=", "5")]))
    rows = load_rows(str(path), columns={"prompt": "question"})
    assert rows == [{"answer": "2", "prompt": "1+1="}, {"answer": "5", "prompt": "2+3="}]
    assert encode("prompts", rows, formatter(), 512, method="grpo").examples == [toks(P("1+1=")), toks(P("2+3="))]
    with pytest.raises(GcfError) as err:
        load_rows(str(path), columns={"prompt": "query"})
    assert str(err.value) == f"columns maps to 'query', which dataset {path} lacks; its columns are answer, question."
    with pytest.raises(GcfError, match=r"none of TRL's formats.*columns="):
        encode("prompts", load_rows(str(path)), formatter(), 512, method="grpo")


# --------------------------------------------------------------------------- the hub, nothing mocked

HUB_SCRIPT = textwrap.dedent('''
    import contextlib, io, json, runpy, shutil, sys
    from pathlib import Path
    import datasets
    tmp, gcf_args = Path(sys.argv[1]), sys.argv[2:]
    files = {}
    for split, rows in (("train", [("1+1=", "2"), ("2+2=", "4")]), ("test", [("3+3=", "6"), ("4+4=", "8")])):
        files[split] = str(tmp / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps({"question": q, "answer": a}) + "\\n" for q, a in rows))
    b = datasets.load_dataset_builder("json", data_files=files, cache_dir=str(tmp / "build"))
    b.download_and_prepare()
    built = Path(b.cache_dir)
    dst = Path(datasets.config.HF_DATASETS_CACHE) / "acme___tiny-math" / "main" / built.parent.name / built.name
    shutil.copytree(built, dst)
    info = json.loads((dst / "dataset_info.json").read_text())
    info.update(config_name="main", dataset_name="tiny-math")
    (dst / "dataset_info.json").write_text(json.dumps(info))
    for f in dst.glob("json-*.arrow"):
        f.rename(f.with_name("tiny-math-" + f.name[len("json-"):]))
    from gcfamily.data.sources import load_rows
    print("ROWS=" + json.dumps(load_rows("acme/tiny-math", "test", config="main")))

    def gcf(*args):
        """`python -m gcfamily ARGS` in this process (its interpreter start is most of a tiny run's time)."""
        sys.argv, err = ["gcf", *args], io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                runpy.run_module("gcfamily", run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code or 0
        return {"code": code, "err": err.getvalue()}

    print("RUN=" + json.dumps(gcf(*gcf_args, "--dataset", "acme/tiny-math", "--set", "dataset_config=main",
                                  "--set", "columns={prompt: question}", "--output-dir", str(tmp / "o1"))))
    print("MISSING=" + json.dumps(gcf(*gcf_args, "--dataset", "acme/no-such-set", "--output-dir", str(tmp / "o2"))))
''')


def test_a_cached_hub_dataset_loads_offline_and_trains(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    gcf = [
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--reward",
        "numeric",
        "--max-steps",
        "1",
        "--set",
        "batch_size=2",
        "--set",
        "group_size=2",
        "--set",
        "max_new_tokens=4",
        "--set",
        "progress=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT, str(tmp_path), *gcf],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith(("ROWS=", "RUN=", "MISSING="))]
    got = {key: json.loads(value) for key, value in lines}
    assert got["ROWS"] == [
        {"question": "3+3=", "answer": "6"},
        {"question": "4+4=", "answer": "8"},
    ]  # the test split, as cached
    assert got["RUN"]["code"] == 0, got["RUN"]["err"]
    assert len(metrics_rows(tmp_path / "o1")) == 1
    run_config = json.loads((tmp_path / "o1" / "run_config.json").read_text())
    assert (run_config["dataset"], run_config["dataset_config"]) == ("acme/tiny-math", "main")
    assert run_config["columns"] == {"prompt": "question"}
    missing = got["MISSING"]  # a hub id the cache lacks, offline: one sentence, exit 2
    assert missing["code"] == 2
    assert missing["err"].startswith("error: Dataset acme/no-such-set could not be loaded"), missing["err"]
    assert len(missing["err"].strip().splitlines()) == 1, missing["err"]


# --------------------------------------------------------------------------- end to end, one per kind

COMMON = [
    "--model",
    "tiny",
    "--max-steps",
    "1",
    "--set",
    "batch_size=2",
    "--set",
    "group_size=2",
    "--set",
    "max_new_tokens=4",
    "--set",
    "progress=false",
]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "method, rows, trained",
    [
        # the tiny tokenizer has a template, so auto is chat: the trained tokens are the assistant turns / completions, EOS included
        (
            "sft",
            [{"messages": [U("hi"), A("yo"), U("q?"), A("ok")]}, {"messages": [U("ab"), A("cd")]}],
            len("yo_ok_cd_"),
        ),
        (
            "dpo",
            [{"chosen": "Sky? blue", "rejected": "Sky? red"}, {"chosen": "Grass? green", "rejected": "Grass? pink"}],
            len(" blue_ red_ green_ pink_"),
        ),
        (
            "kto",
            [
                {"prompt": "sky?", "completion": "blue", "label": True},
                {"prompt": "sky?", "completion": "red", "label": False},
            ],
            len("blue_red_"),
        ),
    ],
)
def test_cli_trains_each_offline_kind(gcf, tmp_path, method, rows, trained):
    data = _jsonl(tmp_path / "d.jsonl", rows)
    code, _out, err = gcf("run", "--method", method, "--dataset", data, *COMMON, "--output-dir", str(tmp_path / "o"))
    assert code == 0, err
    [step] = metrics_rows(tmp_path / "o")
    assert step["tokens"] == trained  # both rows in the one batch of 2


def test_cli_grpo_on_conversational_prompts_with_a_reward_file(gcf, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": [U("say hi")]}, {"prompt": [U("say yo")]}])
    seen = tmp_path / "seen.json"
    reward = tmp_path / "conv_reward.py"
    reward.write_text(
        textwrap.dedent(f"""
        import json
        def conv(completions, prompts=None, **kw):
            with open({str(seen)!r}, "w") as fh:
                json.dump({{"prompts": prompts, "completions": completions}}, fh)
            return [float(len(c[0]["content"])) for c in completions]
    """)
    )
    code, _out, err = gcf(
        "run",
        "--method",
        "grpo",
        "--dataset",
        data,
        "--reward",
        f"{reward}:conv",
        *COMMON,
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert code == 0, err
    assert len(metrics_rows(tmp_path / "o")) == 1
    called = json.loads(
        seen.read_text()
    )  # the reward saw message lists: the prompt's, and the completion as one assistant message
    assert {p[0]["content"] for p in called["prompts"]} <= {"say hi", "say yo"}
    assert all(len(c) == 1 and c[0]["role"] == "assistant" for c in called["completions"])


def test_cli_refuses_sft_on_unpaired_rows_in_one_sentence(gcf, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ROWS["unpaired"][0])
    code, out, err = gcf("run", "--method", "sft", "--dataset", data, *COMMON, "--output-dir", str(tmp_path / "o"))
    assert code == 2
    assert (
        err.strip()
        == f"error: sft cannot train on {FOUND['unpaired-preference']} rows; it takes {TAKES['demonstrations']} rows."
    )
    assert "Traceback" not in out + err
