"""The human summary of a plan, printed by `llmtune plan` and at the start of `llmtune train`."""

from __future__ import annotations

import shlex

from llmtune.plan.planner import Plan


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def summary_lines(plan: Plan, recipe) -> list[tuple[str, str]]:
    cluster = plan.cluster
    device = ("cpu rehearsal (gloo)" if cluster.rehearsal else "cuda (NCCL)" if cluster.backend == "nccl"
              else "cuda (gloo: ranks share GPUs, for tests)")  # fmt: skip
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
        (
            "method",
            {"lora": "LoRA", "qlora": "QLoRA (4-bit base)"}.get(recipe.adapter or "", "full fine-tune")
            + _experts_left_16_bit(recipe)
            + (" of a reward model (Bradley-Terry pairs, one score per sequence)" if recipe.reward_model else "")
            + (
                f" of a process reward model ({recipe.num_labels} labels per step)"
                if recipe.process_reward_model
                else ""
            ),
        ),
        ("model", recipe.base_model),
        *preference_lines(plan, recipe),
    ]
    if plan.kernels.get("summary"):
        rows.append(("kernels", plan.kernels["summary"]))
    if plan.kernels.get("batches"):
        rows.append(("batches", plan.kernels["batches"]["summary"]))
    if plan.kernels.get("loader"):
        from llmtune.recipe.kernels import Kernels

        rows.append(("data loading", Kernels(plan.cluster.device, loader=plan.kernels["loader"]).loading_line()))
    if plan.zero_stage:
        zero = plan.deepspeed_config["zero_optimization"]
        rows.append(("zero", f"stage {zero['stage']}, offload optimizer: "
                     f"{(zero.get('offload_optimizer') or {}).get('device', 'none')}, "
                     f"offload params: {(zero.get('offload_param') or {}).get('device', 'none')}"))  # fmt: skip
    if plan.accelerate_config and "fsdp_config" in plan.accelerate_config:
        fsdp = plan.accelerate_config["fsdp_config"]
        policy = fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
        wrap = (f"every module of {fsdp.get('fsdp_min_num_params', 100_000_000):,}+ parameters (size-based)"
                if policy == "SIZE_BASED_WRAP" else "nothing (NO_WRAP)" if policy == "NO_WRAP"
                else fsdp.get("fsdp_transformer_layer_cls_to_wrap", "the model's _no_split_modules"))  # fmt: skip
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


def preference_lines(plan: Plan, recipe) -> list[tuple[str, str]]:
    """A preference recipe's batches and its reference model under the plan's strategy; none without `rl:`."""
    from llmtune.plan.memory import preference
    from llmtune.plan.memory.fit import row_for_plan

    if not preference.method(recipe):
        return []
    precision = preference.precision_name(plan.precision, plan.precision in ("bf16", "fp16"))
    where = preference.describe(recipe, row_for_plan(plan), plan.data_parallel_size,
                                plan.cluster.processes_per_machine, precision)  # fmt: skip
    lines = [("online RL" if recipe.rl in preference.ONLINE else "preference", preference.batch_note(recipe)),
             ("reference model", where)]  # fmt: skip
    if recipe.rl in preference.ONLINE:
        lines += [("generation", line) for line in plan.kernels.get("generation") or []]
    return lines


def command_lines(plan: Plan) -> list[str]:
    lines = []
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    hosts = plan.cluster.hosts
    for rank, command in enumerate(plan.commands):
        where = f" ({hosts[rank]})" if rank < len(hosts) else ""
        prefix = f"machine {rank}{where}: " if len(plan.commands) > 1 else ""
        if not command:
            lines.append(f"{prefix}started by machine 0's DeepSpeed launcher over ssh (pdsh)")
            continue
        lines.append(f"{prefix}{env} {shlex.join(command)}".strip())
    return lines


def _etcd_endpoint(plan: Plan) -> str | None:
    """The etcd server of an etcd rendezvous, as the commands name it."""
    for command in plan.commands:
        if "--rdzv_endpoint" in command and "etcd-v2" in command:
            return command[command.index("--rdzv_endpoint") + 1]
    return None


def _ranks(plan: Plan, machine: int) -> str:
    per = plan.cluster.processes_per_machine
    if plan.rdzv_backend in ("c10d", "etcd"):
        return f"{per} rank(s), numbered at the rendezvous"
    first = machine * per
    return f"rank {first}" if per == 1 else f"ranks {first}..{first + per - 1}"


