"""FSDP1 sharded checkpoints: the optimizer state read back whole, at the world size that saved it or another.

accelerate (1.15) reads an FSDP1 sharded optimizer checkpoint (`optimizer_0/`, torch's distributed checkpoint) into a
template made by `FSDP.optim_state_dict` from the fresh optimizer. A fresh optimizer has no state yet, so the
template holds only the parameter groups and the Adam moments and step counts are silently not loaded, at any world
size: the resumed run trains on with a new optimizer. `get_optimizer_state_dict` builds the template with the state
initialised, under the parameters' full names; DCP then reads every value into it, resharding by global offsets
when the world size changed, and `set_optimizer_state_dict` puts it in the optimizer.
"""

from __future__ import annotations

from pathlib import Path

OPTIMIZER_FOLDER = "optimizer_0"  # accelerate's name for the first optimizer's sharded state


def sharded_optimizer(checkpoint: str | Path) -> Path | None:
    folder = Path(checkpoint) / OPTIMIZER_FOLDER
    return folder if (folder / ".metadata").is_file() else None


def load_sharded_optimizer(model, optimizer, folder: Path) -> None:
    """Load `folder` (DCP, as accelerate saved it) into `optimizer` of the FSDP1-wrapped `model`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    template = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(template, checkpoint_id=str(folder))
    set_optimizer_state_dict(model, optimizer, template["optimizer"])


def load_optimizer_and_scheduler(trainer, checkpoint: str) -> bool:
    """An FSDP1 run's optimizer from a sharded checkpoint and its scheduler; False when this doesn't apply."""
    folder = sharded_optimizer(checkpoint)
    if folder is None or not (trainer.plan and trainer.plan["strategy"] == "fsdp1"):
        return False
    import torch

    load_sharded_optimizer(trainer.model_wrapped, getattr(trainer.optimizer, "optimizer", trainer.optimizer), folder)
    trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True))
    return True
