"""Model-state bytes this rank actually holds, measured at an optimizer step: the check on `llmtune estimate`.

Measured just before the second optimizer step (the first creates the optimizer states), when parameters,
gradients and optimizer states all exist. Tensors are counted by their storage, once each, so views into
one flat buffer (DeepSpeed's flat groups, FSDP's padded shards) are counted as the buffer they live in:
- params: what the model holds for its parameters (ZeRO-3 partition, FSDP2 local shard, else the tensor);
- grads: the gradients of the model's and of the optimizer's parameters (DeepSpeed's fp32 partitions);
- optimizer: the optimizer's own parameters when they are not the model's (master weights) and its states.
"""

from __future__ import annotations

from typing import Any


def local_tensor(tensor):
    """What this rank holds of a tensor: its ZeRO-3 partition, its FSDP2 local shard, else the tensor itself."""
    if tensor is None:
        return None
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    return tensor


class _Counter:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = {"params": 0, "grads": 0, "optimizer": 0}

    def add(self, kind: str, tensor) -> None:
        tensor = local_tensor(tensor)
        if tensor is None or not hasattr(tensor, "untyped_storage") or tensor.numel() == 0:
            return
        if hasattr(type(tensor), "__tensor_flatten__"):
            # a tensor subclass (torchao's 8/4-bit optimizer states, quantized weights): it has no storage of its
            # own; its bytes are those of the plain tensors it is made of (codes, scales, ...)
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                self.add(kind, getattr(tensor, name))
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()


def _engine_gradient_buffers(engine):
    """DeepSpeed's ZeRO optimizer keeps the gradient partitions in its own buffers, off the parameters."""
    zero = getattr(engine, "optimizer", None)
    for name in ("grad_partitions_flat_buffer", "grads_in_partition"):  # ZeRO-3, ZeRO-2
        yield getattr(zero, name, None)
    for tensors in (getattr(zero, "averaged_gradients", None) or {}).values():
        yield from tensors or []


def model_state_bytes(model, optimizer, engine=None) -> dict[str, int]:
    counter = _Counter()
    params = list(model.parameters())
    for param in params:
        counter.add("params", param)
    for param in params:
        counter.add("grads", param.grad)
    # DeepSpeed steps one param group at a time (param_groups shows only the current one); the states
    # are keyed by every group's parameters
    held = [p for group in optimizer.param_groups for p in group["params"]] + list(optimizer.state.keys())
    for param in held:
        counter.add("optimizer", param)  # skipped when it is the model's own parameter (seen above)
        counter.add("grads", getattr(param, "grad", None))
    for tensor in _engine_gradient_buffers(engine):
        counter.add("grads", tensor)
    for state in optimizer.state.values():
        for value in state.values():
            counter.add("optimizer", value)
    return counter.bytes


class ModelStateMeter:
    """Measures at the optimizer steps that find optimizer states allocated, and keeps the largest total.

    DeepSpeed's ZeRO-1/2 steps one param group at a time, each with only its own fp32 gradient partition
    alive, so a few steps are measured and the fullest moment wins.
    """

    MEASUREMENTS = 6

    def __init__(self, model, engine=lambda: None) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.model = model
        self.engine = engine
        self.result: dict[str, int] | None = None
        self.measured = 0
        self._handle = register_optimizer_step_pre_hook(self._hook)

    def _hook(self, optimizer, args: Any, kwargs: Any) -> None:
        if not any(len(state) for state in optimizer.state.values()):
            return
        found = model_state_bytes(self.model, optimizer, self.engine())
        if self.result is None or sum(found.values()) > sum(self.result.values()):
            self.result = found
        self.measured += 1
        if self.measured >= self.MEASUREMENTS:
            self.close()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def cuda_peaks() -> dict[str, int]:
    """This rank's peak CUDA memory, as the caching allocator saw it (empty on CPU): what the estimate must cover.

    Allocated is what tensors held; reserved adds what the allocator kept from the driver (fragmentation), and is
    what runs out first.
    """
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    import os

    from llmtune.plan.memory.buffers import allocator_setting

    return {"cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "cuda_alloc_conf": allocator_setting(os.environ)}  # fmt: skip
