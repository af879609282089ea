"""The two files docs/dpo-finding.md's restated run reads, written into a folder (default dpo-data/):
pairs_restated.jsonl (the task's 240 offline DPO pairs with each completion restated as `a op b = c`, a malformed
rejected reply left as it is) and heldout200.jsonl (the first 200 held-out rows of the task, prompt and answer only).

    python benchmarks/dpo_finding_data.py [FOLDER]

It prints how many pairs it wrote and how many rejected replies were wrong numbers and how many malformed: the
counts the page states (240; 174 and 66)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from gcfamily.data.preferences import preference_rows
from gcfamily.tasks import get_task


def main(folder: str = "dpo-data") -> None:
    out_dir = Path(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = get_task("arithmetic")
    rows, out, wrong_numbers = preference_rows(task, None, 0, split="train"), [], 0
    for r in rows:
        a, op, b = re.match(r"What is (\d+) ([+*]) (\d+)\?", r["prompt"]).groups()
        pre = f"{a} {op} {b} = "
        wrong = re.fullmatch(r"\d+", r["rejected"]) is not None  # a wrong number, else a malformed reply
        wrong_numbers += wrong
        out.append(
            {
                "prompt": r["prompt"],
                "chosen": pre + r["chosen"],
                "rejected": pre + r["rejected"] if wrong else r["rejected"],
            }
        )
    (out_dir / "pairs_restated.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    held = [{"prompt": r["prompt"], "answer": r["answer"]} for r in task.rows("test", 200)]
    (out_dir / "heldout200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    print(
        f"{len(out)} pairs ({wrong_numbers} wrong numbers, {len(out) - wrong_numbers} malformed), {len(held)} held-out rows"
    )


if __name__ == "__main__":
    main(*sys.argv[1:2])
