"""Answers to `llmtune config` -> a commented recipe, and the command each machine runs. Pure: no prompts here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# Strategy keys `llmtune config` offers, their labels, and the estimate rows they correspond to.
STRATEGIES = {
    "ddp": ("DDP (one process per GPU, nothing sharded)", "single / DDP"),
    "zero1": ("DeepSpeed ZeRO-1 (optimizer states sharded)", "ZeRO-1"),
    "zero2": ("DeepSpeed ZeRO-2 (optimizer states and gradients sharded)", "ZeRO-2"),
    "zero3": ("DeepSpeed ZeRO-3 (everything sharded)", "ZeRO-3"),
    "zero2_offload": ("DeepSpeed ZeRO-2 + optimizer offload to CPU", "ZeRO-2 + CPU offload"),
    "zero3_offload": ("DeepSpeed ZeRO-3 + parameter and optimizer offload to CPU", "ZeRO-3 + CPU offload"),
    "zero3_nvme": ("DeepSpeed ZeRO-3 + offload to NVMe (ZeRO-Infinity)", "ZeRO-3 + NVMe offload"),
    "fsdp": ("FSDP full shard (everything sharded, torch native)", "FSDP full shard"),
    "fsdp_hybrid": ("FSDP hybrid shard (sharded within each machine, replicated across)", "FSDP hybrid shard"),
    "pipeline": ("Pipeline parallel (layers split over GPUs)", "pipeline"),
    "context_parallel": (
        "Context parallel (each row, and its activations, split over the GPUs; FSDP2)",
        "context parallel",
    ),
    "tensor_parallel": (
        "Tensor parallel (each layer, and its activations, split over a machine's GPUs)",
        "tensor parallel",
    ),
}
ROW_TO_STRATEGY = {row: key for key, (_, row) in STRATEGIES.items()}


@dataclass
class Answers:
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    method: str = "lora"  # full | lora | qlora
    dataset: str = "tatsu-lab/alpaca"
    dataset_type: str = "alpaca"
    dataset_extra: dict = field(default_factory=dict)  # e.g. field_messages for chat data
    sequence_len: int = 2048
    micro_batch_size: int = 2
    gradient_accumulation_steps: int = 4
    num_epochs: int = 1
    learning_rate: float | None = None  # None: by method
    gradient_checkpointing: bool = True
    mixed_precision: str = "bf16"  # bf16 | fp16 | no
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int = 29500
    gpus_per_machine: int = 1
    gpu_ids: str = "all"
    gpu_memory: str = "80GB"
    cpu_memory: str | None = None  # of one machine, for offload; None: not checked
    interconnect: str = "fast"
    same_network: bool = True  # accelerate config's "same local network?": no asks how the machines meet
    rdzv_backend: str = "static"  # static | c10d | etcd
    rdzv_endpoint: str | None = None  # etcd's host:port
    min_machines: int | None = None  # c10d: start once this many have joined
    torch_compile: bool = False  # accelerate config's dynamo question
    strategy: str = "ddp"
    nvme_path: str = "/local_nvme"
    fsdp_version: int = 2
    fsdp_state_dict_type: str = "FULL_STATE_DICT"
    fsdp_auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    fsdp_offload_params: bool = False
    pipeline_stages: int = 2
    pipeline_schedule: str = "1f1b"
    tensor_parallel_size: int = 2
    context_parallel_size: int = 2
    async_checkpoint: bool = False
    output_dir: str = "./outputs/run"

    @property
    def learning_rate_or_default(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 2e-5 if self.method == "full" else 2e-4


def block(comment: str, values: dict) -> str:
    body = yaml.safe_dump(values, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return "".join(f"# {line}\n" for line in comment.splitlines()) + body


def strategy_keys(answers: Answers) -> dict:
    key = answers.strategy
    if key == "ddp":
        return {}
    if key.startswith("zero"):
        values: dict = {"deepspeed": key}
        if key == "zero3_nvme":
            values["offload_nvme_path"] = answers.nvme_path
        return values
    if key.startswith("fsdp"):
        config = {
            "auto_wrap_policy": answers.fsdp_auto_wrap_policy,
            "state_dict_type": answers.fsdp_state_dict_type,
            "offload_params": answers.fsdp_offload_params,
        }
        values = {"fsdp_version": answers.fsdp_version, "fsdp_config": config}
        if key == "fsdp_hybrid" and answers.fsdp_version == 1:
            config["sharding_strategy"] = "HYBRID_SHARD"  # FSDP1's hybrid
            return values
        config["reshard_after_forward"] = True
        if key == "fsdp_hybrid":  # FSDP2's (HSDP): shards within a machine, replicas across (the rest of the world)
            values["dp_shard_size"] = answers.gpus_per_machine
        return values
    if key == "pipeline":
        return {"pipeline_parallel_size": answers.pipeline_stages, "pipeline_schedule": answers.pipeline_schedule}
    if key == "context_parallel":  # ring attention over whole rows: no packing (see recipe_text)
        return {"context_parallel_size": answers.context_parallel_size, "fsdp_version": 2}
    if key == "tensor_parallel":  # the other ranks shard with FSDP2 (across machines: sharded, then replicated)
        # transformers can't checkpoint the optimizer of a model sharded at load: weight snapshots only
        return {"tensor_parallel_size": answers.tensor_parallel_size, "fsdp_version": 2}
    raise ValueError(f"unknown strategy {key}")


def rendezvous_keys(answers: Answers) -> dict:
    """How machines not on one network meet: torchrun's elastic c10d rendezvous on rank 0, or an etcd server."""
    if answers.rdzv_backend == "etcd":
        return {"rdzv_backend": "etcd", "rdzv_endpoint": answers.rdzv_endpoint}
    keys: dict = {"rdzv_backend": "c10d"}
    if answers.min_machines and answers.min_machines < answers.num_machines:
        keys["min_machines"] = answers.min_machines
    return keys


