import atexit
import os
import sys

# Before torch first allocates on a GPU: expandable segments grow one mapping instead of caching blocks of fixed
# sizes, so reserved memory stays close to allocated when shapes change (measured on an H100: 1B full fine-tune
# over variable-length padded batches reserved 29% above its allocated peak without it). A user's own setting wins.
from llmtune.plan.memory.buffers import ALLOC_CONF, EXPANDABLE_DEFAULT, allocator_setting  # torch-free

if allocator_setting(os.environ) is None:
    os.environ[ALLOC_CONF[0]] = EXPANDABLE_DEFAULT

_exit_code = 1  # what an exception that escapes main() exits with


def _leave() -> None:
    """Registered first, so it runs last of the exit handlers (trackers', logging's): the rank's files are written
    and its process group destroyed, so end here instead of finalizing the interpreter. Finalization tears down
    modules while gloo's worker threads and the DDP reducer may still hold the process group; a rank that stopped on
    request was seen to abort there ("terminate called without an active exception", SIGABRT) after a complete save.
    It also skips the last garbage collection over every object torch made (1.5-2 s of a tiny run)."""
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_exit_code)


atexit.register(_leave)

from llmtune.train.worker import main  # noqa: E402

try:
    _exit_code = main(sys.argv[1:])
except SystemExit as stop:  # sys.exit() deeper down: keep its code
    _exit_code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    raise
sys.exit(_exit_code)
