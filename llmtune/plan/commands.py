"""The command each machine runs and its environment: accelerate launch, the deepspeed launcher, torchrun's elastic
rendezvous (c10d, etcd), and the sizes an elastic world resolves to."""

from __future__ import annotations

import os
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.cluster import Cluster
from llmtune.recipe import Recipe


def elastic_sizes(plan: dict, world: int) -> dict:
    """The plan's sizes for a world the elastic rendezvous formed (fewer machines: more accumulation)."""
    if world == plan["world_size"]:
        return {}
    per_machine = plan["world_size"] // plan["cluster"]["num_machines"]
    least = plan.get("min_machines")
    if not least or world % per_machine or not least * per_machine <= world <= plan["world_size"]:
        raise UserError(f"the launcher started {world} process(es) but the plan has world size {plan['world_size']}")
    return {"world_size": world, "data_parallel_size": world,
            "gradient_accumulation_steps": plan["global_batch_size"] // (plan["micro_batch_size"] * world)}  # fmt: skip


def _environment(cluster: Cluster, strategy: str, precision: str) -> dict[str, str]:
    # the plan's precision: transformers reads an inherited ACCELERATE_MIXED_PRECISION where bf16/fp16 are off (a
    # one-process run trained in bf16 under a plan saying fp32)
    env = {"TOKENIZERS_PARALLELISM": "false", "ACCELERATE_MIXED_PRECISION": precision}
    if cluster.num_processes > 1 or strategy != "single":  # torchrun's own prefix, [default0]:, names no rank
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
    if cluster.rehearsal:
        cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // cluster.processes_per_machine))
        # OpenMP's threads sleep between parallel regions instead of spinning: processes sharing the machine's cores
        # took 5x the CPU time with libgomp's default spinning (benchmarks/rehearsal_threads.py)
        if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):  # unless the user tuned it
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["CUDA_VISIBLE_DEVICES"] = ""
        if strategy.startswith("zero"):
            env["DS_ACCELERATOR"] = "cpu"
    return env


def _command(strategy: str, config_dir: str, machine_rank: int, recipe: Recipe, cluster: Cluster) -> list[str]:
    plan_file = str(Path(config_dir) / "plan.json")
    restarts = ["--max_restarts", str(recipe.max_restarts)] if recipe.max_restarts else []
    if cluster.launcher == "deepspeed":
        return _deepspeed_command(plan_file, config_dir, machine_rank, cluster)
    if strategy == "single":
        if restarts:  # torchrun's elastic agent does the restarting, even for one process
            return ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *restarts,
                    "-m", "llmtune.train", plan_file]  # fmt: skip
        return ["python", "-m", "llmtune.train", plan_file]
    if recipe.rdzv_backend == "etcd" or (
        recipe.rdzv_backend == "c10d" and recipe.min_machines and recipe.min_machines < cluster.num_machines
    ):
        return _torchrun_elastic_command(plan_file, config_dir, machine_rank, recipe, cluster)
    rendezvous = ["--rdzv_conf", f"timeout={recipe.rdzv_timeout}"] if cluster.num_machines > 1 else []
    if recipe.rdzv_backend == "c10d":
        # join_timeout: how long a round waits for every machine (also a restarted one to come back);
        # last_call: once enough have joined, how long late ones may still make this round
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_conf", _c10d_conf(recipe, machine_rank)]
    # every rank's output also goes to <config_dir>/logs/.../attempt_N/<local rank>/, lines prefixed [rankR]:
    logs = ["--tee", "3", "--log_dir", str(Path(config_dir) / "logs")]
    return [
        "accelerate", "launch", "--config_file", str(Path(config_dir) / "accelerate_config.yaml"),
        "--machine_rank", str(machine_rank), *restarts, *rendezvous, *logs, "-m", "llmtune.train", plan_file,
    ]  # fmt: skip


def _deepspeed_command(plan_file: str, config_dir: str, machine_rank: int, cluster: Cluster) -> list[str]:
    """DeepSpeed's launcher. Over ssh only machine 0 runs it (it starts the others with pdsh); with --no-ssh every
    machine runs it with its own --node_rank. Without a hostfile, llmtune writes one for this machine."""
    if cluster.ssh and machine_rank > 0:
        return []  # started by machine 0 over ssh
    hostfile = cluster.hostfile or str(Path(config_dir) / "hostfile")
    command = ["deepspeed", "--hostfile", hostfile, "--master_addr", cluster.main_process_ip,
               "--master_port", str(cluster.main_process_port)]  # fmt: skip
    if not cluster.ssh:
        command += ["--no_ssh", "--node_rank", str(machine_rank)]
    else:  # llmtune checks every host itself first and names the one that fails (DeepSpeed checks the first only,
        command += ["--no_ssh_check"]  # and even for a hostfile of one machine, which needs no ssh)
    return [*command, "--no_local_rank", "--module", "llmtune.train", plan_file]


ELASTIC = ("c10d", "etcd")  # torchrun's elastic rendezvous backends


def etcd_job_id(recipe: Recipe) -> str:
    """The rendezvous id every machine of this job derives alike (from the output folder it names); the launcher
    appends the launch's generation (llmtune/launch/etcd.py)."""
    import hashlib

    return "llmtune-" + hashlib.sha1(recipe.output_dir.encode()).hexdigest()[:12]


def _c10d_conf(recipe: Recipe, machine_rank: int) -> str:
    # join_timeout: how long a round waits for machines (also a restarted one to come back); last_call: once enough
    # have joined, how long late ones may still make this round. Machine 0 (whose address is the endpoint) hosts
    # the rendezvous store: said outright, because torch's guess compares host names, which fails on a secondary
    # interface.
    # read_timeout bounds reaching the store too (torch's default, 60 s, would outlast a short rdzv_timeout)
    return (f"join_timeout={recipe.rdzv_timeout},last_call_timeout=2,close_timeout=10,"
            f"read_timeout={recipe.rdzv_timeout},is_host={int(machine_rank == 0)}")  # fmt: skip


def _torchrun_elastic_command(plan_file: str, config_dir: str, machine_rank: int, recipe: Recipe,
                              cluster: Cluster) -> list[str]:  # fmt: skip
    """torchrun itself, for a world that may shrink or grow: accelerate launch fixes --nnodes to one number. With
    etcd the rendezvous lives in the etcd server; its run id gets the launch's generation at launch (an etcd
    rendezvous, once closed by a finished or failed job, takes no one again)."""
    least = recipe.min_machines or cluster.num_machines
    if recipe.rdzv_backend == "etcd":
        conf = (f"join_timeout={recipe.rdzv_timeout},last_call_timeout=2,close_timeout=10,"
                f"read_timeout={recipe.rdzv_timeout}")  # fmt: skip
        rendezvous = ["--rdzv_backend", "etcd-v2", "--rdzv_endpoint", recipe.rdzv_endpoint,
                      "--rdzv_id", etcd_job_id(recipe), "--rdzv_conf", conf]  # fmt: skip
    else:
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{cluster.main_process_ip}:{cluster.main_process_port}",
                      "--rdzv_conf", _c10d_conf(recipe, machine_rank)]  # fmt: skip
    return [
        "python", "-m", "torch.distributed.run", "--nnodes", f"{least}:{cluster.num_machines}",
        "--nproc_per_node", str(cluster.processes_per_machine), *rendezvous, "--max_restarts", str(recipe.max_restarts),
        "--tee", "3", "--log_dir", str(Path(config_dir) / "logs"), "-m", "llmtune.train", plan_file,
    ]  # fmt: skip
