"""Judging a doctor job's reports (torch-free): each problem names the machine or rank and says what to do.

`findings(reports, plan, needs)` -> (problems, notes). `needs`: what the plan will need of each rank (free GPU memory,
free disk for its checkpoints), from llmtune's estimate; None where unknown.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

GB = 2**30
SLOW_LINK = 3.0  # a ring link this many times slower than the median of the others is named
CLOCK_SKEW_WARN, CLOCK_SKEW_FAIL = 1.0, 5.0  # seconds
SHM_MINIMUM = 1 * GB  # NCCL's shared-memory transport within a machine
OPEN_FILES_MINIMUM = 4096


@dataclass
class Problem:
    where: str  # "machine node-b (ranks 2-3)", "rank 1 (node-b)"
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.where}: {self.what} (fix: {self.fix})"


def _rank(report: dict) -> str:
    return f"rank {report['rank']} ({report['host']})"


def _machines(reports: list[dict]) -> dict[str, list[dict]]:
    machines: dict[str, list[dict]] = {}
    for report in sorted(reports, key=lambda r: r["rank"]):
        machines.setdefault(report["host"], []).append(report)
    return machines


def _machine(host: str, ranks: list[dict]) -> str:
    numbers = [r["rank"] for r in ranks]
    span = f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {numbers[0]}-{numbers[-1]}"
    return f"machine {host} ({span})"


def stack_problems(reports: list[dict]) -> list[Problem]:
    """A library (or python, CUDA, NCCL, driver) whose version differs between machines: the odd ones named."""
    problems = []
    machines = _machines(reports)
    for name in sorted({key for r in reports for key in r["stack"]}):
        seen = {host: ranks[0]["stack"].get(name, "absent") for host, ranks in machines.items()}
        counts = Counter(seen.values())
        if len(counts) < 2:
            continue
        common = counts.most_common(1)[0][0]
        for host, value in seen.items():
            if value != common:
                problems.append(Problem(_machine(host, machines[host]),
                                        f"has {name} {value}, the other machines {name} {common}",
                                        f"install {name} {common} there: every machine must run the same stack"))  # fmt: skip
    return problems


def device_problems(reports: list[dict], plan: dict, gpu_bytes: float | None) -> list[Problem]:
    if plan["cluster"]["device"] != "cuda":
        return []
    problems = []
    per_machine = plan["world_size"] // plan["cluster"]["num_machines"]
    for host, ranks in _machines(reports).items():
        gpus = ranks[0]["devices"]["gpus"]
        if gpus < per_machine and plan["cluster"].get("backend") != "gloo":
            problems.append(Problem(_machine(host, ranks), f"has {gpus} GPU(s) for {per_machine} process(es)",
                                    "run fewer processes per machine, or use a machine with more GPUs"))  # fmt: skip
    for report in reports:
        free = report["devices"]["free_bytes"]
        if gpu_bytes and free is not None and free < gpu_bytes:
            problems.append(Problem(_rank(report), f"its GPU has {free / GB:.1f} GB free, the plan needs about "
                                    f"{gpu_bytes / GB:.1f} GB", "free the GPU (another process holds memory: "
                                    "nvidia-smi), or choose a strategy that shards more (llmtune estimate)"))  # fmt: skip
    return problems


def storage_problems(
    reports: list[dict], plan: dict, checkpoint_bytes: float | None
) -> tuple[list[Problem], list[str]]:
    problems, notes = [], []
    machines = _machines(reports)
    everyone = sorted(r["rank"] for r in reports)
    shared = all(r["storage"]["tokens_seen"] == everyone for r in reports)
    if len(machines) > 1:
        notes.append("output_dir is shared by every machine" if shared else
                     "output_dir is not shared: each machine sees its own folder (checkpoints are kept on every "
                     "machine, and a resume needs the same machines; FSDP, tensor-parallel and pipeline runs need "
                     "shared storage)")  # fmt: skip
        if not shared and (plan["strategy"] in ("tp", "pipeline") or plan["strategy"].startswith("fsdp")):
            problems.append(Problem("the machines", f"don't share output_dir, which {plan['strategy']} checkpoints "
                                    "need", "put output_dir on storage every machine mounts (NFS, Lustre, ...)"))  # fmt: skip
    for host, ranks in machines.items():
        store = ranks[0]["storage"]
        if not store["writable"]:
            problems.append(Problem(_machine(host, ranks), "can't write in output_dir",
                                    "check the folder's permissions and that its disk is mounted there"))  # fmt: skip
        if checkpoint_bytes and store["free_bytes"] < 2 * checkpoint_bytes:
            problems.append(Problem(_machine(host, ranks), f"has {store['free_bytes'] / GB:.1f} GB free where "
                                    f"output_dir is; two checkpoints take about {2 * checkpoint_bytes / GB:.1f} GB",
                                    "free space, or lower save_total_limit"))  # fmt: skip
        for key, ok in store["inputs"].items():
            if ok is False:
                problems.append(Problem(_machine(host, ranks), f"can't read {key} (a local path of the recipe)",
                                        "copy it there, or put it on storage every machine mounts"))  # fmt: skip
    return problems, notes


def network_problems(reports: list[dict], plan: dict) -> tuple[list[Problem], list[str]]:
    problems, notes = [], []
    gpu = plan["cluster"]["device"] == "cuda"
    for host, ranks in _machines(reports).items():
        net = ranks[0]["network"]
        where = _machine(host, ranks)
        if gpu and net["shm_bytes"] is not None and net["shm_bytes"] < SHM_MINIMUM:
            problems.append(Problem(where, f"/dev/shm is {net['shm_bytes'] / 2**20:.0f} MB; NCCL needs more within a "
                                    "machine", "in Docker: --shm-size=16g (or --ipc=host)"))  # fmt: skip
        if net["open_files"] < OPEN_FILES_MINIMUM:
            notes.append(f"{where}: open-files limit {net['open_files']} (ulimit -n); data loading and NCCL may need "
                         f"more than {OPEN_FILES_MINIMUM}")  # fmt: skip
        if net["asks_infiniband"] and not net["fabric_devices"]:
            problems.append(Problem(where, "the environment asks NCCL for InfiniBand but no device is under "
                                    "/sys/class/infiniband", "check the HCA and its driver, or unset NCCL_IB_HCA"))  # fmt: skip
        if net["asks_efa"] and not net["fabric_devices"]:
            problems.append(Problem(where, "FI_PROVIDER=efa but no EFA device is present",
                                    "attach an EFA interface, or unset FI_PROVIDER"))  # fmt: skip
        if (net["asks_infiniband"] or net["asks_efa"]) and net["memlock"] is not None:
            problems.append(Problem(where, f"memlock is limited to {net['memlock']} bytes; RDMA pins memory",
                                    "ulimit -l unlimited (in Docker: --ulimit memlock=-1)"))  # fmt: skip
        if not net["interface"]:
            notes.append(f"{where}: could not tell which interface {net['backend']} uses; set "
                         f"{net['interface_variable']}")  # fmt: skip
    clocks = [r["clock"] for r in reports]
    skew = max(clocks) - min(clocks)
    if skew > CLOCK_SKEW_FAIL:
        late = max(reports, key=lambda r: abs(r["clock"] - statistics.median(clocks)))
        problems.append(Problem(_rank(late), f"its clock is {skew:.1f} s off the others'",
                                "run NTP (chrony) on every machine: logs and timeouts compare times"))  # fmt: skip
    elif skew > CLOCK_SKEW_WARN:
        notes.append(f"clocks differ by up to {skew:.1f} s between machines")
    return problems, notes


def collective_problems(reports: list[dict]) -> list[Problem]:
    problems = []
    for report in reports:
        wrong = [name for name, ok in report.get("collectives", {}).get("correct", {}).items() if not ok]
        if wrong:
            problems.append(Problem(_rank(report), f"got wrong results from {', '.join(wrong)}",
                                    "a broken GPU or NIC on that machine: exclude it and run llmtune doctor again"))  # fmt: skip
    rings = [(r, r["collectives"]["ring"]) for r in reports if "ring" in r.get("collectives", {})]
    if len(rings) > 2:
        for report, ring in rings:
            others = [o["seconds"] for r, o in rings if r is not report]
            median = statistics.median(others)
            if ring["seconds"] > SLOW_LINK * median:
                problems.append(Problem(_rank(report), f"receives from rank {ring['from_rank']} at "
                                        f"{ring['bandwidth'] / 1e6:.0f} MB/s, {ring['seconds'] / median:.1f}x slower "
                                        "than the other links", "check that link's NIC, cable and interface "
                                        "(NCCL_SOCKET_IFNAME); the slowest link sets every step's pace"))  # fmt: skip
    return problems


def findings(reports: list[dict], plan: dict, gpu_bytes: float | None = None,
             checkpoint_bytes: float | None = None) -> tuple[list[Problem], list[str]]:  # fmt: skip
    """Every problem (a reason to stop) and note (worth knowing) of a doctor job."""
    problems = stack_problems(reports) + device_problems(reports, plan, gpu_bytes)
    stored, notes = storage_problems(reports, plan, checkpoint_bytes)
    networked, more = network_problems(reports, plan)
    problems += stored + networked + collective_problems(reports)
    missing = sorted(set(range(plan["world_size"])) - {r["rank"] for r in reports})
    if missing:
        problems.append(Problem(f"rank(s) {', '.join(map(str, missing))}", "did not report",
                                "look at that machine's log under <output_dir>/llmtune/doctor/logs"))  # fmt: skip
    return problems, notes + more
