"""Where rows come from: a local file, a `save_to_disk` folder, a hub dataset, or an object from Python.

    rows = load_rows(source, split="train", config=None, columns=None)

`source` is, in the order it is tried:

- a `datasets.Dataset`, a `DatasetDict` (its `split`) or a list of dicts, passed from Python;
- an existing file: JSONL, JSON, parquet or CSV, by its suffix;
- an existing folder: a `Dataset.save_to_disk` or `DatasetDict.save_to_disk` folder, else a folder
  of data files that `datasets.load_dataset(folder)` reads;
- anything else that looks like a hub id (`name` or `org/name`): `datasets.load_dataset(source,
  config, split=split)`, the real call, which also finds a dataset the hub cache already holds
  (offline mode included).

`columns` renames columns before anything reads them: `{prompt: question}` makes the dataset's
`question` column the `prompt`. Every failure is one sentence (GcfError).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Optional

from gcfamily.errors import GcfError

FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FILE_SPLITS = ("train", "test")
"""The split names a single local file answers to (all its rows): train, which the datasets library names a file's
rows, and test, eval_split's default, so that eval_dataset may be a file; and a slice of train (train[:90%]) of a
JSON or parquet file, which the datasets library takes. Any other name is refused."""
MAX_DEPTH = 100
"""How deeply a row's values may nest (lists and dicts): a conversation with tool calls is about ten deep; a JSON line
100,000 deep crashed the JSON reader with SIGSEGV, so deeper files are refused before any library reads them."""
_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')  # a JSON string: it holds no raw newline, so lines can be read apart
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
# trust_remote_code=False is passed to every load_dataset: datasets 4 and later run no loading script, and saying so
# explicitly keeps any version from running (or asking on stdin to run) a dataset's own code.


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GcfError("The `datasets` package is missing; reinstall gcfamily.") from e
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()  # "using the latest cached version" and the like stay out of the run's output
    logging.getLogger("datasets").setLevel(logging.ERROR)
    return datasets


def _first_line(e: BaseException) -> str:
    """The first line of an error, with the cause's where the error only says that something failed ("An error occurred while generating the dataset")."""
    text = str(e).strip()
    line = (text.splitlines()[0] if text else type(e).__name__)[:200]
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip() and "error occurred" in line.lower():
        line = f"{line.rstrip('.')}: {str(cause).strip().splitlines()[0][:160]}"
    return line


def json_depth(path: Path) -> int:
    """The deepest nesting of brackets outside strings in a JSON or JSONL file, read in pieces of whole lines (numpy counts,
    so a large file takes about a second a gigabyte)."""
    import numpy as np

    deepest = level = 0
    with open(path, "rb") as f:
        for lines in iter(lambda: f.readlines(1 << 24), []):
            brackets = _STRING.sub(b"", b"".join(lines)).translate(None, _NOT_BRACKET)
            if not brackets:
                continue
            steps = np.where(np.frombuffer(brackets, np.uint8) % 4 == 3, 1, -1)  # [ is 91 and { 123; ] is 93 and } 125
            depth = level + np.cumsum(steps)
            deepest, level = max(deepest, int(depth.max())), int(depth[-1])
    return deepest


def _check_depth(path: Path) -> None:
    """Refuse a JSON or JSONL file nested deeper than MAX_DEPTH, in one sentence, before a reader recurses into it."""
    if path.suffix.lower() in (".json", ".jsonl") and path.is_file() and json_depth(path) > MAX_DEPTH:
        raise GcfError(
            f"Dataset file {path} nests values more than {MAX_DEPTH} deep (lists or objects inside one another); a row "
            "that deep is no real data: fix the file."
        )


def row_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply a row's lists, tuples and dicts nest, counted without recursion and only up to limit + 1."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (list, tuple, dict)):
            deepest = max(deepest, depth + 1)
            if deepest > limit:
                return deepest
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def describe(source: Any) -> str:
    """How a source is named in messages and in run_config.json."""
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(source, list):
        return f"<list of {len(source)} rows>"
    return f"<{type(source).__name__} of {getattr(source, 'num_rows', '?')} rows>"


def _pick_split(obj: Any, split: str, name: str) -> Any:
    """A DatasetDict's split (a clear error naming the splits it has); a Dataset as it is."""
    if type(obj).__name__ in ("DatasetDict", "IterableDatasetDict") or (
        isinstance(obj, dict) and all(hasattr(v, "column_names") for v in obj.values())
    ):
        if split not in obj:
            raise GcfError(
                f"Dataset {name} has no split '{split}'; its splits are {', '.join(sorted(obj))} (set dataset_split)."
            )
        return obj[split]
    return obj


