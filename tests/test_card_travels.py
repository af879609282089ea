"""A model card travels (issue 50): a run given local files (a dataset, a held-out set, a reward's file) records them
by name and sha256 digest, never by a path of this machine, and its reproduce command runs from another folder that
holds those files by those names."""

from __future__ import annotations

import hashlib
import json
import re
import shlex

REWARD = "def near_two(completions, **kw):\n    return [float('2' in c) for c in completions]\n"


def test_the_card_names_local_inputs_by_name_and_digest_and_its_command_runs_elsewhere(gcf, tmp_path, monkeypatch):
    here = tmp_path / "machine-a" / "deep"
    here.mkdir(parents=True)
    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6))
    (here / "rows.jsonl").write_text(rows)
    (here / "held.jsonl").write_text(rows)
    (here / "rew.py").write_text(REWARD)
    out = tmp_path / "run"
    args = ["--method", "grpo", "--model", "tiny", "--dataset", str(here / "rows.jsonl")]
    args += ["--reward", f"{here / 'rew.py'}:near_two", "--eval", "--set", f"eval_dataset={here / 'held.jsonl'}"]
    args += ["--set", "eval_split=train", "--max-steps", "1", "--set", "batch_size=2", "--set", "group_size=2"]
    args += ["--set", "max_new_tokens=2", "--set", "eval_samples=2", "--set", "progress=false"]
    code, _, err = gcf("run", *args, "--output-dir", str(out))
    assert code == 0, err
    card = (out / "README.md").read_text()
    assert str(tmp_path) not in card and "machine-a" not in card, card  # no path of this machine anywhere
    for name in ("rows.jsonl", "held.jsonl", "rew.py"):
        sha = hashlib.sha256((here / name).read_bytes()).hexdigest()  # the oracle: hashlib on the bytes
        assert f"`{name}` (file, sha256 {sha})" in card, card
    assert "- **Data:** `rows.jsonl`" in card and "`rew.py:near_two`" in card
    command = re.search(r"```bash\n(.*?)\n```", card, re.S).group(1).replace("\\\n", " ")
    elsewhere = tmp_path / "machine-b"
    elsewhere.mkdir()
    for name in ("rows.jsonl", "held.jsonl", "rew.py"):
        (elsewhere / name).write_bytes((here / name).read_bytes())
    (here / "rows.jsonl").unlink()  # the first machine's files are gone: only the copies can serve
    monkeypatch.chdir(elsewhere)
    words = shlex.split(command)
    assert words[:2] == ["gcf", "run"]
    code, _, err = gcf(*words[1:], "--output-dir", "again")
    assert code == 0, err
    assert (elsewhere / "again" / "model.safetensors").is_file()