def total_processes(answers: Answers) -> int:
    return answers.gpus_per_machine * answers.num_machines


def machine_commands(answers: Answers, recipe_path: str) -> list[str]:
    """The command to run on each machine (one line each)."""
    prefix = "" if answers.gpu_ids in ("all", "") else f"CUDA_VISIBLE_DEVICES={answers.gpu_ids} "
    base = f"{prefix}llmtune train {recipe_path} --num-processes {total_processes(answers)}"
    if answers.num_machines == 1:
        return [base]
    return [
        f"{base} --num-machines {answers.num_machines} --machine-rank {rank} "
        f"--main-process-ip {answers.main_process_ip} --main-process-port {answers.main_process_port}"
        for rank in range(answers.num_machines)
    ]


def recipe_text(answers: Answers, recipe_path: str, estimate_line: str | None, written_on: str) -> str:
    """The commented recipe. Keys are Axolotl's, so the file also reads as an Axolotl config."""
    header = [f"Written by `llmtune config` on {written_on}. Check it with: llmtune validate {recipe_path}"]
    label = STRATEGIES[answers.strategy][0]
    header.append(f"Strategy: {label}, on {answers.num_machines} machine(s) x {answers.gpus_per_machine} GPU(s).")
    blocks = [header_block(header, answers, recipe_path, estimate_line)]
    blocks.append(block("The model: a hub id or a local folder.", {"base_model": answers.base_model}))
    if answers.method != "full":
        adapter = {"adapter": answers.method, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                   "lora_target_linear": True}  # fmt: skip
        if answers.method == "qlora":
            adapter["load_in_4bit"] = True
        blocks.append(block(f"{answers.method.upper()}: train low-rank adapters on every linear layer.", adapter))
    dataset = {"path": answers.dataset, "type": answers.dataset_type, **answers.dataset_extra}
    blocks.append(block("Data: a local file or a hub dataset, and its format.", {"datasets": [dataset]}))
    training = {
        "sequence_len": answers.sequence_len, "sample_packing": answers.strategy != "context_parallel",
        "micro_batch_size": answers.micro_batch_size,
        "gradient_accumulation_steps": answers.gradient_accumulation_steps, "num_epochs": answers.num_epochs,
        "learning_rate": answers.learning_rate_or_default, "lr_scheduler": "cosine", "warmup_ratio": 0.03,
        "gradient_checkpointing": answers.gradient_checkpointing,
    }  # fmt: skip
    blocks.append(block("Training. Global batch = micro_batch_size x gradient_accumulation_steps x data-parallel "
                         "ranks.", training))  # fmt: skip
    # "no" is written out: a recipe without bf16 is bf16: auto (Axolotl's default)
    blocks.append(block("Mixed precision.", {"bf16": False} if answers.mixed_precision == "no"
                        else {answers.mixed_precision: True}))  # fmt: skip
    return "\n".join(blocks + closing_blocks(answers, label))


