"""Which machine holds which file of a multi-machine run's checkpoint, and whether a resume has what it needs.

Machines whose output_dir is not on shared storage each keep their own copy of every checkpoint (the machines'
check-in, launch/lobby.py, finds out and the launcher tells the ranks through OWN_DISK_ENV). So the marker of a
checkpoint of a run on several machines records, per machine (machine rank, host name, address), the files its copy
holds. Before any rank of a later run starts, machine 0 compares what each machine has of the checkpoint the run
would resume from with that record (`resume_refusal`), and stops a run whose ranks would not find their files.

Torch-free: the launcher imports it; `gather` reaches torch only through llmtune.train.runtime.collectives.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from llmtune.plan.checkpoint_layout import files_in  # noqa: F401  (the manifest lists a copy's files with it)
from llmtune.train.checkpoint.folders import MARKER, complete_checkpoints, step_of

KEY = "machines"  # in the marker: [{machine_rank, host, address, files}], one per machine, by machine rank
# Set by the launcher for its ranks (launch/runner.py) after the check-in: an environment variable because the
# lobby runs in the launcher, before the ranks exist, and every launcher (accelerate/torchrun, DeepSpeed's) hands
# its environment down to the ranks it starts.
OWN_DISK_ENV = "LLMTUNE_OWN_DISK"  # "1": this machine does not see machine 0's output_dir
MACHINE_RANK_ENV = "LLMTUNE_MACHINE_RANK"  # this machine's --machine-rank
ADDRESS_ENV = "LLMTUNE_MACHINE_ADDRESS"  # the address machine 0 reaches this machine at
SHOWN = 3  # missing files named in a refusal; the rest are counted


def own_disk() -> bool:
    return os.environ.get(OWN_DISK_ENV) == "1"


def machine_rank() -> int:
    """This rank's machine: the launcher's --machine-rank, else torchrun's node rank (GROUP_RANK)."""
    return int(os.environ.get(MACHINE_RANK_ENV, os.environ.get("GROUP_RANK", 0)))


def save_weights_here(model) -> None:
    """On a machine with its own disk its first rank saves the weights too (save_on_each_node; under DDP and ZeRO it
    holds them or gathers them with the others). transformers' save_pretrained (5.x) writes on torch.distributed
    rank 0 only, whatever is_main_process (the Trainer's should_save) says: this model follows is_main_process."""
    if hasattr(model, "should_save_on_this_rank") and "should_save_on_this_rank" not in vars(model):
        model.should_save_on_this_rank = lambda is_main_process: is_main_process


def complete_deepspeed_copy(folder: Path) -> None:
    """A ZeRO checkpoint on a machine with its own disk: transformers' save_on_each_node turns on DeepSpeed's
    use_node_local_storage, so each machine's first rank writes the model states every rank loads, but DeepSpeed
    writes `latest` (the tag a load without one reads) on global rank 0 only. Write it here too."""
    tags = sorted(p.name for p in Path(folder).glob("global_step*") if p.is_dir())
    if len(tags) == 1 and not (Path(folder) / "latest").exists():
        (Path(folder) / "latest").write_text(tags[0])


def gather(folder: Path, lists: bool) -> list[dict]:
    """Every machine's entry, on every rank (a collective: every rank calls it). `lists`: this rank is its
    machine's first rank, which lists the machine's copy of the checkpoint in `folder`."""
    from llmtune.train.runtime import collectives

    mine = None
    if lists:
        mine = {"machine_rank": machine_rank(), "host": socket.gethostname(),
                "address": os.environ.get(ADDRESS_ENV), "files": files_in(folder)}  # fmt: skip
    machines: dict[int, dict] = {}
    for entry in collectives.all_gather_objects(mine):
        if entry is not None:
            machines.setdefault(entry["machine_rank"], entry)
    return [machines[rank] for rank in sorted(machines)]


