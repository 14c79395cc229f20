"""CPU rehearsal: the few overrides that make accelerate run DeepSpeed and FSDP on CPU processes (gloo).

On GPUs none of this runs. On CPU, accelerate would otherwise give DeepSpeed no process group
(world size 1: every rank trains on the same batches) and turn FSDP into DDP. We create the
process state ourselves with gloo and tell the Trainer to use it; no library code is patched (the
private hooks used are listed in docs/private-api.md). Tests check the result behaves as on GPUs:
sharded parameters, distinct data per rank, and the same loss as a single-process run.
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
        # DeepSpeed's CPU accelerator builds (a ~60 s compile on a fresh machine) and loads a shared-memory
        # all-reduce in every rank; it serves only inference_all_reduce (inference, AutoTP), which ZeRO training
        # never calls, and a GPU run has no such op. DeepSpeed keeps its op probe in one module dict whose edits
        # persist; marking the op unavailable there leaves deepspeed.comm on gloo, as the training collectives are.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
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


def context_parallel_on_cpu() -> None:
    """torch's context parallel on CPU processes: ring attention over the CPU SDPA kernel.

    torch shards q/k/v along the sequence and routes the SDPA kernels it knows (flash, memory-efficient, cuDNN:
    all CUDA) to its ring attention; the CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`, with its
    backward) has neither a sharding rule nor a route, so a CPU rank fails with "no sharding strategy". This
    registers both, with torch's own ring attention templates around the CPU kernel: the same algorithm (K/V
    passed round the ring, partial outputs merged by their log-sum-exp, round-robin load balance) as on GPUs,
    only the per-chunk kernel differs. GPUs never run this.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import register_sharding
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.distributed.tensor.placement_types import Shard

    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dispatcher = DTensor._op_dispatcher
    if forward in dispatcher._custom_op_handlers:
        return
    seq = 2  # (batch, heads, sequence, head_dim)

    def sharded(inputs: int, outputs: int):
        """Every tensor input and output sharded along the sequence, the one layout ring attention takes."""
        return lambda *args, **kwargs: [([Shard(seq)] * outputs, [Shard(seq)] * inputs)]

    def kernel(query, key, value, is_causal, dropout_p=0.0, scale=None):
        return forward(query, key, value, dropout_p, is_causal, scale=scale)

    def kernel_backward(grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None):
        return backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)

    def handler(op_call, args, kwargs):
        info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        group = info.compute_mesh.get_group()
        local, options = info.local_args, dict(info.local_kwargs)
        if options.get("attn_mask") is not None:
            raise NotImplementedError("context parallel takes causal attention without a mask")
        if op_call is forward:
            given = {"dropout_p": 0.0, "is_causal": False, **dict(zip(("dropout_p", "is_causal"), local[3:5], strict=False)),
                     **{k: options[k] for k in ("dropout_p", "is_causal") if k in options}}  # fmt: skip
            result = ring._templated_ring_attention(group, seq, kernel, *local[:3], is_causal=given["is_causal"],
                                                    dropout_p=given["dropout_p"], scale=options.get("scale"))[:2]  # fmt: skip
        else:
            grad_out, q, k, v, out, logsumexp, dropout_p, is_causal = local[:8]
            result = ring._templated_ring_attention_backward(
                group, seq, kernel_backward, grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v,
                out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=options.get("scale"),
            )[:3]  # fmt: skip
        return dispatcher.wrap(tuple(result), info.output_sharding.output_spec)

    register_sharding(forward)(sharded(3, 2))  # q, k, v -> out, logsumexp
    register_sharding(backward)(sharded(6, 3))  # grad_out, q, k, v, out, logsumexp -> grad q, k, v
    dispatcher._custom_op_handlers[forward] = handler
    dispatcher._custom_op_handlers[backward] = handler
