"""A run configured to hand out its coefficients and to take its start evaluation from elsewhere
(gcfamily/run/hooks.py), as `gcf bench`'s child configures it: no object is patched."""

import json

from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.run.hooks import RunHooks, StartEvaluation
from gcfamily.run.trainer import Trainer

SMALL = dict(
    method="grpo",
    model="tiny",
    task="arithmetic",
    max_steps=2,
    batch_size=2,
    group_size=4,
    max_new_tokens=6,
    micro_batch_size=3,
    eval_samples=4,
    progress=False,
    report_to="none",
)


def test_on_coefficients_gets_every_micro_batch_of_every_step(tmp_path, monkeypatch):
    seen = {}

    def record(step, parts):
        seen[step] = parts

    tr = Trainer(Config(output_dir=str(tmp_path / "run"), eval_at_ends=False, **SMALL), hooks=RunHooks(record))
    real = engine.weighted_loss
    tokens = []

    def counting(coef, logps, batch, mode, Z):  # an independent count of the loss tokens the engine weighed
        tokens.append(int(engine.effective_mask(batch).sum()))
        return real(coef, logps, batch, mode, Z)

    monkeypatch.setattr(engine, "weighted_loss", counting)
    tr.run()
    assert sorted(seen) == [1, 2]
    assert all(len(parts) == 3 for parts in seen.values())  # 8 rows in micro-batches of 3: 3, 3, 2
    assert sum(int(m.sum()) for parts in seen.values() for _, m in parts) == sum(tokens) > 0
    assert all(c.shape == m.shape and not c.requires_grad for parts in seen.values() for c, m in parts)


def test_a_given_start_evaluation_is_recorded_instead_of_evaluating(tmp_path):
    figures = {"eval/accuracy": 0.123}
    details = json.dumps({"step": 0, "rows": ["given"]})
    hooks = RunHooks(start_evaluation=StartEvaluation(figures, details))
    tr = Trainer(Config(output_dir=str(tmp_path / "run"), eval_at_ends=True, **SMALL), hooks=hooks)
    tr.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] == 0)
    assert first["eval/accuracy"] == 0.123
    lines = (tmp_path / "run" / "eval_details.jsonl").read_text().splitlines()
    # the given line as step 0's, then the end's own evaluation of the trained policy
    assert lines[0] == details and json.loads(lines[-1])["step"] == 2 and len(lines) == 2
