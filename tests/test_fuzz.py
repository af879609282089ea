"""A seeded fuzz of what a user hands gcfamily: every shared setting through `--set`, every file a run reads, and
train()'s arguments. Each case is accepted (with its documented meaning) or refused with a GcfError; any other
exception is a traceback a user would see, and fails the test (issue 33, item 7).

The cases are drawn from random.Random(seed): the same cases on every run, no hypothesis needed.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gcfamily.errors import GcfError

SEED = 33

# --------------------------------------------------------------------------- values

TEXT_VALUES = [
    "",
    " ",
    "abc",
    "none",
    "null",
    "~",
    "true",
    "false",
    "yes",
    "0",
    "1",
    "-1",
    "2",
    "0.5",
    "-0.0",
    "1e-3",
    "1e400",
    "1.0e400",
    ".nan",
    ".inf",
    "-.inf",
    "nan",
    "inf",
    "9" * 400,
    str(2**63),
    str(2**63 - 1),
    str(2**64),
    "-" + "9" * 30,
    "[]",
    "{}",
    "[1, 2]",
    "[a, b]",
    "[[[[1]]]]",
    "{a: 1}",
    "{a: {b: {c: [1]}}}",
    "[" * 200 + "]" * 200,
    "&a [*a]",
    "a: b: c",
    "[unclosed",
    "{bad",
    "'quoted'",
    '"x"',
    "!!python/object:os.system ls",
    "\x00",
    "x" * 5000,
    "[0.9, 0.999]",
    "[1.5, 2]",
    "[.nan, 0.9]",
    "tensorboard",
    "[wandb, none]",
    "auto",
    "cpu",
    "float32",
    "skip",
]
"""`--set key=VALUE` strings: wrong types, range edges, huge, NaN, inf, nesting, empty, YAML tags and broken YAML."""
CORE_TEXT = ["", "abc", "-1", "0", "9" * 400, str(2**63), ".nan", ".inf", "true", "[1, 2]", "[[[[1]]]]", "{a: 1}"]
"""Given to every setting: empty, a wrong type, edges, huge, NaN, inf, lists, nesting, a mapping. Each setting also gets
a seeded sample of TEXT_VALUES and random strings (every value reaches a few settings; the whole list would take 20 s)."""

PY_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    -(2**63),
    10**400,
    0.5,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "abc",
    "1e-3",
    [],
    [1, 2],
    [[[[1]]]],
    {},
    {"a": 1},
    {"a": {"b": [1]}},
    (0.9, 0.999),
    (1,),
    {1, 2},
    b"bytes",
    object(),
    Path("x"),
    1 + 2j,
    [math.nan],
    {"a": math.inf},
]
"""train(KEY=VALUE) values: Python objects of every wrong type, edges, non-finite numbers and containers."""


def _random_text(rng: random.Random) -> str:
    """A short string of YAML's busy characters, digits and letters (no ':', so no value names a module to import)."""
    alphabet = "[]{},&*!|>'\"#%@`-?.0123456789eE+ abcxyz\n\t\\"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))


