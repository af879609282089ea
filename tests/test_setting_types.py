"""Every setting, shared and each built-in method's own, given a value of the wrong type: one `error:` line, exit 2.

Both doors are fed: `--set key=value` (text, read as YAML) and a YAML recipe (typed values). A string
setting accepts any text on the command line, so it is fed a list through the recipe only.
"""

import dataclasses

import pytest
import yaml
from click.testing import CliRunner

from gcfamily.cli import main
from gcfamily.config import INTERNAL, Config
from gcfamily.methods import METHODS, get_method

WRONG = {
    "bool": ("maybe", "maybe"),
    "int": ("abc", 1.5),
    "float": ("abc", "abc"),
    "list": ("{a: 1}", {"a": 1}),
    "dict": ("[1, 2]", [1, 2]),
    "tuple": ("abc", "abc"),
    "str": (None, [1, 2]),
}


def _base(f: dataclasses.Field) -> str:
    t = str(f.type).replace("typing.", "")
    return t.removeprefix("Optional[").split("[")[0].split(" ")[0].rstrip("]")


def _cases():
    shared = [("sft", f) for f in dataclasses.fields(Config) if f.name not in INTERNAL]
    own = [(name, f) for name in METHODS for f in dataclasses.fields(get_method(name).Settings)]
    seen, out = set(), []
    for method, f in shared + own:
        key = (method if (method, f) in own else "*", f.name)
        if key not in seen and _base(f) in WRONG:
            seen.add(key)
            out.append(pytest.param(method, f.name, _base(f), id=f"{method}-{f.name}"))
    return out


CASES = _cases()


def test_the_cases_cover_every_setting():
    assert len(CASES) > 100  # every shared setting and every method's own, by type
    assert {c.values[2] for c in CASES} >= {"bool", "int", "float", "list", "dict", "str"}


def _one_error_line(res):
    err = res.stderr.strip()
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in res.output


@pytest.mark.parametrize("method, key, base", CASES)
def test_wrong_type_is_one_error_line(tmp_path, method, key, base):
    text, typed = WRONG[base]
    common = ["run", "--method", method, "--model", "tiny", "--max-steps", "1", "--output-dir", str(tmp_path / "o")]
    runner = CliRunner()
    if text is not None:
        _one_error_line(runner.invoke(main, [*common, "--set", f"{key}={text}"]))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({key: typed}))
    _one_error_line(runner.invoke(main, [*common, "--config", str(recipe)]))


@pytest.mark.parametrize("text", ["5", "banana", "[tensorboard, 3]"])
def test_report_to_of_any_shape_is_one_error_line(tmp_path, text):
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            "sft",
            "--model",
            "tiny",
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "o"),
            "--set",
            f"report_to={text}",
        ],
    )
    _one_error_line(res)
    assert "report_to" in res.stderr


def test_device_that_is_not_a_device_is_one_error_line(tmp_path):
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            "sft",
            "--model",
            "tiny",
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "o"),
            "--set",
            "device=banana",
        ],
    )
    _one_error_line(res)
    assert "device='banana'" in res.stderr
