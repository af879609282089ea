"""Untrusted inputs that used to run code, hang, or end in a traceback (issue 33, items 1, 6 and 7).

- a model, reward model, critic or tokenizer folder whose config names its own code (`auto_map`): refused in one
  sentence without --trust-remote-code, even with `y` waiting on stdin for transformers' prompt;
- a reward that fills the pipe it inherited, or whose import hangs: killed at reward_timeout, the folder as before;
- `--nproc 2` whose launcher is SIGKILLed while the workers start: the workers die with it;
- recipes that expand past any size ("billion laughs"), nest 5000 deep or refer to themselves; a model config too big
  for the machine or holding NaN; a reward of 10**400; and other values that were accepted silently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _one_sentence(code: int, err: str) -> str:
    assert code != 0, err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- 1. no code without the flag


def _with_own_code(folder: Path, file: str = "config.json") -> Path:
    """Give a saved folder an `auto_map` naming a Python file that leaves a marker when imported; the marker's path."""
    marker = folder / "MARKER"
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig\n\n\n"
        "class EvilConfig(LlamaConfig):\n"
        "    model_type = 'gcfevil'\n"
    )
    path = folder / file
    config = json.loads(path.read_text())
    if file == "config.json":  # a model type transformers does not know: only the folder's own code could build it
        config["model_type"] = "gcfevil"
    config["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilConfig",
        "AutoModelForSequenceClassification": "evil.EvilConfig",
        "AutoTokenizer": ["evil.EvilConfig", None],
    }
    path.write_text(json.dumps(config))
    return marker


@pytest.fixture(scope="module")
def code_folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(folder, marker) for a policy, a reward model and a tokenizer-only folder, each naming its own code."""
    from gcfamily.models import tiny_model, tiny_tokenizer
    from gcfamily.rewards.model import RewardModel

    base = tmp_path_factory.mktemp("own-code")
    tok = tiny_tokenizer()
    policy = base / "policy"
    tiny_model(len(tok)).save_pretrained(policy)
    tok.save_pretrained(policy)
    rm = base / "reward-model"
    RewardModel.from_causal_lm(tiny_model(len(tok)), tok).save(rm)
    tokenizer = base / "tokenizer"
    tok.save_pretrained(tokenizer)
    (tokenizer / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {
        "policy": (policy, _with_own_code(policy)),
        "reward-model": (rm, _with_own_code(rm)),
        "tokenizer": (tokenizer, _with_own_code(tokenizer, "tokenizer_config.json")),
    }


def test_folders_with_their_own_code_never_run_it(code_folders, tmp_path):
    """Each load path, as a real process with `y` on stdin: one sentence, non-zero, and the folder's code never ran.

    Before the fix the reward model's config was loaded without trust_remote_code, so transformers asked on stdin and
    the `y` ran evil.py."""
    quick = ["--max-steps", "1", "--set", "progress=false", "--set", "batch_size=2", "--set", "max_new_tokens=4"]
    policy, rm, tok = (code_folders[k][0] for k in ("policy", "reward-model", "tokenizer"))
    commands = {
        "policy": ["run", "--method", "sft", "--model", str(policy), *quick],
        "reward-model": ["run", "--method", "grpo", "--model", "tiny", "--reward-model", str(rm), *quick],
        "critic": ["run", "--method", "ppo", "--model", "tiny", "--set", f"critic_model={policy}", *quick],
        "tokenizer": ["data", "--method", "sft", "--model", str(tok), "--task", "arithmetic"],
    }
    procs = {}
    for name, args in commands.items():  # together: four interpreter starts on two cores
        out = tmp_path / name
        if args[0] == "run":
            args = [*args, "--output-dir", str(out)]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "gcfamily", *args],
            cwd=tmp_path,
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, proc in procs.items():
        _, err = proc.communicate(input="y\n" * 4, timeout=300)
        line = _one_sentence(proc.returncode, err)
        assert "auto_map" in line and "--trust-remote-code" in line, (name, line)
        assert "[y/N]" not in err, (name, err)
    assert not any(marker.exists() for _, marker in code_folders.values())


def test_the_refusal_reads_the_flag(tmp_path):
    """With --trust-remote-code the refusal is gone (the load is then transformers' own, with the flag passed)."""
    from gcfamily.errors import GcfError
    from gcfamily.models import refuse_remote_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "auto_map": {"AutoConfig": "evil.C"}}))
    with pytest.raises(GcfError, match="auto_map in config.json"):
        refuse_remote_code(str(tmp_path), False, "Reward model folder")
    refuse_remote_code(str(tmp_path), True, "Reward model folder")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    refuse_remote_code(str(tmp_path), False, "Reward model folder")


# --------------------------------------------------------------------------- 2. no hangs


