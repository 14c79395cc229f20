"""The accelerate config file (the one `accelerate config` would write) for a plan."""

from __future__ import annotations

from typing import Any

from llmtune.plan.cluster import Cluster

DISTRIBUTED_TYPE = {
    "single": "NO",
    "ddp": "MULTI_GPU",
    "pipeline": "MULTI_GPU",
    "fsdp1": "FSDP",
    "fsdp2": "FSDP",
    "tp": "MULTI_GPU",
}  # tp: the model arrives sharded (transformers), the Trainer adds the mesh


def fsdp_section(version: int, fsdp) -> dict[str, Any]:
    """accelerate's fsdp_config keys from llmtune's FSDP settings.

    Without an explicit layer class, accelerate wraps the model's own `_no_split_modules` (its decoder layer
    class): guessing a class name from the architecture would fail for models whose layers are named otherwise.
    """
    section: dict[str, Any] = {
        "fsdp_version": version,
        "fsdp_auto_wrap_policy": fsdp.auto_wrap_policy,
        "fsdp_offload_params": fsdp.offload_params,
        "fsdp_state_dict_type": fsdp.state_dict_type,
        "fsdp_cpu_ram_efficient_loading": fsdp.cpu_ram_efficient_loading,
        "fsdp_activation_checkpointing": fsdp.activation_checkpointing,
    }
    if fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and fsdp.transformer_layer_cls_to_wrap:
        section["fsdp_transformer_layer_cls_to_wrap"] = fsdp.transformer_layer_cls_to_wrap
    if fsdp.auto_wrap_policy == "SIZE_BASED_WRAP":
        section["fsdp_min_num_params"] = fsdp.min_num_params
    if version == 2:
        reshard = fsdp.reshard_after_forward
        section["fsdp_reshard_after_forward"] = (
            reshard if reshard is not None else fsdp.sharding_strategy != "SHARD_GRAD_OP"
        )
    else:
        section.update(
            fsdp_sharding_strategy=fsdp.sharding_strategy,
            fsdp_use_orig_params=fsdp.use_orig_params,
            fsdp_sync_module_states=fsdp.sync_module_states,
            fsdp_backward_prefetch=fsdp.backward_prefetch,
            fsdp_forward_prefetch=fsdp.forward_prefetch,
        )
        if fsdp.limit_all_gathers is not None:  # written only when the recipe sets it: accelerate's default is true
            section["fsdp_limit_all_gathers"] = fsdp.limit_all_gathers
    return section


def build_accelerate_config(
    strategy: str,
    cluster: Cluster,
    precision: str,
    deepspeed_path: str | None = None,
    zero_stage: int = 0,
    fsdp: dict | None = None,
    rdzv_backend: str = "static",
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED" if deepspeed_path else DISTRIBUTED_TYPE[strategy],
        "num_machines": cluster.num_machines,
        "num_processes": cluster.num_processes,
        "machine_rank": cluster.machine_rank,
        "main_process_ip": cluster.main_process_ip,
        "main_process_port": cluster.main_process_port,
        "rdzv_backend": rdzv_backend,
        # static: ranks meet at main_process_ip:port as MASTER_ADDR/PORT; c10d: that address is the rendezvous
        # endpoint (accelerate passes it as --rdzv_endpoint only when same_network is off)
        "same_network": rdzv_backend == "static",
        "main_training_function": "main",
        "mixed_precision": precision,
        "gpu_ids": "all",
        "use_cpu": False,  # CPU rehearsal still needs the multi-process launcher; the worker picks gloo
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
    }
    if deepspeed_path:
        # With a DeepSpeed JSON, precision lives in the JSON; accelerate refuses both.
        del config["mixed_precision"]
        config["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_path,
            "zero3_init_flag": zero_stage == 3,
            "deepspeed_multinode_launcher": "standard",
        }
    if fsdp:
        config["fsdp_config"] = fsdp
    return config