def _from_disk_folder(path: Path) -> bool:
    """Whether a folder was written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _load(source: Any, split: str, config: Optional[str]) -> Any:
    """The Dataset (not yet rows) a source names."""
    if isinstance(source, list):
        return source
    if not isinstance(source, (str, Path)) and not hasattr(source, "column_names") and not hasattr(source, "keys"):
        raise GcfError(
            f"A dataset must be a path or hub id, a datasets.Dataset or DatasetDict, or a list of dicts; got a {type(source).__name__}."
        )
    if not isinstance(source, (str, Path)):  # a Dataset or DatasetDict from Python
        return _pick_split(source, split, describe(source))
    ds_lib = _datasets()
    text = str(source)
    path = Path(text).expanduser()
    if path.is_file():
        kind = FILE_TYPES.get(path.suffix.lower())
        if kind is None:
            raise GcfError(
                f"Dataset file {text} has an unknown type; use .jsonl, .json, .parquet or .csv, or a save_to_disk folder."
            )
        _check_depth(path)
        sliced = split.startswith("train[") and kind != "csv"  # train[:90%]: datasets' slice of the file's rows
        # a split the file cannot have was a typo, or meant for a hub dataset
        if split not in FILE_SPLITS and not sliced:
            raise GcfError(
                f"Dataset file {text} is a single split, so split '{split}' is not in it; leave dataset_split (or "
                f"eval_split) at train, or pass a folder or hub dataset that has a split '{split}'."
            )
        try:
            if kind == "csv":  # cells are text as written ("007", "1.50"), never numbers guessed from them
                import csv

                with open(path, newline="", encoding="utf-8") as f:
                    # cells past the header dropped
                    return [{k: v for k, v in r.items() if k is not None} for r in csv.DictReader(f)]
            return ds_lib.load_dataset(
                kind, data_files=str(path), split=split if sliced else "train", trust_remote_code=False
            )
        except Exception as e:  # datasets raises many types for malformed files
            raise GcfError(f"Dataset file {text} could not be read ({_first_line(e)}).") from e
    if path.is_dir():
        try:
            if _from_disk_folder(path):
                return _pick_split(ds_lib.load_from_disk(str(path)), split, text)
            for file in sorted(path.rglob("*")):  # the data files load_dataset reads, before it reads them
                _check_depth(file)
            return ds_lib.load_dataset(str(path), config, split=split, trust_remote_code=False)
        except GcfError:
            raise
        except Exception as e:
            raise GcfError(f"Dataset folder {text} could not be read ({_first_line(e)}).") from e
    looks_local = path.suffix.lower() in FILE_TYPES or text.startswith((".", "/", "~")) or text.count("/") > 1
    if looks_local:
        raise GcfError(
            f"Dataset file {text} does not exist; pass an existing JSONL/JSON/parquet/CSV file, a save_to_disk folder or a hub id like org/name."
        )
    try:
        return ds_lib.load_dataset(text, config, split=split, trust_remote_code=False)
    except Exception as e:  # unreachable hub, unknown config or split, gated dataset
        raise GcfError(
            f"Dataset {text}{f' (config {config})' if config else ''} could not be loaded from the hub or its cache ({_first_line(e)[:160]}); "
            "offline, use a local file or a built-in task (--task arithmetic)."
        ) from e


def rename_columns(rows: list[dict[str, Any]], columns: Optional[dict[str, str]], name: str) -> list[dict[str, Any]]:
    """Rows with columns renamed: `columns` maps the name gcfamily reads to the dataset's column."""
    if not columns:
        return rows
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise GcfError(
            f"columns={columns!r} must map names to the dataset's columns, e.g. {{prompt: question, answer: answer}}."
        )
    have = set(rows[0])
    missing = [v for v in columns.values() if v not in have]
    if missing:
        raise GcfError(
            f"columns maps to {', '.join(repr(m) for m in missing)}, which dataset {name} lacks; its columns are {', '.join(sorted(have))}."
        )
    out = []
    for row in rows:
        new = {k: v for k, v in row.items() if k not in columns.values()}
        new.update({k: row[v] for k, v in columns.items()})
        out.append(new)
    return out


def load_rows(
    source: Any, split: str = "train", config: Optional[str] = None, columns: Optional[dict[str, str]] = None
) -> list[dict[str, Any]]:
    """Rows of a dataset as plain dicts, columns renamed; at least one row."""
    name = describe(source)
    ds = _load(source, split, config)
    try:
        rows = [dict(r) for r in ds]  # decoding can fail too (odd nested keys)
    except Exception as e:
        raise GcfError(f"Dataset {name} could not be read ({_first_line(e)}).") from e
    if not rows:
        raise GcfError(f"Dataset {name} is empty; it needs at least one row.")
    if not all(isinstance(r, dict) for r in rows):
        raise GcfError(f"Dataset {name} must hold rows of named columns (dicts).")
    deep = next((i for i, r in enumerate(rows) if row_depth(r) > MAX_DEPTH), None)
    if deep is not None:
        raise GcfError(
            f"Row {deep} of dataset {name} nests values more than {MAX_DEPTH} deep (lists or dicts inside one another); "
            "no real row is that deep: fix the data."
        )
    return rename_columns(rows, columns, name)
