"""What `llmtune train` takes from its command line and environment beyond its own options.

Flags it doesn't know go to `accelerate launch`, but only those that don't decide what the plan decides: the
strategy, precision, batch, rendezvous and logs come from the recipe, and a flag that set them anyway either
crashed every rank (`--config_file` of another strategy, `--use_fsdp`) or changed the run behind the plan's back
(`--mixed_precision bf16` trained in bf16 under a plan saying fp32). Each such flag is one line naming the recipe key
that says it. A word that isn't a flag (a second recipe, a script after `--`) became accelerate's training script,
run as Python on every rank. Variables a launcher sets for its ranks (WORLD_SIZE, RANK, ...) inherited from the
shell made one process believe it was one of several.
"""

from __future__ import annotations

import os

from llmtune.errors import UserError

_DEEPSPEED = ("DeepSpeed's settings come from the recipe", "set deepspeed: (a preset such as zero3, or a JSON file)")
_FSDP = ("FSDP's settings come from the recipe", "set fsdp_version: 2 and fsdp_config: {...} in the recipe")
_PARALLEL = ("the parallel sizes come from the recipe",
             "set tensor_parallel_size, context_parallel_size or dp_shard_size in the recipe")  # fmt: skip
# accelerate launch's flag (underscores) -> (why llmtune doesn't take it, hint)
PLANNED = {
    "config_file": ("llmtune writes the accelerate config from the recipe (llmtune plan shows it)",
                    "put deepspeed:, fsdp_version/fsdp_config: or the parallel sizes in the recipe"),
    "mixed_precision": ("the recipe's bf16/fp16 set the precision", "set bf16: true (or fp16: true) in the recipe"),
    "downcast_bf16": ("the recipe's bf16/fp16 set the precision", "set bf16: true in the recipe"),
    "gradient_accumulation_steps": ("the recipe sets the batch", "set gradient_accumulation_steps in the recipe"),
    "gradient_clipping": ("the recipe sets gradient clipping", "set max_grad_norm in the recipe"),
    "use_deepspeed": _DEEPSPEED, "zero_stage": _DEEPSPEED, "offload_optimizer_device": _DEEPSPEED,
    "offload_param_device": _DEEPSPEED, "offload_optimizer_nvme_path": _DEEPSPEED,
    "offload_param_nvme_path": _DEEPSPEED, "zero3_init_flag": _DEEPSPEED, "zero3_save_16bit_model": _DEEPSPEED,
    "deepspeed_config_file": _DEEPSPEED, "deepspeed_moe_layer_cls_names": _DEEPSPEED,
    "use_fsdp": _FSDP, "use_parallelism_config": _PARALLEL,
    "use_megatron_lm": ("llmtune doesn't plan Megatron-LM", "set tensor_parallel_size / pipeline_parallel_size"),
    "deepspeed_hostfile": ("llmtune takes the machines from --hostfile", "use --hostfile (with --launcher deepspeed)"),
    "deepspeed_multinode_launcher": ("llmtune chooses the launcher", "use --launcher deepspeed or accelerate"),
    "deepspeed_inclusion_filter": ("llmtune takes the machines from --hostfile", "list only those in the hostfile"),
    "deepspeed_exclusion_filter": ("llmtune takes the machines from --hostfile", "list only those in the hostfile"),
    "mpirun_hostfile": ("llmtune takes the machines from --hostfile", "use --hostfile"),
    "rdzv_backend": ("the recipe sets the rendezvous (llmtune waits on it and says who is missing)",
                     "set rdzv_backend: c10d (or etcd, static) in the recipe"),
    "rdzv_conf": ("the recipe sets the rendezvous", "set rdzv_backend and rdzv_timeout in the recipe"),
    "log_dir": ("llmtune sets it: each rank's output goes to output_dir/llmtune/logs, which its failure report reads",
                "remove it"),
    "tee": ("llmtune sets it: each rank's output goes to output_dir/llmtune/logs, which its failure report reads",
            "remove it"),
    "module": ("llmtune runs its own training module", "remove it"),
    "no_python": ("llmtune runs its own training module", "remove it"),
    "main_training_function": ("llmtune runs its own training module", "remove it"),
    "gpu_ids": ("the plan counts the GPUs it is given", "set CUDA_VISIBLE_DEVICES=0,1 before llmtune train"),
    "cpu": ("the device is llmtune's", "use --device cpu"),
    "use_cpu": ("the device is llmtune's", "use --device cpu"),
}  # fmt: skip
PREFIXES = {"fsdp_": _FSDP, "megatron_lm_": PLANNED["use_megatron_lm"], "parallelism_config_": _PARALLEL,
            "dynamo_": ("the recipe sets compilation", "set torch_compile: true (torch_compile_backend) in the recipe"),
            "fp8_": ("llmtune doesn't train in FP8 (the recipe's bf16/fp16 set the precision)", "remove it")}  # fmt: skip
