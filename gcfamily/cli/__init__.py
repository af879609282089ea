"""`gcf`: run a method, list methods and settings, evaluate a model.

Every user mistake ends in one sentence on stderr and exit code 2; no traceback.

    group.py        the `gcf` group: every command added to it, an error as one line, the libraries kept quiet
    options.py      the command line's settings: --set overrides, the run's settings, TRL's spellings as one sentence
    training.py     gcf run and gcf eval, the commands that load a model
    inspection.py   gcf methods, settings, tasks, data and check, the commands that show or check without training

gcf bench is gcfamily.bench's (bench/command.py), gcf theory gcfamily.theory's (theory/cli.py).
"""

from __future__ import annotations

from gcfamily.cli.group import GcfGroup, main
from gcfamily.cli.inspection import check_cmd, data_cmd, methods, settings, tasks
from gcfamily.cli.training import eval_cmd, run

__all__ = ["GcfGroup", "check_cmd", "data_cmd", "eval_cmd", "main", "methods", "run", "settings", "tasks"]
