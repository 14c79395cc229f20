"""Test hooks (environment variables the integration tests set, read nowhere else): kill this rank at a known step, to
prove that what a crash leaves behind resumes."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def test_kill(variable: str, step: int) -> None:
    """Tests only: SIGKILL this rank at step k (LLMTUNE_TEST_...=k, on LLMTUNE_TEST_KILL_RANK, default the last)."""
    wanted = os.environ.get(variable)
    if not wanted or int(wanted) != step:
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if int(os.environ.get("RANK", 0)) != int(os.environ.get("LLMTUNE_TEST_KILL_RANK", world - 1)):
        return
    once = os.environ.get("LLMTUNE_TEST_KILL_ONCE_FILE")  # kill only the first time (elastic restart tests)
    if once:
        if os.path.exists(once):
            return
        Path(once).touch()
    # a last line in this rank's log, so a test can see the failure report show the right rank's tail
    print(f"test hook {variable}: rank {os.environ.get('RANK', 0)} kills itself at step {step}", file=sys.stderr,
          flush=True)  # fmt: skip
    os.kill(os.getpid(), signal.SIGKILL)


def write_probe(trainer, row: dict) -> None:
    """For tests: logits of the in-memory model at the end of training on the first row (LLMTUNE_PROBE_FILE)."""
    target = os.environ.get("LLMTUNE_PROBE_FILE")
    if not target:
        return
    import torch
    from safetensors.torch import save_file

    model = trainer.model
    model.eval()
    ids = torch.tensor([row["input_ids"]], device=trainer.args.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
    if int(os.environ.get("RANK", 0)) == 0:
        save_file({"input_ids": ids.cpu(), "logits": logits.contiguous()}, target)