def _random_py(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([rng.randint(-(2**70), 2**70), rng.random() * 10 ** rng.randint(-300, 300)])
    if kind == 1:
        return rng.choice(PY_VALUES)
    if kind == 2:
        return _random_text(rng)
    if kind == 3:
        return rng.choice([None, True, math.nan])
    if kind in (4, 5):
        return [_random_py(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_random_text(rng): _random_py(rng, depth + 1) for _ in range(rng.randint(0, 3))}


class Tally:
    """Counts of accepted, refused and traceback cases, and the first tracebacks by name."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.tracebacks: list[str] = []

    def run(self, label: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except GcfError as e:
            assert str(e).strip(), label  # a refusal says something
            self.counts["refused"] += 1
        except Exception as e:  # noqa: BLE001 (the point: any other exception is a traceback a user would see)
            self.counts["tracebacks"] += 1
            self.tracebacks.append(f"{label}: {type(e).__name__}: {str(e)[:120]}")
        else:
            self.counts["accepted"] += 1

    def report(self, what: str) -> str:
        cases = sum(self.counts.values())
        line = (
            f"{what}: {cases} cases, {self.counts['accepted']} accepted, {self.counts['refused']} refused, "
            f"{self.counts['tracebacks']} tracebacks"
        )
        print(line)
        return line


# --------------------------------------------------------------------------- settings through --set


def _settings_case(key: str, value: str) -> None:
    """What `gcf run --set key=value` does with the value before any folder or model: read, type, check, save."""
    from gcfamily.config import to_dict, validate
    from gcfamily.methods import resolve

    cfg = resolve(None, {key: value})
    validate(cfg)
    json.dumps(to_dict(cfg), allow_nan=False)  # what run_config.json will hold: plain JSON, no NaN


def test_fuzz_every_shared_setting_through_set():
    from gcfamily.config.shared import FIELDS, INTERNAL

    rng = random.Random(SEED)
    tally = Tally()
    keys = sorted(k for k in FIELDS if k not in INTERNAL)
    for key in keys:
        values = [*CORE_TEXT, *rng.sample(TEXT_VALUES, 8), *(_random_text(rng) for _ in range(2))]
        for value in values:
            if key == "method" and value.startswith("!!"):
                continue  # a method spec names code to import by design
            tally.run(f"--set {key}={value[:40]!r}", lambda key=key, value=value: _settings_case(key, value))
    line = tally.report("settings via --set")
    assert len(keys) > 60 and tally.counts["accepted"] and tally.counts["refused"]
    assert not tally.tracebacks, f"{line}:\n" + "\n".join(tally.tracebacks[:20])


# --------------------------------------------------------------------------- train()'s arguments


class _Accepted(Exception):
    """Raised by the stand-in Trainer: the arguments got through to a run (which this test does not train)."""


def test_fuzz_train_arguments(monkeypatch, tmp_path):
    """gcfamily.train with keyword arguments of every wrong type; the Trainer is a stand-in that runs the checks every
    run starts with (validate, the method's settings typed and checked, the settings as saved) and then stops."""
    import gcfamily
    from gcfamily.config import resolve_settings, to_dict, validate
    from gcfamily.config.shared import FIELDS, INTERNAL
    from gcfamily.methods import get_method
    from gcfamily.run import trainer as trainer_module

    class StandIn:
        def __init__(self, cfg: Any, resume: Any = None, **objects: Any) -> None:
            validate(cfg)
            method_cls = objects.get("method") or get_method(cfg.method)
            resolve_settings(cfg, method_cls)
            method_cls.apply_setting_defaults(cfg)
            method_cls.validate(cfg)
            json.dumps(to_dict(cfg), allow_nan=False)
            raise _Accepted

    monkeypatch.setattr(trainer_module, "Trainer", StandIn)
    monkeypatch.chdir(tmp_path)
    rng = random.Random(SEED)
    tally = Tally()

    def call(kwargs: dict[str, Any]) -> None:
        try:
            gcfamily.train(**kwargs)
        except _Accepted:
            pass

    keys = sorted(k for k in FIELDS if k not in INTERNAL and k not in ("method", "model", "output_dir"))
    for key in keys:
        for value in [*PY_VALUES, *(_random_py(rng) for _ in range(3))]:
            kwargs = {"method": "sft", "model": "tiny", key: value}
            tally.run(f"train({key}={value!r:.40})", lambda kwargs=kwargs: call(kwargs))
    for key in ("method", "model", "dataset", "reward", "eval_dataset", "output_dir", "resume"):
        for value in [*PY_VALUES, [{"prompt": "a"}], [{"a": 1}, 2], ()]:
            kwargs = {"method": "sft", "model": "tiny", key: value}
            tally.run(f"train({key}={value!r:.40})", lambda kwargs=kwargs: call(kwargs))
    line = tally.report("train() arguments")
    assert tally.counts["accepted"] and tally.counts["refused"]
    assert not tally.tracebacks, f"{line}:\n" + "\n".join(tally.tracebacks[:20])


# --------------------------------------------------------------------------- files a run reads


def _garbage(rng: random.Random, good: bytes) -> list[bytes]:
    """Contents to put in place of a good file: empty, random bytes, the good one cut short, JSON of the wrong shape,
    non-UTF-8, NaN, deep nesting, a huge number."""
    cut = [good[: rng.randint(0, max(0, len(good) - 1))] for _ in range(3)] if good else []
    noise = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))) for _ in range(3)]
    shapes = [b"[]", b"1", b"null", b'"x"', b"{}", b'{"a": NaN}', b"1e999", b'{"step": "x"}', b'{"owns": [1]}']
    # a run record crafted to reach outside its folder (issue 49): the fuzz checks nothing outside is touched
    shapes += [
        b'{"owns": ["*", "**", "../outside.txt", "/etc"]}',
        b'{"pending": {"dest": "..", "names": ["../outside.txt"]}}',
        b'{"pending": {"dest": "checkpoints/replaced-at-step-1", "names": ["../../outside.txt", "/tmp", "."]}}',
        b'{"pending": {"dest": "/tmp", "names": ["checkpoints"]}, "owns": ["checkpoints"]}',
    ]
    return [
        b"",
        *noise,
        *cut,
        *shapes,
        b"\xff\xfe\x00",
        b"[" * 5000 + b"]" * 5000,
        b"9" * 5000,
        good + b"\n{",
        good * 2,
    ]


