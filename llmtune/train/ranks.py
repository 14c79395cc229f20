"""What each rank actually did, gathered on every rank: the check that a run is not silently wrong.

Each rank reports its rank, the world size it sees, and a fingerprint of its first batch. If the
world size differs from the plan, or two data-parallel ranks got the same first batch (data not
split: the failure mode of DeepSpeed or FSDP quietly degrading on CPU), the run stops.
"""

from __future__ import annotations

import hashlib
import socket


class SilentlyWrongRun(RuntimeError):
    pass


def fingerprint(input_ids) -> str:
    return hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest()[:16]


def gather(report: dict) -> list[dict]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def check_first_batch(input_ids, plan: dict, accelerate_world: int, dataset_rows: int) -> list[dict]:
    """Gather every rank's view of the run and stop it if the ranks don't form the planned job."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    report = {"rank": rank, "host": socket.gethostname(), "world_size": world, "accelerate_world_size": accelerate_world,
              "first_batch": fingerprint(input_ids)}  # fmt: skip
    reports = gather(report)
    planned = plan["world_size"]
    for seen in reports:
        if seen["world_size"] != planned or seen["accelerate_world_size"] != planned:
            raise SilentlyWrongRun(
                f"rank {seen['rank']} sees world size {seen['world_size']} (accelerate: {seen['accelerate_world_size']}) "
                f"but the plan has {planned}; the ranks would not train as one job"
            )
    # Every rank of a Trainer run is a data-parallel rank (pipeline runs use their own loop), so all first
    # batches must differ; sets too small to give each rank its own rows may legitimately repeat some.
    if dataset_rows >= 2 * plan["micro_batch_size"] * plan["data_parallel_size"]:
        batches = [seen["first_batch"] for seen in reports]
        if len(set(batches)) != len(batches):
            raise SilentlyWrongRun(
                "two data-parallel ranks received the same first batch: the data is not being split across "
                "ranks, so they would train on the same examples"
            )
    return reports


def local_parameter_numel(model) -> int:
    """Parameters this rank actually holds: its ZeRO-3 partition or FSDP shard, else the full tensor."""
    from llmtune.train.memory import local_tensor

    return sum(local_tensor(param).numel() for param in model.parameters())
