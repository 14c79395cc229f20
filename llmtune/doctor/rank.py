"""What each rank of a doctor job reports and measures. Rank 0 gathers every rank's report and writes doctor.json.

Test hooks (environment): LLMTUNE_TEST_STACK_OVERRIDE="transformers=0.0.1,..." makes this rank report those
versions (a machine with another stack); LLMTUNE_TEST_LINK_DELAY=<seconds> slows this rank's ring link.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import socket
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

STACK = ("torch", "transformers", "accelerate", "deepspeed", "peft", "trl", "llmtune")
# bytes of each collective measured: GPUs move more per call than the CPU rehearsal's gloo can in a few seconds
SIZES = {"cuda": (1 << 20, 16 << 20, 128 << 20), "cpu": (64 << 10, 1 << 20, 8 << 20)}
REPEATS = 5


def stack() -> dict:
    """Versions of python and the libraries a run uses (read from package metadata: nothing imported)."""
    found = {"python": platform.python_version()}
    for name in STACK:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    import torch

    found["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        found["driver"] = _driver_version()
    for pair in filter(None, os.environ.get("LLMTUNE_TEST_STACK_OVERRIDE", "").split(",")):
        name, _, value = pair.partition("=")
        found[name] = value
    return found


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()  # fmt: skip
        return out[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def devices(local_rank: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"gpus": 0, "gpu_name": None, "free_bytes": None, "total_bytes": None}
    index = local_rank % torch.cuda.device_count()
    free, total = torch.cuda.mem_get_info(index)
    return {"gpus": torch.cuda.device_count(), "gpu_name": torch.cuda.get_device_name(index), "free_bytes": free,
            "total_bytes": total}  # fmt: skip


def readable(path: str) -> bool | None:
    """Whether a local path is readable here (None: not a local path, e.g. a hub id)."""
    candidate = Path(path).expanduser()
    if not candidate.exists():
        return False if (path.startswith(("/", ".", "~")) or os.sep in path and candidate.suffix) else None
    return os.access(candidate, os.R_OK)


def storage(plan: dict, recipe: dict, folder: Path, rank: int) -> dict:
    """The output folder: writable here, its free space; the recipe's local inputs: readable here."""
    token = folder / f"token-{rank}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        token.write_text(socket.gethostname())
        writable = True
    except OSError:
        writable = False
    out = Path(recipe["output_dir"])
    usage = shutil.disk_usage(out if out.exists() else out.parent if out.parent.exists() else "/")
    paths = {"base_model": recipe.get("base_model")}
    for index, entry in enumerate(recipe.get("datasets") or []):
        paths[f"datasets[{index}].path"] = entry.get("path")
    nvme = recipe.get("offload_nvme_path")
    if nvme:
        paths["offload_nvme_path"] = nvme
    return {"writable": writable, "free_bytes": usage.free,
            "inputs": {key: readable(value) for key, value in paths.items() if value}}  # fmt: skip


def network(plan: dict) -> dict:
    from llmtune.launch.net import local_address_towards

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    nccl = plan["cluster"]["device"] == "cuda" and (plan["cluster"].get("backend") or "nccl") == "nccl"
    variable = "NCCL_SOCKET_IFNAME" if nccl else "GLOO_SOCKET_IFNAME"
    address = local_address_towards(master)
    interface = os.environ.get(variable) or _interface_of(address)
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else None
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    asks_ib = bool(os.environ.get("NCCL_IB_HCA")) or os.environ.get("NCCL_NET", "").upper() == "IB"
    asks_efa = os.environ.get("FI_PROVIDER", "").lower() == "efa"
    fabric = (
        sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
        if Path("/sys/class/infiniband").exists()
        else []
    )
    return {"backend": "nccl" if nccl else "gloo", "interface_variable": variable, "interface": interface,
            "address": address, "shm_bytes": shm, "open_files": files,
            "memlock": None if memlock == resource.RLIM_INFINITY else memlock,
            "asks_infiniband": asks_ib, "asks_efa": asks_efa, "fabric_devices": fabric}  # fmt: skip


def _interface_of(address: str | None) -> str | None:
    """The network interface that holds `address` (Linux: /proc/net/fib_trie is awkward; `ip` is usual)."""
    if not address:
        return None
    try:
        import subprocess

        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == address:
            return parts[1]
    return None