@pytest.fixture(scope="module")
def checkpoint_template(tmp_path_factory) -> Path:
    """A run folder with one complete checkpoint of the tiny model, written by the run's own save."""
    import torch

    from gcfamily.models import tiny_model, tiny_tokenizer
    from gcfamily.run import checkpoint_format as checkpoint

    run = tmp_path_factory.mktemp("fuzz-run") / "run"
    model = tiny_model(len(tiny_tokenizer()))
    state = {"step": 1, "optimizer": {}, "scheduler": {}, "rng": {"torch": torch.get_rng_state()}, "method": {}}
    checkpoint.save(run / "checkpoints", 1, model, state)
    (run / "run_config.json").write_text(json.dumps({"method": "sft", "model": "tiny", "seed": 0}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)))
    return run


def _readers(run: Path) -> dict[str, tuple[Path, Callable[[], Any]]]:
    """file -> (its path in `run`, what reads it as a run does)."""
    from gcfamily.config.io import load_yaml, read
    from gcfamily.methods.pools import Pool
    from gcfamily.models import tiny_model, tiny_tokenizer
    from gcfamily.run import checkpoint_format as checkpoint
    from gcfamily.run.folder.lock import LOCK, RunLock
    from gcfamily.run.folder.ownership import RECORD, holds_run, owned_entries, read_record
    from gcfamily.run.folder.resuming import finish_pending, settings_of, truncate_logs

    step = run / "checkpoints" / "step-1"

    def lock() -> None:
        held = RunLock(run)
        held.acquire()
        held.release()

    def record() -> None:
        read_record(run)
        holds_run(run)
        settings_of(step)

    def manifest() -> None:
        checkpoint.damage(step)
        checkpoint.find("latest", run)

    def state() -> None:
        checkpoint.load(step, tiny_model(len(tiny_tokenizer())))

    def run_record() -> None:  # what a start does with the record: read it, list what it owns, finish a pending move
        held = read_record(run)
        owned_entries(run, held)
        if held is not None:
            finish_pending(run, held)

    def pool() -> None:
        Pool.load(run / "pools" / "rft-offline.jsonl", POOL_PROMPTS, vocab=100)

    def recipe() -> None:
        load_yaml(str(run / "recipe.yaml"))
        read(str(run / "recipe.yaml"), {})

    return {
        ".gcf.lock": (run / LOCK, lock),
        "run_config.json": (run / "run_config.json", record),
        "metrics.jsonl": (run / "metrics.jsonl", lambda: truncate_logs(run, 1)),
        "manifest.json": (step / checkpoint.MANIFEST, manifest),
        "state.pt": (step / "state.pt", state),
        "recipe.yaml": (run / "recipe.yaml", recipe),
        ".gcf-run.json": (run / RECORD, run_record),
        "pool": (run / "pools" / "rft-offline.jsonl", pool),
    }


POOL_PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.mark.parametrize(
    "name",
    [
        ".gcf.lock",
        "run_config.json",
        "metrics.jsonl",
        "manifest.json",
        "state.pt",
        "recipe.yaml",
        ".gcf-run.json",
        "pool",
    ],
)
def test_fuzz_files_a_run_reads(checkpoint_template, tmp_path, name):
    rng = random.Random(f"{SEED}/{name}")
    run = tmp_path / "run"
    shutil.copytree(checkpoint_template, run)
    if name == "recipe.yaml":
        (run / name).write_text("method: sft\nmodel: tiny\nlr: 1.0e-4\ntask_options: {level: 1d-add}\n")
    path, reader = _readers(run)[name]
    if name == "pool":  # a pool as a run writes it: two samples of each of the two prompts
        from gcfamily.methods.pools import Pool

        drawn = Pool(
            [0, 0, 1, 1], [[1, 2], [3], [4, 5, 6], [7]], ["a", "b", "c", "d"], [1.0, 0.0, 0.5, 1.0], [True] * 4
        )
        drawn.save(path, POOL_PROMPTS)
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's")
    good = path.read_bytes() if path.is_file() else b'{"pid": 1}'
    tally = Tally()
    cases = _garbage(rng, good)
    if name == ".gcf-run.json":  # seeded random records of the record's own keys
        keys = ["owns", "pending", "segments", "pid", "started", "dest", "names"]
        cases += [
            json.dumps({k: _random_py(rng) for k in rng.sample(keys, rng.randint(1, 4))}, default=str).encode()
            for _ in range(40)
        ]
    for i, contents in enumerate(cases):
        shutil.rmtree(run)
        shutil.copytree(checkpoint_template, run)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(contents)
        tally.run(f"{name} case {i} ({contents[:24]!r})", reader)
        assert outside.read_text() == "the user's" and sorted(p.name for p in tmp_path.iterdir()) == [
            "outside.txt",
            "run",
        ]
    line = tally.report(f"{name} garbage")
    assert sum(tally.counts.values()) >= 15
    assert not tally.tracebacks, f"{line}:\n" + "\n".join(tally.tracebacks[:20])
