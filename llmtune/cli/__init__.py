"""The `llmtune` command line: each command parses flags and calls one function of a room.

The commands live with their room: recipe_commands (validate, plan, estimate, config), train_commands
(train, preprocess, slurm), post_commands (eval, merge, infer, chat, report); shared option types in options.
This module only builds the app, in the order `--help` lists the commands, and turns errors into exit codes.
Heavy libraries are imported inside the commands that need them, so --help is instant.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmtune import __version__
from llmtune.cli import checkpoint_cmd, doctor_cmd, post_commands, recipe_commands, rehearse_cmd, train_commands
from llmtune.errors import EXIT_USER_ERROR, UserError

app = typer.Typer(
    name="llmtune",
    help="Fine-tune causal LMs from one Axolotl-style recipe: one process, N GPUs, or many nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (function, name) in the order --help shows them
COMMANDS = [
    (recipe_commands.validate, "validate"),
    (recipe_commands.plan, "plan"),
    (train_commands.train, "train"),
    (doctor_cmd.doctor, "doctor"),
    (rehearse_cmd.rehearse, "rehearse"),
    (train_commands.preprocess, "preprocess"),
    (recipe_commands.estimate, "estimate"),
    (recipe_commands.config_command, "config"),
    (post_commands.eval_command, "eval"),
    (post_commands.merge, "merge"),
    (post_commands.infer, "infer"),
    (post_commands.chat, "chat"),
    (post_commands.report, "report"),
    (train_commands.slurm, "slurm"),
    (train_commands.vllm_serve, "vllm-serve"),
    (checkpoint_cmd.checkpoint, "checkpoint"),
]
# train passes what follows `--` (and flags it doesn't know) to the launcher
CONTEXT_SETTINGS = {
    "train": {"allow_extra_args": True, "ignore_unknown_options": True},
    "rehearse": {"allow_extra_args": True, "ignore_unknown_options": True},
}

for function, name in COMMANDS:
    app.command(name=name, context_settings=CONTEXT_SETTINGS.get(name))(function)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmtune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Fine-tune causal LMs from one Axolotl-style recipe."""


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    if not {"--verbose", "-v"} & set(sys.argv[1:]):
        from llmtune.launch.console import quiet_libraries

        quiet_libraries()  # libraries' import-time noise, in this process (the ranks' goes through the Console)
    try:
        code = app(standalone_mode=False)  # click returns the exit code here instead of raising Exit
        # The interpreter's last garbage collection would walk every object the command imported (the report's
        # plotting library, for `train`); what the command wrote is closed, so leave the rest to the OS.
        import gc

        gc.freeze()
        sys.exit(code if isinstance(code, int) else 0)
    except UserError as err:
        typer.echo(f"error: {err.one_line()}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:  # click's errors (bad flags) arrive here in standalone_mode=False
        kinds = {klass.__name__ for klass in type(err).__mro__}
        if "ClickException" not in kinds:
            raise
        if "UsageError" not in kinds:
            err.show()
            sys.exit(err.exit_code)
        from llmtune.cli.usage import usage_error

        typer.echo(f"error: {usage_error(err).one_line()}", err=True)
        sys.exit(EXIT_USER_ERROR)