def test_a_reward_that_fills_an_inherited_pipe_does_not_block(tmp_path):
    """The worker's stdout is a pipe nobody reads (a harness that reads only at the end): a reward printing 1 MB used to
    block on it until reward_timeout killed it (its samples failed); now its prints go to its own file and it returns."""
    from gcfamily.rewards import Rewards

    (tmp_path / "loud.py").write_text(
        "import os, sys\n\n\n"
        "def loud(completions, **kwargs):\n"
        "    sys.stdout.write('x' * 2**20)\n"
        "    sys.stdout.flush()\n"
        "    os.write(2, b'y' * 2**20)\n"
        "    return [1.0] * len(completions)\n"
    )
    read, write = os.pipe()
    saved = os.dup(1), os.dup(2)
    os.dup2(write, 1)  # the trainer's own streams are this pipe while the worker starts (and inherits them)
    os.dup2(write, 2)
    try:
        rewards = Rewards.from_specs([f"{tmp_path / 'loud.py'}:loud"], timeout=30)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, write):
            os.close(fd)
    try:
        scores = rewards.score(["p", "q"], ["a", "b"])
        assert scores.valid.tolist() == [True, True], scores.errors
        assert rewards.worker.starts == 1
    finally:
        rewards.close()
        os.close(read)


def test_a_reward_whose_import_hangs_ends_in_one_sentence_and_leaves_no_trace(gcf, tmp_path):
    """An import that never finishes ran with no deadline (the run hung, and a kill left .gcf.lock and
    run_config.json behind); now it runs under reward_timeout and the run folder is left as it was."""
    (tmp_path / "stuck.py").write_text("import time\n\nwhile True:\n    time.sleep(0.05)\n")
    out = tmp_path / "run"
    code, _, err = gcf(
        "run", "--method", "grpo", "--model", "tiny", "--reward", f"{tmp_path / 'stuck.py'}:r", "--max-steps", "1",
        "--output-dir", str(out), "--set", "reward_timeout=1", "--set", "progress=false",
        "--set", "batch_size=1", "--set", "group_size=2", "--set", "max_new_tokens=2",
    )  # fmt: skip
    line = _one_sentence(code, err)
    assert "did not finish within reward_timeout=1 s" in line and "stuck.py:r" in line, line
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


# --------------------------------------------------------------------------- 3. workers die with the launcher


def _children(pid: int) -> list[int]:
    """Pids whose parent is pid (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_workers_die_with_a_killed_launcher_while_they_start(tmp_path):
    """SIGKILL of `gcf run --nproc 2` as soon as its two processes exist (they are still importing): both used to live
    on, then wait at the rendezvous for a store that was gone, for minutes. Now they end with the launcher."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gcfamily", "run", "--nproc", "2", "--method", "sft", "--model", "tiny",
         "--max-steps", "2", "--output-dir", str(tmp_path / "run"), "--set", "progress=false",
         "--set", "batch_size=2", "--set", "micro_batch_size=1"],
        cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        for _ in range(6000):  # the launcher imports torch first: up to 60 s on a loaded machine
            workers = _children(launcher.pid)
            if len(workers) >= 2 or launcher.poll() is not None:
                break
            time.sleep(0.01)
        assert len(workers) == 2, f"the launcher started {len(workers)} processes (exit {launcher.poll()})"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        for _ in range(600):  # they end at once; the bound only stops a broken build from hanging the suite
            if not any(_alive(w) for w in workers):
                break
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a worker outlived its launcher"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


# --------------------------------------------------------------------------- 4. bounds

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{x}: &{x} [{', '.join([f'*{p}'] * 10)}]\n" for p, x in zip("abcdefgh", "bcdefghi")
)  # i: 10**9 lols once expanded


def _recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("method: sft\ntask_options:\n  " + LAUGHS.replace("\n", "\n  ").rstrip() + "\n", "expands to more than"),
        ("method: sft\ntask_options: &s {me: *s}\n", "refers to itself"),
        ("method: sft\nstop_strings: " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than"),
    ],
    ids=["billion-laughs", "self-reference", "5000-deep"],
)
def test_recipes_past_any_size_are_one_sentence(gcf, tmp_path, text, needle):
    """A 600-byte recipe whose nested anchors expand to 10**9 values (written out when the settings were saved), one
    that refers to itself, one nested 5000 deep (a RecursionError): refused before anything is built."""
    from gcfamily.config.io import read
    from gcfamily.errors import GcfError

    assert len(text) < 1000 or needle == "nests deeper than"
    with pytest.raises(GcfError, match=needle):
        read(_recipe(tmp_path, text), {})
    code, _, err = gcf(
        "run", "--config", _recipe(tmp_path, text), "--model", "tiny", "--output-dir", str(tmp_path / "o")
    )
    assert needle in _one_sentence(code, err)
    assert not (tmp_path / "o").exists()