def header_block(header: list[str], answers: Answers, recipe_path: str, estimate_line: str | None) -> str:
    """The recipe's opening comment: `header`, the estimate, and the command for each machine."""
    header = header + ([estimate_line] if estimate_line else [])
    header.append("Run it:" if answers.num_machines == 1 else "Run on each machine (rank 0 first):")
    header += [f"  {line}" for line in machine_commands(answers, recipe_path)]
    return "\n".join(f"# {line}" for line in header) + "\n"


def closing_blocks(answers: Answers, label: str) -> list[str]:
    """The strategy's keys (when it has any) and where the outputs go."""
    keys = strategy_keys(answers)
    if answers.num_machines > 1 and answers.rdzv_backend != "static":
        keys = {**keys, **rendezvous_keys(answers)}
    blocks = (
        [block(f"Distributed: {label}. llmtune writes the DeepSpeed/accelerate configs from this.", keys)]
        if keys
        else []
    )
    if answers.torch_compile:
        blocks.append(block("Compile the model with torch.compile (inductor).", {"torch_compile": True}))
    saving = {"output_dir": answers.output_dir, "save_strategy": "steps", "save_steps": 200, "save_total_limit": 2}
    if answers.async_checkpoint:  # written by a background thread while training goes on
        saving["async_checkpoint"] = True
    blocks.append(block("Where the model, checkpoints and report go (auto-resumes from here).", saving))
    return blocks


# what each format the wizard offers reads from a row (chat_template: one of them)
TYPE_FIELDS = {"alpaca": ("instruction", "output"), "chat_template": ("messages", "conversations"),
               "completion": ("text",), "input_output": ("segments",)}  # fmt: skip


def first_row(path: Path) -> dict | None:
    """A local JSON/JSONL file's first row (None: not readable as one)."""
    try:
        with path.open(encoding="utf-8") as handle:
            first = handle.readline().strip()
            if first.startswith("["):  # a JSON array
                handle.seek(0)
                rows = json.load(handle)
                row = rows[0] if rows else {}
            else:
                row = json.loads(first) if first else {}
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None
    return row if isinstance(row, dict) else None


def format_mismatch(path: Path, kind: str, extra: dict) -> str | None:
    """Why a local file's first row can't be read as `kind` (its fields), else None."""
    row = first_row(path)
    needed = TYPE_FIELDS.get(kind)
    if row is None or needed is None:
        return None
    if kind == "chat_template":
        needed = (extra["field_messages"],) if extra.get("field_messages") else needed
        if any(name in row for name in needed):
            return None
        want = " or ".join(f"'{name}'" for name in needed)
    else:
        missing = [name for name in needed if name not in row]
        if not missing:
            return None
        want = " and ".join(f"'{name}'" for name in missing)
    return f"{path}: its first row has the fields {', '.join(map(repr, row)) or '(none)'}, and type {kind} reads {want}"


def guess_dataset_type(path: Path) -> tuple[str, dict] | None:
    """From a local JSON/JSONL file's first row: alpaca, chat_template (with its field names) or completion."""
    row = first_row(path)
    if row is None:
        return None
    if "instruction" in row and "output" in row:
        return "alpaca", {}
    for name in ("messages", "conversations"):
        turns = row.get(name)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            extra: dict = {} if name == "messages" else {"field_messages": name}
            if "from" in turns[0]:  # ShareGPT style
                extra["message_property_mappings"] = {"role": "from", "content": "value"}
                extra["roles"] = {"user": ["human"], "assistant": ["gpt"], "system": ["system"]}
            return "chat_template", extra
    if "segments" in row:
        return "input_output", {}
    if "text" in row:
        return "completion", {}
    return None
