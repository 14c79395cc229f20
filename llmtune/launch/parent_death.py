"""`python -m llmtune.launch.parent_death LAUNCHER_PID COMMAND...`: the launched process (torchrun's agent, or the one
rank) gets SIGTERM when llmtune's launcher dies however it dies (kill -9, the OOM killer), and stops its ranks; in
their own session, nothing else would stop them.

Linux's parent-death signal is armed here, then this process becomes COMMAND (exec keeps the signal). It is not
armed from Popen's preexec_fn: that runs Python between fork and exec, with the at-fork hooks of every imported
module (logging's printed "cannot release un-acquired lock" tracebacks into the ranks' output).
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def arm(launcher: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    launcher, command = int(argv[0]), argv[1:]
    arm(launcher)
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"error: can't start {command[0]}: {err.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
