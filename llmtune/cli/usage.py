"""click's usage errors (an option the command lacks, a value of the wrong type, a missing argument) as llmtune's
one line with a hint, like every other user error: click's own four lines ended in a suggestion list, and
`llmtune plan --num_processes 2`, accelerate's spelling, didn't say which option was meant."""

from __future__ import annotations

import difflib

from llmtune.errors import UserError
from llmtune.launch.flags import THEIRS, long_options

PER_MACHINE = ("num_processes", "nproc_per_node", "num_gpus", "gpus")  # estimate asks the GPUs of one machine


def usage_error(err) -> UserError:
    """The one line for click's UsageError `err`."""
    ctx = getattr(err, "ctx", None)
    names, level = [], ctx
    while level is not None and level.parent is not None:  # the root's name is the program's (python -m, a wrapper)
        names.append(level.info_name)
        level = level.parent
    command = " ".join(["llmtune", *reversed(names)])
    if type(err).__name__ != "NoSuchOption" or ctx is None:
        return UserError(err.format_message().rstrip("."), f"see {command} --help")
    ours = long_options(ctx.command)
    flag = err.option_name
    twin = "--" + flag.lstrip("-").replace("_", "-")
    if twin != flag and twin in ours:
        return UserError(f"{flag} is spelled {twin} in {command}", f"use {twin}")
    theirs = THEIRS.get(flag.lstrip("-").replace("-", "_"))
    if theirs and theirs.split()[0] in ours:
        return UserError(f"{flag} is torchrun's (or DeepSpeed's launcher's); {command} takes {theirs}",
                         f"use {theirs.split(' (')[0]}")  # fmt: skip
    if flag.lstrip("-").replace("-", "_") in PER_MACHINE and "--gpus-per-machine" in ours:
        return UserError(f"{command} has no option {flag}: it counts GPUs per machine", "use --gpus-per-machine "
                         "(and --num-machines)")  # fmt: skip
    close = difflib.get_close_matches(twin, ours, n=1, cutoff=0.8)
    return UserError(
        f"{command} has no option {flag}", f"did you mean {close[0]}?" if close else f"see {command} --help"
    )
