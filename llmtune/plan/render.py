"""The human summary of a plan, printed by `llmtune plan` and at the start of `llmtune train`."""

from __future__ import annotations

import shlex

from llmtune.plan.planner import Plan


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def summary_lines(plan: Plan, recipe) -> list[tuple[str, str]]:
    cluster = plan.cluster
    device = "cpu rehearsal (gloo)" if cluster.rehearsal else "cuda (NCCL)"
    if plan.strategy.startswith("zero") and cluster.rehearsal:
        device += ", DS_ACCELERATOR=cpu"
    rows = [
        ("strategy", plan.title),
        ("device", device),
        (
            "world size",
            f"{plan.world_size} = {cluster.num_machines} machine(s) x {cluster.processes_per_machine} process(es)",
        ),
        ("data parallel", str(plan.data_parallel_size)),
        (
            "global batch",
            f"{plan.global_batch_size} = micro {plan.micro_batch_size} x "
            f"{'micro-batches' if plan.pipeline else 'accumulation'} {plan.gradient_accumulation_steps} "
            f"x data-parallel {plan.data_parallel_size}",
        ),
        ("precision", plan.precision),
        ("method", {"lora": "LoRA", "qlora": "QLoRA (4-bit base)"}.get(recipe.adapter or "", "full fine-tune")),
        ("model", recipe.base_model),
    ]
    if plan.zero_stage:
        zero = plan.deepspeed_config["zero_optimization"]
        rows.append(("zero", f"stage {zero['stage']}, offload optimizer: "
                     f"{(zero.get('offload_optimizer') or {}).get('device', 'none')}, "
                     f"offload params: {(zero.get('offload_param') or {}).get('device', 'none')}"))  # fmt: skip
    if plan.accelerate_config and "fsdp_config" in plan.accelerate_config:
        fsdp = plan.accelerate_config["fsdp_config"]
        wrap = fsdp.get("fsdp_transformer_layer_cls_to_wrap", "the model's _no_split_modules")
        rows.append(("fsdp", f"version {fsdp['fsdp_version']}, wrap {wrap}, state dict {fsdp['fsdp_state_dict_type']}"))
    if plan.pipeline:
        pipe = plan.pipeline
        text = f"{pipe.stages} stages x {plan.data_parallel_size} replicas, schedule {pipe.schedule}, "
        text += f"{pipe.microbatches} micro-batches, bubble {pipe.bubble:.1%} = (p-1)/(m+p-1)"
        rows.append(("pipeline", text))
        for index, (layers, params) in enumerate(
            zip(pipe.layers_per_stage or [], pipe.params_per_stage or [], strict=True)
        ):
            extra = " + embeddings" if index == 0 else ""
            extra += " + norm + head" if index == len(pipe.layers_per_stage) - 1 else ""
            rows.append((f"  stage {index}", f"layers {layers[0]}..{layers[1] - 1}{extra}, {_millions(params)} params"))
    return rows


def command_lines(plan: Plan) -> list[str]:
    lines = []
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    for rank, command in enumerate(plan.commands):
        prefix = f"machine {rank}: " if len(plan.commands) > 1 else ""
        lines.append(f"{prefix}{env} {shlex.join(command)}".strip())
    return lines


def print_plan(plan: Plan, recipe, files: dict[str, str], notes: list[str], show_files: bool = True) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan")
    table.add_column()
    for key, value in summary_lines(plan, recipe):
        table.add_row(key, value)
    console.print(table)
    for note in [*plan.notes, *notes]:
        console.print(f"[yellow]note:[/] {note}")
    console.print("\n[bold]commands[/] (llmtune train runs these; on several machines, run each on its machine):")
    for line in command_lines(plan):
        console.print(f"  {line}", soft_wrap=True)
    if show_files:
        for name in ("accelerate_config.yaml", "deepspeed.json"):
            if name in files:
                console.print(f"\n[bold]{name}[/]")
                console.print(escape(files[name].rstrip()), soft_wrap=True, highlight=False)


def print_estimate(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from llmtune.plan.estimate import GB

    table = Table(title=f"{report.model}: {report.total_params / 1e9:.2f}B parameters "
                        f"({report.trainable_params / 1e6:,.1f}M trainable), {report.num_machines} x "
                        f"{report.gpus_per_machine} GPUs of {report.gpu_memory / GB:.0f} GB")  # fmt: skip
    for column in ("strategy (GB per GPU)", "params", "grads", "optim", "buffers", "activ", "other", "total", "fits",
                   "CPU/machine"):  # fmt: skip
        table.add_column(column, justify="left" if column.startswith("strategy") else "right")
    for row in report.rows:
        cells = [row.params, row.grads, row.optimizer, row.buffers, row.activations, row.overhead, row.total]
        table.add_row(row.strategy, *(f"{c / GB:.1f}" for c in cells), "yes" if report.fits(row) else "no",
                      f"{row.cpu / GB:.1f}" + (" + NVMe" if row.nvme else "") if row.cpu or row.nvme else "")  # fmt: skip
    console = Console(width=None if Console().is_terminal else 140)
    console.print(table)
    console.print("buffers: the largest layer gathered (ZeRO-3/FSDP) and DeepSpeed's fp32 gradient copy at the step")
    if report.choice is None:
        console.print(
            "[red]nothing fits[/]: use more GPUs, a smaller micro_batch_size, gradient_checkpointing, or LoRA"
        )
    else:
        console.print(f"[bold]recommended:[/] {report.choice[0].strategy} ({report.choice[1]})")