SHORT = {"-m": "module", "-t": "tee"}
# torchrun's spellings, and other launchers', of what llmtune's own options say
THEIRS = {"nproc_per_node": "--num-processes (all processes: nproc_per_node x nnodes)",
          "nnodes": "--num-machines", "node_rank": "--machine-rank", "master_addr": "--main-process-ip",
          "master_port": "--main-process-port", "rdzv_endpoint": "--main-process-ip and --main-process-port (c10d's "
          "endpoint; --rdzv-endpoint is the etcd server of rdzv_backend: etcd)", "standalone": "--num-processes N",
          "num_gpus": "--num-processes", "num_nodes": "--num-machines"}  # fmt: skip


def long_options(command) -> list[str]:
    """A click command's own --options: what a launcher spelling or a misspelling is checked against."""
    return sorted({opt for param in command.params for opt in getattr(param, "opts", []) if opt.startswith("--")})


def planned_flag(flag: str) -> UserError | None:
    """The refusal of an accelerate flag whose setting the plan makes from the recipe, or a torchrun spelling."""
    name = SHORT.get(flag) or flag.lstrip("-").replace("-", "_")
    found = PLANNED.get(name) or next((v for k, v in PREFIXES.items() if name.startswith(k)), None)
    if found:
        return UserError(f"{flag}: {found[0]}", found[1])
    if name in THEIRS:
        return UserError(f"{flag} is torchrun's (or DeepSpeed's launcher's); llmtune train takes {THEIRS[name]}",
                         f"use {THEIRS[name].split(' (')[0]}")  # fmt: skip
    return None


def stray_word(extra: list[str]) -> str | None:
    """A word that isn't a flag nor a flag's value: accelerate launch would run it as the training script."""
    import contextlib
    import io

    from accelerate.commands.launch import launch_command_parser

    sentinel = "__llmtune_training_module__"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed, _ = launch_command_parser().parse_known_args([*extra, sentinel])
    except SystemExit:
        return None  # a value accelerate refuses: said by the launcher, which knows the flag
    return None if parsed.training_script == sentinel else parsed.training_script


INHERITED = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_inherited_environment() -> None:
    """A launcher's variables in llmtune train's own environment (a shell that ran torchrun, a job script that
    exported them): llmtune starts its processes and sets them, and an inherited WORLD_SIZE made one process wait
    for ranks that never came (or say the launcher started 4), an inherited RANK a traceback from torch."""
    found = [f"{key}={os.environ[key]}" for key in INHERITED if key in os.environ]
    if found:
        raise UserError(f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} set in the environment: llmtune "
                        "train starts its own processes and sets these for them",
                        f"unset {' '.join(item.split('=')[0] for item in found)}; for several processes pass "
                        "--num-processes (and --num-machines, --main-process-ip, --main-process-port)")  # fmt: skip


def check_cuda_usable(device: str) -> None:
    """--device cuda on this machine's processes: torch must see a GPU (each rank divided its local rank by a GPU
    count of 0, a ZeroDivisionError on every rank). Asked of torch only where the plan runs here."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise UserError(f"--device cuda, but torch sees no usable GPU on this machine{shown}",
                        "run it on a GPU machine, or pass --device cpu to rehearse the run on CPU processes")  # fmt: skip