def _time(operation, repeats: int = REPEATS) -> float:
    """Median seconds of `operation` (synchronised on GPUs), after one warm-up."""
    import torch

    operation()
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        operation()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - began)
    return sorted(samples)[len(samples) // 2]


def collectives_report(device: str, groups: dict, quick: bool = False) -> dict:
    """Correctness of all_reduce, all_gather and broadcast on every rank; all_reduce bus bandwidth (nccl-tests'
    busbw: algbw x 2(n-1)/n) at three sizes, in the whole world and per kind of group; this rank's ring link."""
    import torch

    from llmtune.train.runtime import collectives

    world, rank = collectives.world_size(), collectives.rank()
    where = collectives.device()
    summed = collectives.all_reduce(torch.full((4,), float(rank + 1), device=where))
    gathered = collectives.all_gather_tensors(torch.tensor([float(rank)], device=where))
    sent = torch.arange(8, dtype=torch.float32, device=where) if rank == 0 else torch.zeros(8, device=where)
    collectives.broadcast(sent, src=0)
    correct = {"all_reduce": bool(torch.all(summed == world * (world + 1) / 2)),
               "all_gather": [float(t.item()) for t in gathered] == [float(r) for r in range(world)],
               "broadcast": bool(torch.equal(sent, torch.arange(8, dtype=torch.float32, device=where)))}  # fmt: skip
    if quick:  # `llmtune train --preflight`: correctness only, no bandwidth
        return {"correct": correct, "bandwidth": {}}
    bandwidth = {}
    for name, (group, members) in groups.items():
        if group is None and name != "world" or members < 2:
            continue
        rows = []
        for size in SIZES[device]:
            data = torch.ones(size // 4, dtype=torch.float32, device=where)
            seconds = _time(lambda data=data, group=group: collectives.all_reduce(data, group=group))
            algbw = size / seconds
            rows.append({"bytes": size, "seconds": seconds, "busbw": algbw * 2 * (members - 1) / members})
        bandwidth[name] = rows
    return {"correct": correct, "bandwidth": bandwidth, "ring": _ring_link(world, rank, where, device)}


def _ring_link(world: int, rank: int, where, device: str) -> dict:
    """Seconds this rank takes to receive the largest message from the rank before it (each rank sends to the next
    at once): a slow rank or link shows as one slow pair."""
    import torch

    from llmtune.train.runtime import collectives

    size = SIZES[device][-1]
    outgoing = torch.ones(size // 4, dtype=torch.float32, device=where)
    incoming = torch.empty_like(outgoing)
    delay = float(os.environ.get("LLMTUNE_TEST_LINK_DELAY", 0))

    def exchange():
        if delay:
            time.sleep(delay)
        collectives.exchange_in_ring(outgoing, incoming)

    seconds = _time(exchange, repeats=3)
    return {"from_rank": (rank - 1) % world, "seconds": seconds, "bytes": size, "bandwidth": size / seconds}


def groups_by_machine(ranks_by_host: dict[str, list[int]]):
    """(world, intra-node groups, the group of each node's first rank); every rank creates every group."""
    from llmtune.train.runtime import collectives

    rank = collectives.rank()
    intra, mine = None, 1
    for host in sorted(ranks_by_host) if len(ranks_by_host) > 1 else []:  # one machine: the world is the node
        members = sorted(ranks_by_host[host])
        group = collectives.new_group(members) if len(members) > 1 else None
        if rank in members:
            intra, mine = group, len(members)
    leaders = sorted(min(m) for m in ranks_by_host.values())
    inter = collectives.new_group(leaders) if len(leaders) > 1 else None
    world = collectives.world_size()
    out = {"world": (None, world), "intra-node": (intra, mine)}
    if inter is not None and rank in leaders:
        out["inter-node"] = (inter, len(leaders))
    return out


def main(argv: list[str]) -> int:
    """`python -m llmtune.doctor <plan.json>` in every rank of a doctor job."""
    import datetime

    payload = json.loads(Path(argv[0]).read_text())
    plan, recipe = payload["plan"], payload["recipe"]
    folder = Path(plan["config_dir"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    from llmtune.train.runtime import collectives

    collectives.configure(plan["cluster"]["device"], local_rank)
    import torch.distributed as dist

    backend = plan["cluster"].get("backend") or ("gloo" if plan["cluster"]["device"] == "cpu" else "nccl")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if dist.is_initialized() else 0
    host = os.environ.get("LLMTUNE_MACHINE_ADDRESS") or socket.gethostname()
    report = {"rank": rank, "local_rank": local_rank, "host": host, "machine_rank": os.environ.get("GROUP_RANK"),
              "stack": stack(), "devices": devices(local_rank), "storage": storage(plan, recipe, folder, rank),
              "network": network(plan)}  # fmt: skip
    if dist.is_initialized():
        collectives.barrier()
        report["clock"] = time.time()  # right after a barrier: the spread is the clocks' skew (plus milliseconds)
        report["storage"]["tokens_seen"] = sorted(int(p.name.split("-")[1]) for p in folder.glob("token-*"))
        hosts = collectives.all_gather_objects((rank, host))
        by_host: dict[str, list[int]] = {}
        for r, h in hosts:
            by_host.setdefault(h, []).append(r)
        groups = groups_by_machine(by_host)
        report["collectives"] = collectives_report(plan["cluster"]["device"], groups,
                                                   quick=os.environ.get("LLMTUNE_DOCTOR_QUICK") == "1")  # fmt: skip
        reports = collectives.gather_objects(report)
    else:
        report["clock"] = time.time()
        report["storage"]["tokens_seen"] = [0]
        reports = [report]
    if rank == 0:
        (folder / "doctor.json").write_text(json.dumps({"reports": reports, "plan": plan}, indent=1))
    collectives.teardown()
    return 0