def resume_report(output_dir: Path, resume_from: str | None, auto_resume: bool) -> dict | None:
    """What this machine has of the checkpoint it would resume from (None: it would start from scratch): the
    checkpoint's path and step, the files of this machine's copy and the manifest its marker holds."""
    if resume_from:
        path = Path(resume_from)
    elif auto_resume and Path(output_dir).is_dir():
        done = complete_checkpoints(Path(output_dir))
        if not done:
            return None
        path = done[-1]
    else:
        return None
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        marker = {}
    files = files_in(path) if path.is_dir() else []
    return {"path": str(path), "step": step_of(path), "files": files, KEY: marker.get(KEY)}


def _where(entry: dict) -> str:
    place = ", ".join(str(p) for p in (entry.get("host"), entry.get("address")) if p)
    return f"machine rank {entry['machine_rank']}" + (f" ({place})" if place else "")


def _missing(reports: dict[int, dict | None]) -> tuple[dict | None, list[tuple[int, list[str], list[dict]]]]:
    """The checkpoint the run would resume from (the newest any machine has) and, per machine lacking files of it,
    (machine rank, the files it lacks, the manifest entries of the machines that held them when it was saved)."""
    saved = [reports[rank] for rank in sorted(reports) if reports[rank]]  # machine 0's path named first
    if not saved:
        return None, []
    newest = max(saved, key=lambda r: r["step"])
    name = Path(newest["path"]).name  # each machine's copy of it: the same name (output_dir, resume_from_checkpoint)
    copies = [r for r in saved if Path(r["path"]).name == name]
    manifest = next((r[KEY] for r in copies if r.get(KEY)), None) or []
    by_rank = {entry["machine_rank"]: entry for entry in manifest}
    if manifest:  # a machine the checkpoint's run did not have needs the files every machine of it held
        common = set.intersection(*(set(entry["files"]) for entry in manifest))
    else:  # no record of who held what (saved on one machine): every file one of its copies holds
        common = set().union(*(set(r["files"]) for r in copies))
    lacking = []
    for rank in sorted(reports):
        report = reports[rank]
        have = set(report["files"]) if report and Path(report["path"]).name == name else set()
        entry = by_rank.get(rank)
        gone = sorted((set(entry["files"]) if entry else common) - have)
        if gone:
            held = [entry] if entry else [e for e in manifest if set(gone) <= set(e["files"])]
            lacking.append((rank, gone, held))
    return newest, lacking


def resume_refusal(reports: dict[int, dict | None], addresses: dict[int, str]) -> tuple[str, str] | None:
    """(message, hint) when some machine lacks files its copy of the checkpoint should hold, else None. `reports`:
    each machine's resume_report by machine rank; `addresses`: where each machine rank of this run is now."""
    newest, lacking = _missing(reports)
    if not lacking:
        return None
    name = Path(newest["path"]).name
    parts = []
    for rank, gone, held in lacking:
        shown = ", ".join(gone[:SHOWN]) + (f" and {len(gone) - SHOWN} more" if len(gone) > SHOWN else "")
        where = f", held by {' and '.join(map(_where, held))} when it was saved" if held else ""
        if (
            len(held) == 1
            and held[0]["machine_rank"] == rank
            and held[0].get("address") not in (None, addresses.get(rank))
        ):
            now = [r for r, address in addresses.items() if address == held[0]["address"]]  # that machine moved
            where += f" (now machine rank {now[0]})" if now else ""
        parts.append(f"machine rank {rank} lacks {len(gone)} file(s) of {name} ({shown}){where}")
    first_rank, _, first_held = lacking[0]
    source = f" from {_where(first_held[0])}" if first_held else " from a machine that has them"
    message = f"can't resume from {newest['path']} on these machines' own disks: " + "; ".join(parts)
    hint = (f"start each machine with the machine rank it had when {name} was saved (its {MARKER} lists them), or "
            f"copy the missing files{source} into {newest['path']} on machine rank {first_rank} (and so on), or remove "
            f"{name} on every machine to resume from an earlier checkpoint")  # fmt: skip
    return message, hint
