"""The smallest cluster a recipe asks for: what `llmtune validate` plans for when no cluster flags are given.

A recipe written for another machine is checked as a recipe: it is planned for the fewest processes and machines
its own keys need (pipeline stages, an elastic rendezvous's machines, a DeepSpeed JSON's fixed train_batch_size),
on the device asked for. What only the real cluster can tell comes back as notes, not errors.
"""

from __future__ import annotations

import math
from dataclasses import replace

from llmtune.plan.cluster import Cluster
from llmtune.recipe import Recipe

CHECKED_LATER = "checked when you pass --num-processes, or at train time"


def smallest_cluster(recipe: Recipe, described: Cluster) -> tuple[Cluster, list[str]]:
    """`described` (device, launcher) resized to the recipe's smallest world, and notes on what that leaves unchecked."""
    notes: list[str] = []
    machines = 1
    if recipe.rdzv_backend == "c10d":  # an elastic rendezvous gathers machines: one machine is refused
        machines = max(2, recipe.min_machines or 2)
        notes.append(f"rdzv_backend: c10d needs {machines} or more machines; checked when you pass --num-machines "
                     "(with --main-process-ip), or at train time")  # fmt: skip
    stages = recipe.pipeline_parallel_size
    if stages > 1:
        notes.append(f"pipeline_parallel_size {stages} needs a world size divisible by {stages}; {CHECKED_LATER}")
    replicas = _deepspeed_replicas(recipe)
    if replicas > 1:
        notes.append(f"deepspeed train_batch_size fixes {replicas} data-parallel processes (micro_batch_size "
                     f"{recipe.micro_batch_size} x gradient_accumulation_steps {recipe.gradient_accumulation_steps} "
                     f"x processes); {CHECKED_LATER}")  # fmt: skip
    mesh, parallel = recipe.least_mesh_ranks, recipe.model_parallel_size
    if mesh > 1:
        notes.append(f"tensor/context parallel and dp_shard/dp_replicate sizes need {mesh} processes at least (other "
                     f"multiples of {parallel} fill the unset sizes); {CHECKED_LATER}")  # fmt: skip
    world = math.lcm(machines, stages * replicas, mesh)
    processes = f"{world} {'GPU' if described.device == 'cuda' else 'CPU'} process{'es' if world > 1 else ''}"
    notes.insert(0, f"no cluster flags: planned for the smallest world the recipe needs ({processes} on {machines} "
                    f"machine{'s' if machines > 1 else ''}); pass --num-processes (and --num-machines) to check "
                    "it fits your cluster")  # fmt: skip
    return replace(described, num_processes=world, num_machines=machines, machine_rank=0), notes


def _deepspeed_replicas(recipe: Recipe) -> int:
    """Data-parallel processes a DeepSpeed JSON's own train_batch_size implies (1 when it leaves it open)."""
    if recipe.deepspeed is None:
        return 1
    from llmtune.plan.deepspeed import load_user_config

    user, _ = load_user_config(recipe.deepspeed)
    batch = user.get("train_batch_size")
    per_replica = recipe.micro_batch_size * recipe.gradient_accumulation_steps
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0 or batch % per_replica:
        return 1  # "auto", absent, or a value no world satisfies: planning says so, naming the key
    return batch // per_replica
