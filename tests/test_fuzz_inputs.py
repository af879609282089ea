"""The seeded fuzz of tests/test_fuzz.py extended to chat templates and dataset row shapes (issue 49, item 5): every
case is accepted or refused with a GcfError; any other exception is a traceback, and a case that runs past HANG_S is a
hang. Templates render under the Formatter's time bound (encoding.RENDER_S, lowered here to 0.3 s so that the fuzz
stays quick: the bound, not the speed, is under test).
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import pytest
from test_fuzz import SEED, Tally, _random_py, _random_text

HANG_S = 60.0  # the stated bound: no case may take longer (a hang), far above what any case needs

FRAGMENTS = [
    "{{ messages[0].content }}",
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",  # the replay
    "{% for i in range(99999) %}{{ i }}{% endfor %}",
    "{% for i in range(100001) %}{% endfor %}",  # past the sandbox's range cap
    "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}",  # unbounded recursion
    "{% macro g(n) %}{% if n > 0 %}{{ g(n - 1) }}{{ g(n - 1) }}{% endif %}{% endmacro %}{{ g(40) }}",  # 2**40 calls
    "{{ ().__class__.__mro__ }}",
    "{{ messages.__class__.__subclasses__() }}",
    "{{ raise_exception('no') }}",
    "{% if add_generation_prompt %}assistant:{% endif %}",
    "{{ eos_token }}",
    "{{ messages | tojson }}",
    "{{ undefined_name.attr }}",
    "{% for",
    "{{ 1 / 0 }}",
    "{{ messages[5].content }}",
    "{% set x = namespace(n=0) %}{% for m in messages %}{% set x.n = x.n + 1 %}{% endfor %}{{ x.n }}",
    "{{ 'ab' * 1000 }}",
    "{{ messages[0].content[::-1] | upper }}",
]


BENIGN = [FRAGMENTS[i] for i in (0, 1, 10, 11, 12, 17, 18, 19)]


def _template(rng: random.Random) -> str:
    if rng.random() < 0.4:  # templates that render too, so that acceptance is exercised as much as refusal
        extra = "".join(rng.choice(BENIGN) for _ in range(rng.randint(0, 2)))
        turns = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
        return extra + turns + "{% if add_generation_prompt %}assistant:{% endif %}"
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 3))) + rng.choice(["", "{{ eos_token }}"])


def _timed(tally: Tally, label: str, fn: Any) -> None:
    t0 = time.monotonic()
    tally.run(label, fn)
    assert time.monotonic() - t0 < HANG_S, f"{label} ran past {HANG_S:g} s"


def test_fuzz_chat_templates(monkeypatch):
    from gcfamily.data import encoding
    from gcfamily.errors import GcfError
    from gcfamily.models import tiny_tokenizer

    monkeypatch.setattr(encoding, "RENDER_S", 0.3)
    rng = random.Random(f"{SEED}/templates")
    tok = tiny_tokenizer()
    tally, overtime, sandbox = Tally(), 0, 0
    conversation = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    for i in range(60):
        text = _template(rng)
        fmt = encoding.Formatter(tok, "chat", chat_template=text)

        def case(fmt: Any = fmt) -> None:
            nonlocal overtime, sandbox
            try:
                fmt.prompt_ids("1+1=")
                fmt.conversation(conversation)
            except GcfError as e:
                overtime += "did not finish rendering" in str(e)
                sandbox += "unsafe" in str(e)
                raise

        _timed(tally, f"template {i} ({text[:60]!r})", case)
    line = tally.report("chat templates")
    assert not tally.tracebacks, f"{line}:\n" + "\n".join(tally.tracebacks[:20])
    # the branches under test occurred: templates accepted, stopped by the time bound and by the sandbox
    assert tally.counts["accepted"] and overtime and sandbox, (line, overtime, sandbox)


def _row(rng: random.Random) -> dict[str, Any]:
    """A row of random shape: the columns TRL's formats read, each a random value, a message list or a deep nest."""
    row: dict[str, Any] = {}
    for key in rng.sample(["prompt", "completion", "chosen", "rejected", "label", "messages", "text", "answer"], 3):
        kind = rng.randrange(5)
        if kind == 0:
            value: Any = _random_text(rng)
        elif kind == 1:
            value = [{"role": rng.choice(["user", "assistant", "system", "x", 5]), "content": _random_py(rng)}]
        elif kind == 2:
            value = []
            for _ in range(rng.choice([2, 50, 150, 5000])):
                value = [value]
        else:
            value = _random_py(rng)
        row[key] = value
    return row


@pytest.mark.parametrize("kind", ["demonstrations", "prompts", "pairs", "labelled"])
def test_fuzz_dataset_row_shapes(kind):
    from gcfamily.data.encoding import Formatter, encode
    from gcfamily.data.sources import load_rows
    from gcfamily.models import tiny_tokenizer

    rng = random.Random(f"{SEED}/rows/{kind}")
    fmt = Formatter(tiny_tokenizer(), "auto")
    tally = Tally()
    for i in range(150):
        rows = [_row(rng) for _ in range(rng.randint(1, 3))]
        _timed(tally, f"{kind} rows {i}", lambda rows=rows: encode(kind, load_rows(rows), fmt, 64, "skip", kind))
    line = tally.report(f"{kind} row shapes")
    assert not tally.tracebacks, f"{line}:\n" + "\n".join(tally.tracebacks[:20])
    assert tally.counts["refused"] > 0


def test_fuzz_row_shapes_in_files(tmp_path):
    """The same shapes written as JSONL, read by the datasets library (deep ones refused before it reads them)."""
    from gcfamily.data.sources import load_rows

    rng = random.Random(f"{SEED}/rows/files")
    tally = Tally()
    for i in range(12):
        path = tmp_path / f"rows-{i}.jsonl"
        rows = [_row(rng) for _ in range(rng.randint(1, 3))]
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(20_000)  # the writer's limit, for the 5,000-deep shapes; the reader keeps its own
        try:
            path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        finally:
            sys.setrecursionlimit(limit)
        _timed(tally, f"file {i}", lambda path=path: load_rows(str(path)))
    line = tally.report("row shapes in files")
    assert not tally.tracebacks, f"{line}:\n" + "\n".join(tally.tracebacks[:20])
