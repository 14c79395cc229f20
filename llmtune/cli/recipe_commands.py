"""Commands of the recipe and plan rooms: validate, plan, estimate, config.

None of them starts a process or imports torch: they read a recipe (or ask for one) and show what it means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtune.cli.options import (
    Device,
    Hostfile,
    Launcher,
    MachineRank,
    MainIp,
    MainPort,
    NoSsh,
    NumMachines,
    NumProcesses,
    RecipeArg,
    Rehearse,
    cluster_flags_given,
    cluster_from_flags,
)
from llmtune.errors import UserError


def validate(
    recipe: RecipeArg,
    num_processes: NumProcesses = None,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainIp = None,
    main_process_port: MainPort = None,
    device: Device = None,
    rehearse: Rehearse = False,
    launcher: Launcher = "accelerate",
    hostfile: Hostfile = None,
    no_ssh: NoSsh = False,
    upgrade: Annotated[
        bool,
        typer.Option(
            "--upgrade",
            help="Write <recipe>.upgraded.yaml beside it in today's vocabulary (each changed "
            "line commented), then check that one.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="With --upgrade: overwrite an existing .upgraded.yaml.")
    ] = False,
) -> None:
    """Check a recipe (keys, values, local files); with cluster flags, also that it plans for that cluster."""
    from llmtune.plan import make_plan
    from llmtune.plan.smallest_cluster import smallest_cluster
    from llmtune.recipe import load_recipe

    if force and not upgrade:
        raise UserError("--force goes with --upgrade (it overwrites an existing .upgraded.yaml)")
    if upgrade:
        from llmtune.recipe.upgrade import upgrade_recipe

        done = upgrade_recipe(recipe, force)
        for line in done.changes:
            typer.echo(f"upgraded {line}")
        if done.written is None:
            typer.echo(f"{recipe}: already in today's vocabulary; nothing written")
        else:
            typer.echo(f"wrote {done.written} ({len(done.changes)} changes; {recipe} is unchanged)")
            recipe = done.written
    loaded = load_recipe(recipe)
    if cluster_flags_given(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, hostfile):
        cluster = cluster_from_flags(num_processes, num_machines, machine_rank, main_process_ip, main_process_port,
                                     device, rehearse, launcher, hostfile, no_ssh)  # fmt: skip
        cluster_notes = []
    else:  # a recipe for another machine: checked as a recipe, on GPUs unless told otherwise (described, not probed)
        described = cluster_from_flags(1, 1, 0, None, None, device or (None if rehearse else "cuda"), rehearse,
                                       launcher, None, no_ssh)  # fmt: skip
        cluster, cluster_notes = smallest_cluster(loaded.recipe, described)
    plan = make_plan(loaded.recipe, cluster)
    from llmtune.launch.preflight import check_deepspeed_schema, check_local_splits

    check_deepspeed_schema(loaded.recipe, plan)
    check_local_splits(loaded.recipe)
    for note in [*loaded.notes, *cluster_notes]:
        typer.echo(f"note: {note}")
    typer.echo(f"{recipe}: valid ({plan.title}, world size {plan.world_size}, global batch {plan.global_batch_size})")


def plan(
    recipe: RecipeArg,
    num_processes: NumProcesses = None,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainIp = None,
    main_process_port: MainPort = None,
    device: Device = None,
    rehearse: Rehearse = False,
    launcher: Launcher = "accelerate",
    hostfile: Hostfile = None,
    no_ssh: NoSsh = False,
    write: Annotated[
        Optional[Path],
        typer.Option("--write", help="Also write accelerate_config.yaml, deepspeed.json and plan.json here."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    rdzv_endpoint: Annotated[
        Optional[str], typer.Option("--rdzv-endpoint", help="host:port of the etcd server (rdzv_backend: etcd).")
    ] = None,
) -> None:
    """Show what a run would do: strategy, sizes, generated configs, the command for each machine."""
    import json

    from llmtune.plan import make_plan
    from llmtune.plan.files import plan_files, write_plan_files
    from llmtune.plan.render import print_plan
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    if rdzv_endpoint:
        if loaded.recipe.rdzv_backend != "etcd":
            raise UserError("--rdzv-endpoint is the etcd server of rdzv_backend: etcd", "set rdzv_backend: etcd")
        loaded.recipe = loaded.recipe.model_copy(update={"rdzv_endpoint": rdzv_endpoint})
    cluster = cluster_from_flags(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device,
                                 rehearse, launcher, hostfile, no_ssh)  # fmt: skip
    if not cluster_flags_given(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, hostfile):
        cluster = _at_least_the_recipes_world(loaded, cluster)
    the_plan = make_plan(loaded.recipe, cluster, config_dir=str(write) if write else None, resume=True)
    files = plan_files(the_plan, loaded.recipe.model_dump(mode="json"), str(recipe), loaded.notes)
    if json_output:
        typer.echo(json.dumps(the_plan.to_dict(), indent=2))
    else:
        print_plan(the_plan, loaded.recipe, files, loaded.notes, recipe_path=str(recipe))
    if write:
        for path in write_plan_files(write, files):
            typer.echo(f"wrote {path}")
        if cluster.rehearsal and device is None and not rehearse:  # chosen because this machine has no GPU
            typer.echo("note: these files are the CPU rehearsal's (no GPU here: gloo, fp32); for the GPU machines' "
                       "files add --device cuda", err=True)  # fmt: skip


def estimate(
    recipe: RecipeArg,
    gpus_per_machine: Annotated[int, typer.Option("--gpus-per-machine", min=1)] = 1,
    num_machines: NumMachines = 1,
    gpu_memory: Annotated[str, typer.Option("--gpu-memory", help="Memory of one GPU, e.g. 80GB.")] = "80GB",
    cpu_memory: Annotated[
        Optional[str], typer.Option("--cpu-memory", help="CPU memory of one machine, for offload (e.g. 512GB).")
    ] = None,
    interconnect: Annotated[
        str, typer.Option("--interconnect", help="Between machines: fast (InfiniBand/NVLink) or slow (Ethernet).")
    ] = "fast",
    json_output: Annotated[bool, typer.Option("--json", help="Print the estimates as JSON.")] = False,
) -> None:
    """Per-GPU memory under each strategy (ZeRO-paper accounting), what fits, and the recommended strategy."""
    from llmtune.plan.memory.fit import estimate_recipe
    from llmtune.plan.memory.table import parse_size_option, print_estimate
    from llmtune.recipe import load_recipe

    if interconnect not in ("fast", "slow"):
        raise UserError(f"--interconnect {interconnect!r} is not fast or slow")
    if num_machines < 1:
        raise UserError(f"--num-machines {num_machines} is not a machine count", "give 1 or more")
    from llmtune.recipe.axolotl_keys import MEMORY_REASONS

    found = load_recipe(recipe)
    loaded = found.recipe
    report = estimate_recipe(
        loaded, gpus_per_machine, num_machines, parse_size_option("--gpu-memory", gpu_memory),
        parse_size_option("--cpu-memory", cpu_memory) if cpu_memory else None, interconnect,
    )  # fmt: skip
    # Axolotl's keys llmtune accepts without doing what they do to GPU memory: said with the figures they change
    memory_notes = [note for note in found.notes if any(reason in note for reason in MEMORY_REASONS)]
    if loaded.adapter and loaded.lora_rank_pattern:
        memory_notes.append(f"lora_rank_pattern: the adapter is counted at lora_r {loaded.lora_r} in every adapted "
                            "layer; layers the pattern gives another rank hold more or less")  # fmt: skip
    if json_output:
        import json

        typer.echo(json.dumps({**report.to_dict(), "notes": memory_notes}, indent=2))
    else:
        print_estimate(report)
        for note in memory_notes:
            typer.echo(f"note: {note}")


def _at_least_the_recipes_world(loaded, cluster):
    """With no cluster flags, this machine's default world; where that can't hold the recipe's own sizes
    (dp_shard_size 2 on a machine that starts 1 process), the smallest world that can, as `validate` plans, said in
    a note (`train` then needs --num-processes)."""
    from dataclasses import replace

    from llmtune.plan.smallest_cluster import smallest_cluster

    smallest, _ = smallest_cluster(loaded.recipe, replace(cluster, num_processes=1, num_machines=1, machine_rank=0))
    if smallest.num_machines > 1 or cluster.num_machines > 1 or cluster.num_processes % smallest.num_processes == 0:
        return cluster
    loaded.notes.append(f"no cluster flags: this machine starts {cluster.num_processes} process"
                        f"{'es' if cluster.num_processes > 1 else ''}, fewer than the recipe's sizes need; planned for "
                        f"{smallest.num_processes} (`llmtune train` needs --num-processes {smallest.num_processes})")  # fmt: skip
    return smallest


def _ask_option(flag: str, help_text: str, kind=str):
    return Annotated[Optional[kind], typer.Option(flag, help=help_text, show_default=False)]


def config_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="The recipe to write.")] = Path("recipe.yaml"),
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Take the default for every question not given as a flag.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
    base_model: _ask_option("--base-model", "Hub id or local folder.") = None,
    method: _ask_option("--method", "full, lora or qlora.") = None,
    dataset: _ask_option("--dataset", "Local file or hub dataset id.") = None,
    dataset_type: _ask_option("--dataset-type", "alpaca, chat_template, completion, input_output.") = None,
    num_machines: _ask_option("--num-machines", "Machines in the job.", int) = None,
    main_process_ip: _ask_option("--main-process-ip", "Address of machine rank 0.") = None,
    main_process_port: _ask_option("--main-process-port", "Rendezvous port on machine rank 0.", int) = None,
    interconnect: _ask_option("--interconnect", "Between machines: fast or slow.") = None,
    same_network: Annotated[
        Optional[bool],
        typer.Option(
            "--same-network/--no-same-network",
            show_default=False,
            help="All machines on one local network (no: asks the rendezvous backend).",
        ),
    ] = None,  # fmt: skip
    rdzv_backend: _ask_option("--rdzv-backend", "How the machines meet: static, c10d (elastic) or etcd.") = None,
    rdzv_endpoint: _ask_option("--rdzv-endpoint", "etcd: host:port of the etcd server.") = None,
    min_machines: _ask_option("--min-machines", "c10d: start once this many machines have joined.", int) = None,
    torch_compile: Annotated[
        Optional[bool],
        typer.Option(
            "--torch-compile/--no-torch-compile", show_default=False, help="Compile the model with torch.compile."
        ),
    ] = None,  # fmt: skip
    gpus_per_machine: _ask_option("--gpus-per-machine", "GPUs on each machine.", int) = None,
    gpu_ids: _ask_option("--gpu-ids", "GPU ids to use on each machine, comma separated, or all.") = None,
    gpu_memory: _ask_option("--gpu-memory", "Memory of one GPU, e.g. 80GB.") = None,
    cpu_memory: _ask_option("--cpu-memory", "CPU memory of one machine, for offload, e.g. 512GB.") = None,
    mixed_precision: _ask_option("--mixed-precision", "bf16, fp16 or no.") = None,
    sequence_len: _ask_option("--sequence-len", "Tokens per row.", int) = None,
    micro_batch_size: _ask_option("--micro-batch-size", "Rows per GPU per step.", int) = None,
    strategy: _ask_option(
        "--strategy",
        "ddp, zero1, zero2, zero3, zero2_offload, zero3_offload, zero3_nvme, fsdp, "
        "fsdp_hybrid, pipeline, context_parallel, tensor_parallel (default: the recommended one).",
    ) = None,
    nvme_path: _ask_option("--nvme-path", "NVMe folder for zero3_nvme.") = None,
    fsdp_version: _ask_option("--fsdp-version", "1 or 2.", int) = None,
    fsdp_auto_wrap_policy: _ask_option(
        "--fsdp-auto-wrap-policy", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP."
    ) = None,
    fsdp_state_dict_type: _ask_option("--fsdp-state-dict-type", "FULL_STATE_DICT or SHARDED_STATE_DICT.") = None,
    fsdp_offload_params: _ask_option("--fsdp-offload-params", "Offload FSDP parameters to CPU.", bool) = None,
    async_checkpoint: Annotated[
        Optional[bool],
        typer.Option(
            "--async-checkpoint/--no-async-checkpoint",
            show_default=False,
            help="Write checkpoints in the background (offered for large full fine-tunes; not DeepSpeed, FSDP1 or "
            "pipelines).",
        ),
    ] = None,  # fmt: skip
    pipeline_stages: _ask_option("--pipeline-stages", "Pipeline stages.", int) = None,
    pipeline_schedule: _ask_option("--pipeline-schedule", "gpipe, 1f1b or interleaved_1f1b.") = None,
    context_parallel_size: _ask_option("--context-parallel-size", "Ranks that split each row.", int) = None,
    tensor_parallel_size: _ask_option("--tensor-parallel-size", "Ranks that split each layer.", int) = None,
    output_dir: _ask_option("--output-dir", "Where the run writes its model and checkpoints.") = None,
    rl: _ask_option("--rl", "Preference training: dpo, ipo, orpo, kto or simpo (offered after SFT).") = None,
    preference_data: _ask_option("--preference-data", "Preference pairs (or KTO rows): local file or hub id.") = None,
    preference_type: _ask_option(
        "--preference-type",
        "Its format, e.g. chatml.intel (pairs), chatml.ultra (kto); default: read from a local file's first row.",
    ) = None,
    rl_beta: _ask_option("--rl-beta", "How far the policy may move from the reference (TRL's beta).", float) = None,
    orpo_alpha: _ask_option("--orpo-alpha", "ORPO: weight of the odds-ratio term.", float) = None,
    simpo_gamma: _ask_option("--simpo-gamma", "SimPO: target reward margin.", float) = None,
    cpo_alpha: _ask_option("--cpo-alpha", "SimPO: weight of the chosen reply's NLL.", float) = None,
) -> None:
    """Answer a few questions (those `accelerate config` asks, plus model and data) and get a recipe; given an SFT
    run's output folder, preference training (DPO, IPO, ORPO, KTO, SimPO) on it."""
    from llmtune.wizard import run_config

    given = {k: v for k, v in locals().items() if k not in ("output", "yes", "force")}
    written, commands = run_config(given, output, yes, force)
    typer.echo(f"wrote {written}")
    typer.echo("run it:" if len(commands) == 1 else "run on each machine:")
    for line in commands:
        typer.echo(f"  {line}")
