"""Checkpoint states through torch's distributed checkpoint (DCP): each rank writes what it holds (its DTensor shards
under FSDP2/TP, one copy of replicated states), and a later run reads them back at any world size.

Two users:
- tensor-parallel runs, whose optimizer transformers can't checkpoint (written synchronously, `tp_state/`);
- `async_checkpoint: true` (single, DDP, FSDP2, HSDP, TP, CP): `AsyncSaver` copies the states into pinned host memory
  (the only stall), then a background thread writes them (`dcp_state/`) while training goes on. The checkpoint
  becomes visible to resume only once every rank's write has finished (the trainer publishes it then), the next save
  waits for the previous write, and the end of training waits for the last.

DCP's background thread gathers the ranks' write results over its own gloo group, apart from the training's
collectives (which may be NCCL, and run on the main thread meanwhile).
"""

from __future__ import annotations

import time
from pathlib import Path

from llmtune.train.runtime import collectives

STATE = "dcp_state"  # model and optimizer states of an async checkpoint
TP_STATE = "tp_state"  # the same, written synchronously by tensor-parallel runs


def folder_of(checkpoint) -> Path | None:
    """The checkpoint's DCP state folder, if it has one."""
    if not checkpoint:
        return None
    for name in (STATE, TP_STATE):
        folder = Path(checkpoint) / name
        if folder.is_dir():
            return folder
    return None


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen weights (a LoRA's base, 4-bit ones) never change: the run's model has them already at resume
    return StateDictOptions(ignore_frozen_params=trainable_only)


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper around the torch optimizer


def states(model, optimizer, trainable_only: bool) -> dict:
    """This rank's model and optimizer states as DCP keys them (the optimizer initialised if it has not stepped)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(trainable_only)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, _inner(optimizer), options=options)}  # fmt: skip


def save(model, optimizer, folder: Path, trainable_only: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(states(model, optimizer, trainable_only), checkpoint_id=str(folder), no_dist=not collectives.active())


def load_model(model, folder: Path, trainable_only: bool = False) -> None:
    """The model's states from `folder`, into this rank's shards (another world size reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    options = _options(trainable_only)
    state = {"model": get_model_state_dict(model, options=options)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=not collectives.active())
    set_model_state_dict(model, state["model"], options=options)


def load_optimizer(model, optimizer, folder: Path, trainable_only: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    options = _options(trainable_only)
    state = {"optimizer": get_optimizer_state_dict(model, _inner(optimizer), options=options)}  # the templates
    dcp.load(state, checkpoint_id=str(folder), no_dist=not collectives.active())
    set_optimizer_state_dict(model, _inner(optimizer), state["optimizer"], options=options)


class AsyncSaver:
    """One asynchronous write at a time: `start` stages and hands the write to a thread; `finished_everywhere` says
    (the same on every rank) whether every rank's write is done; `wait` blocks until this rank's is."""

    def __init__(self, on_cuda: bool) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # pinned buffers for a GPU's copies; staged synchronously: the next optimizer step must not change the
        # weights while they are copied. The stager keeps its buffers from one checkpoint to the next.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=on_cuda))  # fmt: skip
        self.group = collectives.checkpoint_group()
        if self.group is None:  # one process: DCP says it assumes so, on every save
            import warnings

            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self.future = None
        self.write_started = 0.0
        self.write_ended: float | None = None

    def start(self, state: dict, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self.write_ended = None
        kwargs = {"process_group": self.group} if collectives.active() else {"no_dist": True}
        writer = _test_writer(folder)
        if writer is not None:
            kwargs["storage_writer"] = writer
        self.future = dcp.async_save(state, checkpoint_id=str(folder), async_stager=self.stager, **kwargs)
        self.write_started = time.perf_counter()
        self.future.add_done_callback(self._ended)

    def _ended(self, _future) -> None:
        self.write_ended = time.perf_counter()

    @property
    def pending(self) -> bool:
        return self.future is not None

    def finished_everywhere(self) -> bool:
        """Every rank's write is done (one host all-reduce over gloo; never waits for a GPU)."""
        if self.future is None:
            return True
        return not collectives.any_rank_on_host(not self.future.done())

    def wait(self) -> float:
        """Block until this rank's write is done (raising what it raised); the seconds waited."""
        if self.future is None:
            return 0.0
        began = time.perf_counter()
        self.future.result()
        return time.perf_counter() - began

    def write_seconds(self) -> float | None:
        return None if self.write_ended is None else self.write_ended - self.write_started

    def clear(self) -> None:
        self.future = None

    def close(self) -> None:
        self.stager.close()


def _test_writer(folder: Path):
    """Tests only: LLMTUNE_TEST_KILL_IN_ASYNC_WRITE=k: the last rank kills itself in the middle of checkpoint k's
    background write, after its data files and before DCP's metadata (and so before the marker)."""
    import os

    wanted = os.environ.get("LLMTUNE_TEST_KILL_IN_ASYNC_WRITE")
    kill = bool(wanted) and folder.parent.name == f"checkpoint-{wanted}"
    delay = float(os.environ.get("LLMTUNE_TEST_ASYNC_WRITE_SECONDS", 0))  # a slow disk: each write takes this long
    if not kill and not delay:
        return None
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    class TestWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(delay)
            written = super().write_data(plan, planner)
            written.wait()
            world = int(os.environ.get("WORLD_SIZE", 1))
            if kill and int(os.environ.get("RANK", 0)) == world - 1:
                print(f"test hook: rank {world - 1} kills itself in the middle of writing {folder}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return written

    return TestWriter(str(folder))
