"""The device mesh of a plan: tensor-parallel, context-parallel and HSDP sizes, checked against the cluster and
the model, with the data-parallel degree the batch arithmetic follows (plan.mesh; the workers build it)."""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.plan.model_facts import NOT_ATTENTION_ONLY, ModelFacts
from llmtune.recipe import Recipe


def _data_parallel_sizes(recipe: Recipe, world: int, inner: int, key: str, shard_the_rest: bool) -> tuple[int, int]:
    """(dp_shard, dp_replicate) with world = dp_replicate x dp_shard x inner (the ranks `key` groups together):
    the recipe's own sizes, the unset one filling the rest (shards when `shard_the_rest`, else replicas)."""
    if world % inner:
        raise UserError(f"world size {world} is not divisible by {key} {inner}",
                        f"use --num-processes {inner * max(1, world // inner)}, or a {key} that divides {world}")  # fmt: skip
    rest = world // inner
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
        if facts and facts.model_type in NOT_ATTENTION_ONLY:
            raise UserError(f"context parallelism for {facts.model_type} models is not supported: their state-space / "
                            "linear-attention layers would see each rank's chunk as a whole sequence (ring attention "
                            "splits only attention)", "use tensor_parallel_size or FSDP2 alone")  # fmt: skip
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


def tensor_parallel_mesh(recipe: Recipe, world: int, facts: ModelFacts | None, notes: list[str]) -> dict[str, int]:
    """world = dp_replicate x dp_shard x tensor_parallel, each checked against the model and the cluster."""
    tp = recipe.tensor_parallel_size
    fsdp = recipe.resolved_fsdp()
    shard, replicate = _data_parallel_sizes(recipe, world, tp, "tensor_parallel_size", shard_the_rest=fsdp is not None)
    if facts:
        for what, count in (("attention heads", facts.num_heads), ("KV heads", facts.num_kv_heads)):
            if count % tp:
                raise UserError(f"tensor_parallel_size {tp} does not divide the model's {count} {what} (each rank "
                                f"keeps whole heads)", "choose a tensor_parallel_size that divides both head counts")  # fmt: skip
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
