"""The device mesh of a plan: tensor-parallel, context-parallel and HSDP sizes, checked against the cluster and
the model, with the data-parallel degree the batch arithmetic follows (plan.mesh; the workers build it)."""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.plan.cluster import Cluster
from llmtune.plan.memory.facts import NOT_ATTENTION_ONLY, ModelFacts
from llmtune.recipe import Recipe
from llmtune.recipe.kernels import CCE_PLUGIN, liger_requested


def _check_divides(world: int, inner: int, key: str) -> None:
    if world % inner:
        raise UserError(f"world size {world} is not divisible by {key} {inner}",
                        f"use --num-processes {inner * max(1, world // inner)}, or a {key} that divides {world}")  # fmt: skip


def _data_parallel_sizes(recipe: Recipe, world: int, inner: int, key: str, shard_the_rest: bool) -> tuple[int, int]:
    """(dp_shard, dp_replicate) with world = dp_replicate x dp_shard x inner (the ranks `key` groups together):
    the recipe's own sizes, the unset one filling the rest (shards when `shard_the_rest`, else replicas)."""
    _check_divides(world, inner, key)
    rest = world // inner
    for name, size in (("dp_shard_size", recipe.dp_shard_size), ("dp_replicate_size", recipe.dp_replicate_size)):
        if size and rest % size:
            by = f" x {key} {inner}" if inner > 1 else ""
            raise UserError(f"world size {world} is not divisible by {name} {size}{by}",
                            f"use --num-processes {size * inner * max(1, rest // size)}, or a {name} that divides "
                            f"{rest}")  # fmt: skip
    shard = recipe.dp_shard_size or (rest // (recipe.dp_replicate_size or 1) if shard_the_rest else 1)
    replicate = recipe.dp_replicate_size or max(1, rest // shard)
    if replicate * shard * inner != world:
        raise UserError(f"world size {world} != dp_replicate_size {replicate} x dp_shard_size {shard}"
                        + (f" x {key} {inner}" if inner > 1 else "") + f" = {replicate * shard * inner}",
                        "set the sizes so their product is --num-processes (or leave dp_* out to fill the rest)")  # fmt: skip
    return shard, replicate


def hybrid_mesh(recipe: Recipe, world: int, version: int, notes: list[str],
                 facts: ModelFacts | None = None) -> dict[str, int] | None:  # fmt: skip
    """FSDP with dp_shard_size / dp_replicate_size (HSDP: shard within groups, replicate across) and/or
    context_parallel_size (each sequence split across that many ranks); None for plain FSDP over every rank."""
    cp = recipe.context_parallel_size
    if not (recipe.dp_shard_size or recipe.dp_replicate_size or cp > 1):
        return None
    shard, replicate = _data_parallel_sizes(recipe, world, cp, "context_parallel_size", shard_the_rest=True)
    if replicate == 1 and cp == 1:
        return None  # plain FSDP across every rank
    if version != 2:
        raise UserError("dp_replicate_size > 1 (HSDP) runs on FSDP2 here", "set fsdp_version: 2 (FSDP1: "
                        "sharding_strategy: HYBRID_SHARD)")  # fmt: skip
    if cp > 1:
        _check_attention_only(facts, "ring attention", "use tensor_parallel_size or FSDP2 alone")
        if recipe.sequence_len < 2 * cp:
            raise UserError(f"sequence_len {recipe.sequence_len} is too short to split into 2 x "
                            f"context_parallel_size = {2 * cp} chunks")  # fmt: skip
        notes.append(f"context parallel: each row split into {2 * cp} chunks over {cp} ranks (load-balanced ring "
                     f"attention; rows padded to a multiple of {2 * cp}); the data-parallel degree is "
                     f"{replicate * shard}, which sets the global batch")  # fmt: skip
    if replicate > 1:
        notes.append(f"HSDP: weights sharded across {shard * cp} ranks, {replicate} replicas (accelerate's "
                     "ParallelismConfig)")  # fmt: skip
    return {"tensor_parallel": 1, "context_parallel": cp, "dp_shard": shard, "dp_replicate": replicate}


def plan_mesh(recipe: Recipe, strategy: str, world: int, cluster: Cluster, facts: ModelFacts | None,
              notes: list[str]) -> tuple[dict | None, str | None]:  # fmt: skip
    """The plan's device mesh (None: every rank is a data-parallel rank) and, for tensor parallelism, why the machines
    must share output_dir."""
    if strategy == "tp":
        check_tensor_parallel_loss(recipe)
        return tensor_parallel_mesh(recipe, world, facts, notes), tensor_parallel_shared_output(recipe, cluster, notes)
    if strategy.startswith("fsdp"):
        return hybrid_mesh(recipe, world, recipe.resolved_fsdp()[0], notes, facts), None
    if strategy == "zero" and recipe.context_parallel_size > 1:
        if cluster.backend == "gloo":
            notes.append(f"gloo: DeepSpeed's Ulysses gathers a group's batches before splitting them, which gloo does "
                         f"for equal shapes only, so every batch is padded to sequence_len ({recipe.sequence_len}) "
                         "here; over NCCL each batch is padded to its longest row")  # fmt: skip
        return ulysses_mesh(recipe, world, facts, notes), None
    return None, None


def ulysses_mesh(recipe: Recipe, world: int, facts: ModelFacts | None, notes: list[str]) -> dict:
    """context_parallel_size under DeepSpeed: DeepSpeed's Ulysses sequence parallelism (ALST) through accelerate's
    ParallelismConfig(sp_backend="deepspeed"). Each rank holds 1/C of every row's tokens; around attention an
    all-to-all trades that for whole rows over 1/C of the heads, so the heads must split C ways. ZeRO still shards
    the states over every rank; the C ranks of a group train on the same rows, so the data-parallel degree (and the
    global batch) is world / C."""
    cp = recipe.context_parallel_size
    _check_attention_only(facts, "Ulysses", "remove context_parallel_size")
    if facts:  # the model first, then the world size (whose hint would name a size the model can't take)
        if facts.num_heads % cp:
            raise UserError(f"context_parallel_size {cp} does not divide the model's {facts.num_heads} attention heads "
                            "(DeepSpeed's Ulysses gives each rank whole heads)",
                            "choose a context_parallel_size that divides the head count")  # fmt: skip
        if facts.num_kv_heads % cp and cp % facts.num_kv_heads:
            raise UserError(f"context_parallel_size {cp} and the model's {facts.num_kv_heads} KV heads don't divide "
                            "one another (Ulysses splits the KV heads, or repeats them when there are fewer)",
                            "choose a context_parallel_size that divides the KV heads or is a multiple of them")  # fmt: skip
    _check_divides(world, cp, "context_parallel_size")
    if recipe.sequence_len < cp:
        raise UserError(f"sequence_len {recipe.sequence_len} is too short to split across context_parallel_size {cp}")
    notes.append(f"context parallel (DeepSpeed Ulysses, through accelerate): each row split into {cp} chunks; an "
                 f"all-to-all around attention gives each rank whole rows over 1/{cp} of the heads; rows padded to a "
                 f"multiple of {cp}; the data-parallel degree is {world // cp}, which sets the global batch; ZeRO "
                 f"shards the states over all {world} ranks")  # fmt: skip
    return {"tensor_parallel": 1, "context_parallel": cp, "dp_shard": world // cp, "dp_replicate": 1,
            "sequence_parallel": "ulysses"}  # fmt: skip


def _check_attention_only(facts: ModelFacts | None, splitter: str, hint: str) -> None:
    """Context parallelism splits attention only: state-space and linear-attention layers would take each rank's
    chunk as a whole sequence."""
    if facts and facts.model_type in NOT_ATTENTION_ONLY:
        raise UserError(f"context parallelism for {facts.model_type} models is not supported: their state-space / "
                        f"linear-attention layers would see each rank's chunk as a whole sequence ({splitter} splits "
                        "only attention)", hint)  # fmt: skip


def ranks_per_batch(mesh: dict | None) -> int:
    """The consecutive ranks that split one batch: a tensor- or context-parallel group (1 without a mesh)."""
    mesh = mesh or {}
    return mesh.get("tensor_parallel", 1) * mesh.get("context_parallel", 1)


def tensor_parallel_mesh(recipe: Recipe, world: int, facts: ModelFacts | None, notes: list[str]) -> dict[str, int]:
    """world = dp_replicate x dp_shard x tensor_parallel, each checked against the model and the cluster."""
    tp = recipe.tensor_parallel_size
    fsdp = recipe.resolved_fsdp()
    if facts:  # the model first: a world size fixed to a size the model can't take would only move the refusal
        for what, count in (("attention heads", facts.num_heads), ("KV heads", facts.num_kv_heads)):
            if count % tp:
                raise UserError(f"tensor_parallel_size {tp} does not divide the model's {count} {what} (each rank "
                                f"keeps whole heads)", "choose a tensor_parallel_size that divides both head counts")  # fmt: skip
    shard, replicate = _data_parallel_sizes(recipe, world, tp, "tensor_parallel_size", shard_the_rest=fsdp is not None)
    if recipe.save_strategy != "no":
        notes.append("tensor parallel: checkpoints hold the whole weights, and the optimizer state as torch's "
                     "distributed checkpoint (each rank its shards); a stopped run resumes on the same mesh"
                     if not recipe.save_only_model else "tensor parallel: weight snapshots only (save_only_model)")  # fmt: skip
    if shard > 1 and fsdp is None:
        notes.append(f"dp_shard_size {shard}: FSDP2 shards the weights across {shard} ranks (no fsdp keys needed)")
    notes.append(f"tensor parallel: each layer split across {tp} ranks (transformers' tp_plan); data parallel over "
                 f"{replicate * shard} groups ({shard} FSDP2 shard x {replicate} replica): the global batch, steps and "
                 "learning-rate schedule follow those groups, not the world size")  # fmt: skip
    return {"tensor_parallel": tp, "dp_shard": shard, "dp_replicate": replicate}


def check_tensor_parallel_loss(recipe: Recipe) -> None:
    """Liger's fused linear cross-entropy (cut_cross_entropy runs as it) multiplies the hidden states by
    lm_head.weight itself, never calling lm_head, so the hook that gathers TP's vocabulary-sharded output never runs:
    the kernel gets a DTensor shard (over NCCL it fails on mixed tensors, or takes a softmax over one shard). The
    CPU rehearsal runs no Liger kernel and can't show it, so it is refused there too."""
    if not liger_requested(recipe)["fused_linear_cross_entropy"]:
        return
    key = ("liger_fused_linear_cross_entropy" if recipe.liger_fused_linear_cross_entropy
           else "cut_cross_entropy" if recipe.cut_cross_entropy else f"plugins: {CCE_PLUGIN}")  # fmt: skip
    raise UserError(f"{key} with tensor_parallel_size {recipe.tensor_parallel_size} is not supported: the fused kernel "
                    "reads the whole lm_head weight, which tensor parallelism holds as a DTensor shard of the "
                    "vocabulary (over NCCL it fails, or computes the loss over one shard)",
                    f"use liger_cross_entropy: true instead of {key} (the loss on the gathered logits), or drop "
                    "tensor_parallel_size")  # fmt: skip


def tensor_parallel_shared_output(recipe: Recipe, cluster: Cluster, notes: list[str]) -> str | None:
    """Why every machine of this tensor-parallel run must see one output_dir (None: it needn't). The checkpoint's
    tp_state is torch's distributed checkpoint: one .metadata (written by rank 0) and shards each rank writes, and
    replicated tensors saved by one rank only, so resuming reads other machines' files. The machines' check-in
    (launch/lobby.py) tests that they share output_dir; launches without it are refused here."""
    resumes = recipe.save_strategy != "no" or recipe.resume_from_checkpoint or recipe.auto_resume_from_checkpoints
    if cluster.num_machines == 1 or recipe.save_only_model or not resumes:
        return None
    reason = "tensor-parallel checkpoints (tp_state: each rank's shards, read back by the other ranks on resume)"
    unchecked = ("rdzv_backend: c10d" if recipe.rdzv_backend == "c10d"
                 else "DeepSpeed's launcher over ssh" if cluster.launcher == "deepspeed" and cluster.ssh else None)  # fmt: skip
    if unchecked:
        raise UserError(f"{reason} need output_dir on storage all {cluster.num_machines} machines share, which llmtune "
                        f"checks when the machines check in, and {unchecked} starts them without that check",
                        ("remove rdzv_backend: c10d" if recipe.rdzv_backend == "c10d" else "add --no-ssh")
                        + " (each machine checks in with machine 0), or set save_only_model: true (weight snapshots, "
                        "no resume)")  # fmt: skip
    notes.append(f"tensor parallel on {cluster.num_machines} machines: output_dir must be on storage every machine "
                 "shares (checked when the machines check in)")  # fmt: skip
    return reason