def test_set_values_are_bounded_too():
    from gcfamily.config.io import apply, parse_sets
    from gcfamily.config.shared import Config
    from gcfamily.errors import GcfError

    laughs = "{" + LAUGHS.strip().replace("\n", ", ") + "}"
    for value, needle in [(laughs, "expands to more than"), ("[" * 5000 + "]" * 5000, "nests deeper than")]:
        with pytest.raises(GcfError, match=needle):
            apply(Config(), parse_sets((f"task_options={value}",)), "--set")
    holds_itself: list = []
    holds_itself.append(holds_itself)
    with pytest.raises(GcfError, match="refers to itself"):  # from Python: train(stop_strings=...)
        apply(Config(), {"stop_strings": holds_itself}, "train()")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from gcfamily.models import tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("model") / "tiny"
    tok = tiny_tokenizer()
    tiny_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _edited(model_folder: Path, tmp_path: Path, **changes) -> str:
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))  # json writes NaN as NaN, which json reads back
    return str(folder)


def test_a_model_too_big_for_the_machine_is_refused_before_it_is_built(model_folder, tmp_path):
    """num_hidden_layers=10**9 of the tiny model's 64-wide layers: 2.5e13 parameters, refused from config.json alone."""
    from gcfamily.errors import GcfError
    from gcfamily.models import check_source, machine_memory, parameter_estimate

    folder = _edited(model_folder, tmp_path, num_hidden_layers=10**9)
    n = parameter_estimate(json.loads((Path(folder) / "config.json").read_text()))
    assert n >= 10**9 * (2 * 64 * 64 + 2 * 64 * 128)  # per layer: q and o (64 x 64), up and down (64 x 128) at least
    assert 2 * n > machine_memory()
    with pytest.raises(GcfError, match="more than this machine's"):
        check_source(folder)
    check_source(str(model_folder))  # the tiny model itself passes


def test_a_model_config_with_nan_is_refused(model_folder, tmp_path):
    """A NaN rms_norm_eps made every step non-finite: the run skipped it and ended "done" with exit 0."""
    from gcfamily.errors import GcfError
    from gcfamily.models import check_source

    with pytest.raises(GcfError, match="rms_norm_eps is not a finite number"):
        check_source(_edited(model_folder, tmp_path, rms_norm_eps=float("nan")))


# --------------------------------------------------------------------------- 5. tracebacks and silent acceptances


def test_every_declared_seed_orders_the_data():
    from gcfamily.data.batches import epoch_indices

    for seed in (2**63 - 1, 10**14 * 2):
        assert sorted(epoch_indices(10, seed, 0, 10)) == list(range(10))


@pytest.mark.parametrize(
    "kwargs, needle",
    [({"resume": 5}, "resume must be a path"), ({"eval_dataset": 5}, "eval_dataset must be a path")],
    ids=["resume", "eval_dataset"],
)
def test_train_refuses_arguments_of_the_wrong_type(tmp_path, kwargs, needle):
    import gcfamily
    from gcfamily.errors import GcfError

    with pytest.raises(GcfError, match=needle):
        gcfamily.train(method="sft", model="tiny", max_steps=1, output_dir=str(tmp_path / "o"), **kwargs)
    assert not (tmp_path / "o").exists()


def test_a_reward_of_10_to_the_400_fails_its_sample_in_process_and_in_the_worker(tmp_path):
    """float(10**400) raised OverflowError (a traceback); now such a number is +inf, an invalid reward (documented in
    calling.as_values), and the sample fails, counted, as a NaN one does."""
    from gcfamily.rewards import Rewards

    (tmp_path / "huge.py").write_text("def huge(completions, **kwargs):\n    return [10**400, 1.0, -(10**400)]\n")

    def huge(completions, **kwargs):
        return [10**400, 1.0, -(10**400)]

    for spec in (huge, f"{tmp_path / 'huge.py'}:huge"):
        rewards = Rewards.from_specs([spec])
        try:
            scores = rewards.score(["p"] * 3, ["a", "b", "c"])
        finally:
            rewards.close()
        assert scores.valid.tolist() == [False, True, False]
        assert scores.rewards.tolist() == [0.0, 1.0, 0.0]
        assert scores.errors[0] == "reward function 'huge' returned inf on sample 0"


def test_a_split_a_file_cannot_have_is_refused(tmp_path):
    from gcfamily.data.sources import load_rows
    from gcfamily.errors import GcfError

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n')
    assert load_rows(str(path), "train") == [{"prompt": "a", "completion": "b"}]
    with pytest.raises(GcfError, match="split 'nosuch' is not in it"):
        load_rows(str(path), "nosuch")


def test_preference_pairs_whose_chosen_equals_rejected(capfd):
    """They score log 2 whatever the policy and add no gradient: all of them refused, some of them counted on stderr."""
    from gcfamily.data.encoding import Formatter, encode
    from gcfamily.errors import GcfError
    from gcfamily.models import tiny_tokenizer

    fmt = Formatter(tiny_tokenizer(), "raw")
    same = [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}] * 3
    with pytest.raises(GcfError, match="Every one of the 3 preference pairs has chosen equal to rejected"):
        encode("pairs", same, fmt, 64, method="dpo")
    capfd.readouterr()
    out = encode("pairs", [*same[:2], {"prompt": "1+1=", "chosen": "2", "rejected": "3"}], fmt, 64, method="dpo")
    assert len(out.examples) == 3
    assert "warning: 2 of 3 preference pairs have chosen equal to rejected" in capfd.readouterr().err
