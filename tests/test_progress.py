"""Every phase longer than a few seconds says what it does (issue 50): the offline model's conversion and its loading
say so, each evaluation is a bar over its prompts that shows the token its batch decodes, and the log holds the
start's and each evaluation's time; all of it quiet with progress=false. Nothing here reads a clock's value."""

from __future__ import annotations

from conftest import metrics_rows

from gcfamily.models import gguf, load_model
from gcfamily.models.tiny import tiny_model, tiny_tokenizer


class Bar:
    """A stand-in for tqdm that records what it was told."""

    def __init__(self) -> None:
        self.total, self.moved, self.postfixes = None, [], []

    def update(self, n: int = 1) -> None:
        self.moved.append(n)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfixes.append(text)


def test_an_evaluation_moves_its_bar_by_prompts_and_shows_each_token():
    from gcfamily.data.encoding import Formatter
    from gcfamily.run.heldout import evaluate_rows

    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=1)
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    bar = Bar()
    evaluate_rows(model, Formatter(tok), rows, "numeric", max_new_tokens=3, batch_size=2, bar=bar)
    assert bar.total == 5
    assert [n for n in bar.moved if n] == [2, 2, 1]  # three batches of prompts: 2, 2 and 1
    # each batch: the prefill (token 0), then one forward per new token until all rows end (at most 3)
    starts = [i for i, p in enumerate(bar.postfixes) if p == "token 0/3"]
    assert len(starts) == 3 and bar.postfixes[1] == "token 1/3", bar.postfixes
    assert all(p.startswith("token ") and p.endswith("/3") for p in bar.postfixes)
    assert not model._forward_hooks  # the hook is gone once the evaluation ends


def _run(gcf, out, progress: bool):
    return gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--task",
        "arithmetic",
        "--max-steps",
        "1",
        "--eval",
        "--output-dir",
        str(out),
        "--set",
        "eval_samples=3",
        "--set",
        "max_new_tokens=2",
        "--set",
        "batch_size=2",
        "--set",
        f"progress={str(progress).lower()}",
    )


def test_a_run_shows_each_evaluation_as_a_bar_and_logs_its_time_and_is_quiet_without_progress(
    gcf, tmp_path, monkeypatch
):
    import contextlib

    from gcfamily.run import console

    bars: list[tuple[str, Bar]] = []
    real_bar = console.eval_bar

    def recorded(enabled, total, desc):
        if enabled:
            bars.append((desc, Bar()))
            return contextlib.nullcontext(bars[-1][1])
        return real_bar(enabled, total, desc)

    monkeypatch.setattr(console, "eval_bar", recorded)
    code, _out, err = _run(gcf, tmp_path / "on", True)
    assert code == 0, err
    assert "evaluating at step 0 on up to 3 held-out examples..." in err and "evaluated at step 1 in" in err, err
    assert [d for d, _ in bars] == ["evaluating at step 0", "evaluating at step 1"]
    assert all(b.total == 3 and sum(b.moved) == 3 and "token 1/2" in b.postfixes for _, b in bars)
    rows = metrics_rows(tmp_path / "on")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1] and all(r["time/eval_s"] >= 0 for r in evals)
    assert rows[0]["time/start_s"] >= 0 and all("time/start_s" not in r for r in rows[1:])  # the first row only
    bars.clear()
    code, _out, err = _run(gcf, tmp_path / "off", False)
    assert code == 0, err
    assert "evaluat" not in err and "%|" not in err, err
    assert not bars and [r["step"] for r in metrics_rows(tmp_path / "off") if "time/eval_s" in r] == [0, 1]


def test_loading_a_model_folder_says_it_loaded_and_nothing_without_a_listener(tmp_path, capsys):
    tok = tiny_tokenizer()
    tiny_model(len(tok)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    said: list[str] = []
    load_model(str(tmp_path / "m"), say=said.append)
    assert len(said) == 1 and said[0].startswith(f"loaded model {tmp_path / 'm'} in ") and said[0].endswith(" s")
    load_model(str(tmp_path / "m"))
    assert capsys.readouterr().err == ""


def test_the_conversion_says_it_starts_checks_and_ends_and_shows_the_readers_bar(tmp_path, monkeypatch):
    """convert_gguf on a stand-in for the GGUF reader (the tiny model): what it tells, in order, and that the reader's
    own bar is shown only when someone listens."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    shown = []

    def reader(*_a, **_k):
        shown.append(not gguf_utils.tqdm.keywords["disable"])  # the bar the reader would draw over its tensors
        return tiny_model(600, seed=2)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reader)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_a, **_k: tiny_tokenizer())
    said: list[str] = []
    gguf.convert_gguf(tmp_path, "x.gguf", tmp_path / "cache" / "out", say=said.append)
    assert said[0].startswith(f"converting x.gguf to a safetensors checkpoint in {tmp_path / 'cache'}"), said
    assert said[1].startswith("checked the converted logits") and said[2].startswith("converted x.gguf in "), said
    assert len(said) == 3 and (tmp_path / "cache" / "out" / "model.safetensors").is_file()
    gguf.convert_gguf(tmp_path, "x.gguf", tmp_path / "cache" / "quiet")
    assert shown == [True, False]