def where_lines(plan: Plan, recipe_path: str) -> list[str]:
    """For a job on several machines: what to type on which machine under each launcher, and which ranks run there."""
    cluster = plan.cluster
    machines = cluster.num_machines
    if machines < 2:
        return []
    recipe = shlex.quote(recipe_path)
    device = " --device cpu" if cluster.rehearsal else ""
    address = f"{cluster.main_process_ip}:{cluster.main_process_port}"
    hosts = cluster.hosts or tuple([cluster.main_process_ip] + [f"machine-{i}" for i in range(1, machines)])
    hostfile = cluster.hostfile or "HOSTFILE"
    size = f"--num-machines {machines} --num-processes {plan.world_size}"
    elastic = plan.rdzv_backend in ("c10d", "etcd")
    at = _etcd_endpoint(plan) or address
    lines = [f"accelerate (torchrun underneath; rendezvous {plan.rdzv_backend} at {at}):"]
    for m in range(machines):
        lines.append(f"  on {hosts[m]}: llmtune train {recipe}{device} {size} --machine-rank {m} "
                     f"--main-process-ip {cluster.main_process_ip} --main-process-port {cluster.main_process_port}"
                     f"  -> {'torchrun' if plan.min_machines or _etcd_endpoint(plan) else 'accelerate launch'} -> "
                     f"{_ranks(plan, m)}")  # fmt: skip
    if elastic:
        lines.append(f"deepspeed: not with rdzv_backend: {plan.rdzv_backend} (DeepSpeed's launcher has no elastic "
                     "rendezvous)")  # fmt: skip
    else:
        lines.append(
            f"deepspeed over ssh (hostfile {hostfile}, `host slots={cluster.processes_per_machine}` per line):"
        )
        lines.append(f"  on {hosts[0]} only: llmtune train {recipe}{device} --launcher deepspeed --hostfile {hostfile}")
        for m in range(machines):
            lines.append(
                f"    pdsh -> {hosts[m]}: python -m deepspeed.launcher.launch --node_rank={m} -> {_ranks(plan, m)}"
            )
        lines.append("deepspeed without ssh (each machine starts its own):")
        for m in range(machines):
            lines.append(f"  on {hosts[m]}: llmtune train {recipe}{device} --launcher deepspeed --hostfile {hostfile} "
                         f"--no-ssh --machine-rank {m} -> {_ranks(plan, m)}")  # fmt: skip
    lines.append("slurm (from a login node):")
    lines.append(f"  llmtune slurm {recipe}{device} --nodes {machines} --gpus-per-node {cluster.processes_per_machine}"
                 " --submit  -> sbatch -> srun: one llmtune launcher per node, machine rank = SLURM_NODEID")  # fmt: skip
    return lines


def print_plan(plan: Plan, recipe, files: dict[str, str], notes: list[str], show_files: bool = True,
               recipe_path: str = "RECIPE") -> None:  # fmt: skip
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
        console.print(f"[yellow]note:[/] {escape(note)}")  # a note may hold [brackets]: llmtune[kernels]
    console.print("\n[bold]commands[/] (llmtune train runs these; on several machines, run each on its machine):")
    for line in command_lines(plan):
        console.print(f"  {escape(line)}", soft_wrap=True, highlight=False)
    where = where_lines(plan, recipe_path)
    if where:
        console.print("\n[bold]what runs where[/], under each launcher:")
        for line in where:
            console.print(f"  {escape(line)}", soft_wrap=True, highlight=False)
    if show_files:
        shown = (
            ("deepspeed.json", "hostfile")
            if plan.cluster.launcher == "deepspeed"
            else ("accelerate_config.yaml", "deepspeed.json")
        )
        for name in shown:
            if name in files:
                console.print(f"\n[bold]{name}[/]")
                console.print(escape(files[name].rstrip()), soft_wrap=True, highlight=False)


def _experts_left_16_bit(recipe) -> str:
    """A k-bit base of a mixture of experts: the share bitsandbytes leaves in 16 bits (the fused expert tensors)."""
    if not (recipe.load_in_4bit or recipe.load_in_8bit):
        return ""
    from llmtune.plan.memory.facts import read_model_facts

    facts = read_model_facts(recipe.base_model_config or recipe.base_model)
    if facts is None or not facts.routed_expert_params():
        return ""
    share = facts.routed_expert_params() / facts.total_params()
    return (
        f"; its fused expert weights, {share:.0%} of the model, stay 16-bit: bitsandbytes quantizes linear "
        "layers only (the estimate counts them so)"
    )
