"""CPU rehearsal: the few overrides that make accelerate run DeepSpeed and FSDP on CPU processes (gloo).

On GPUs none of this runs. On CPU, accelerate would otherwise give DeepSpeed no process group
(world size 1: every rank trains on the same batches) and turn FSDP into DDP. We create the
process state ourselves with gloo and tell the Trainer to use it; nothing in the libraries is
patched. Tests check the result behaves as on GPUs: sharded parameters, distinct data per
rank, and the same loss as a single-process run.
"""

from __future__ import annotations

import os


def configure(strategy: str) -> dict:
    """Create the gloo process state for this strategy; returns extra TrainingArguments."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if strategy.startswith("zero"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # cpu=False routes through accelerate's DeepSpeed branch, which initialises deepspeed.comm with gloo.
        state = PartialState(cpu=False, backend="gloo")
        assert state.distributed_type == DistributedType.DEEPSPEED, state.distributed_type
    else:
        state = PartialState(cpu=True, backend="gloo")
        if strategy.startswith("fsdp") or strategy == "tp":
            # AcceleratorState keeps the Trainer's FSDP plugin (and switches to FSDP) only when the process
            # state is a multi-accelerator one; for MULTI_CPU it drops the plugin and the Trainer runs DDP.
            # So label the state as the GPU run's MULTI_GPU: the Trainer's Accelerator then takes the same
            # FSDP path as on GPUs and relabels it FSDP. Device (cpu) and process group (gloo) stay as set.
            state.distributed_type = DistributedType.MULTI_GPU
            # accelerate names the CPU device "cpu:0"; FSDP1 compares it with torch's current CPU device "cpu"
            # and refuses to wrap ("Inconsistent compute device"). Same device, index-free name.
            state.device = torch.device("cpu")
            # No parameter offload on CPU (see fsdp_config); accelerate would otherwise read it from the launcher.
            os.environ["FSDP_OFFLOAD_PARAMS"] = "false"
            # Tensor parallelism: accelerate takes the Trainer's ParallelismConfig only for multi-device states
            # (FSDP2, MULTI_GPU, DeepSpeed); the same label lets the CPU ranks build the GPU run's device mesh.
    return {"accelerator_config": {"use_configured_state": True}}


def fsdp_config(config: dict) -> dict:
    """The Trainer's fsdp_config adjusted for CPU processes; distributed.setup passes FSDP plans through it."""
    # Parameters already live in CPU memory, and FSDP2's offload policy pins memory, which needs an accelerator.
    config = {**config, "cpu_offload": False}
    if config.get("version") != 1:
        return config
    if config.get("state_dict_type", "FULL_STATE_DICT") == "FULL_STATE_DICT":
        from llmtune.errors import UserError

        # accelerate gathers FSDP1 full state dicts with offload_to_cpu=True (hard-coded), and torch's
        # FlatParamHandle.to_cpu() frees the storage it "moved" when it already lives on CPU: rank 0
        # segfaults at the first checkpoint (pytorch/pytorch#188989).
        raise UserError(
            "FSDP1 cannot save a FULL_STATE_DICT on CPU (torch segfaults gathering it)",
            hint="rehearse with fsdp_version: 2, or fsdp_config.state_dict_type: SHARDED_STATE_DICT",
        )
    # accelerate's FSDP1 plugin broadcasts rank 0's weights through an accelerator device and raises
    # without one; every rank loads the same checkpoint from disk, so there is nothing to broadcast.
    return {**config, "sync_module_states": False}
