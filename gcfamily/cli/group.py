"""The `gcf` group: every command added to it, a user's mistake as one line on stderr, the libraries kept quiet."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from gcfamily import __version__
from gcfamily.bench import bench
from gcfamily.cli.inspection import check_cmd, data_cmd, methods, settings, tasks
from gcfamily.cli.options import _usage_hint
from gcfamily.cli.training import eval_cmd, run
from gcfamily.errors import GcfError
from gcfamily.theory.cli import theory

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Read when the libraries are imported: their notices and warnings would otherwise come before a one-line error.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("DATASETS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_VERBOSITY", "error")


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class GcfGroup(click.Group):
    """Turns GcfError into one clear line and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GcfError as e:
            _fail(str(e), getattr(e, "exit_code", 2))
        except click.UsageError as e:  # a bad option or value: click's own message, on one line like the rest
            hint = _usage_hint(e)
            if hint is not None:
                _fail(hint, e.exit_code)
            where = f"; see `{e.ctx.command_path} --help`." if e.ctx is not None else "."
            _fail(" ".join(e.format_message().split()).rstrip(".") + where, e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted.", 130)


def _quiet_libraries() -> None:
    """Keep the libraries' progress bars, notices and warnings out of the run's output (an error stays one line).

    Warnings raised in gcfamily or in the user's own code (a reward, a method) still show.
    """
    import logging
    import warnings

    for name in (
        "transformers",
        "datasets",
        "huggingface_hub",
        "torch",
        "accelerate",
        "peft",
        "safetensors",
        "filelock",
        "urllib3",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    # datasets' file readers log a parse error, then raise it: the raise becomes the one error line
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    warnings.filterwarnings(
        "ignore", module=r"(transformers|datasets|huggingface_hub|torch|accelerate|peft|safetensors)(\.|$)"
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


@click.group(cls=GcfGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="gcf", message="%(prog)s (gcfamily) %(version)s")
def main() -> None:
    """gcfamily: one engine for SFT, rejection sampling, PPO, GRPO, DPO and their variants."""
    _quiet_libraries()


main.add_command(run)
main.add_command(methods)
main.add_command(settings)
main.add_command(check_cmd)
main.add_command(tasks)
main.add_command(data_cmd)
main.add_command(eval_cmd)
main.add_command(theory)
main.add_command(bench)
