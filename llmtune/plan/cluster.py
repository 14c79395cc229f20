"""Where a run happens: processes, machines, this machine's rank, the rendezvous address.

The flags mean what they mean for `accelerate launch`: --num-processes counts processes
on all machines together. Local GPUs are counted without importing torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from llmtune.errors import UserError

DEFAULT_PORT = 29500


def count_local_gpus() -> int:
    """CUDA devices this process may use, from CUDA_VISIBLE_DEVICES or the driver's /proc entries."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


@dataclass(frozen=True)
class Cluster:
    num_processes: int = 1  # on all machines together
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str = "127.0.0.1"
    main_process_port: int = DEFAULT_PORT
    device: str = "cpu"  # "cuda" (NCCL on GPUs) or "cpu" (gloo rehearsal)
    launcher: str = "accelerate"  # or "deepspeed" (DeepSpeed's launcher, machines from a hostfile)
    hostfile: str | None = None
    ssh: bool = True  # deepspeed: machine 0 starts every machine over ssh (pdsh); False: each starts its own
    hosts: tuple[str, ...] = ()  # from the hostfile, by machine rank
    # the process group's backend: gloo on CPU, NCCL on GPUs; `--device cuda:gloo` puts GPU tensors on gloo so
    # that several ranks can share one GPU (NCCL refuses that): the GPU test tier's stand-in for several GPUs
    backend: str = ""
    unused_address: str = ""  # --main-process-ip given for one machine, where the ranks meet on this machine

    def __post_init__(self) -> None:
        if not self.backend:
            object.__setattr__(self, "backend", "gloo" if self.device == "cpu" else "nccl")

    def notes(self) -> list[str]:
        if not self.unused_address:
            return []
        return [f"--main-process-ip {self.unused_address} is not used on one machine: the ranks meet on this machine "
                "(127.0.0.1); a job on several machines takes --num-machines N, and each machine runs the command "
                "with its --machine-rank"]  # fmt: skip

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def rehearsal(self) -> bool:
        return self.device == "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def make_cluster(
    num_processes: int | None = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
    device: str | None = None,
    launcher: str = "accelerate",
    hostfile: str | None = None,
    no_ssh: bool = False,
) -> Cluster:
    """Validate the cluster flags; default to every local GPU on each machine, or one CPU process.

    With a DeepSpeed hostfile the machines and their processes come from the file; flags that say otherwise
    are refused rather than silently overridden.
    """
    if launcher not in ("accelerate", "deepspeed"):
        raise UserError(f"--launcher must be accelerate or deepspeed, not {launcher!r}")
    _check_address(main_process_ip)
    hosts: tuple[str, ...] = ()
    if hostfile is not None and launcher != "deepspeed":
        raise UserError("--hostfile is DeepSpeed's", "add --launcher deepspeed")
    if no_ssh and launcher != "deepspeed":
        raise UserError("--no-ssh is for --launcher deepspeed", "accelerate always starts one launcher per machine")
    if hostfile is not None:
        from llmtune.plan.hostfile import read_hostfile

        listed = read_hostfile(hostfile)
        machines, processes = len(listed), sum(slots for _, slots in listed)
        if num_machines not in (1, machines):
            raise UserError(f"--num-machines {num_machines} but {hostfile} lists {machines}", "drop --num-machines")
        if num_processes not in (None, processes):
            raise UserError(f"--num-processes {num_processes} but {hostfile}'s slots add up to {processes}",
                            "drop --num-processes, or change the slots")  # fmt: skip
        num_machines, num_processes = machines, processes
        hosts = tuple(host for host, _ in listed)
        if main_process_ip in hosts[1:]:  # DeepSpeed runs machine rank 0 on the first line: the store is there
            raise UserError(f"--main-process-ip {main_process_ip} is line {hosts.index(main_process_ip) + 1} of "
                            f"{hostfile}, and machine rank 0 runs on its first line ({hosts[0]})",
                            f"drop --main-process-ip, or pass {hosts[0]}'s address")  # fmt: skip
        main_process_ip = main_process_ip or hosts[0]
        if not no_ssh and machine_rank != 0:
            raise UserError("--machine-rank is only for --no-ssh: over ssh, machine 0 starts every machine",
                            "run the command on the hostfile's first machine only, or add --no-ssh")  # fmt: skip
        hostfile = str(Path(hostfile).resolve())
    elif launcher == "deepspeed" and num_machines > 1:
        raise UserError("--launcher deepspeed on several machines needs --hostfile",
                        "write one machine per line as `hostname slots=N`")  # fmt: skip
    gpus = count_local_gpus()
    device = device or ("cuda" if gpus else "cpu")
    device, _, backend = device.partition(":")
    if device not in ("cuda", "cpu") or backend not in ("", "gloo") or (device, backend) == ("cpu", "gloo"):
        given = device + (":" + backend if backend else "")
        hint = ("a run uses every GPU it is shown: pick them with CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES="
                f"{backend} llmtune train ... --device cuda)" if device == "cuda" and backend.isdigit() else
                "use --device cuda" if device.lower() in ("gpu", "nccl", "cuda") else
                "cuda (GPUs, NCCL) or cpu (a rehearsal on CPU processes); cuda:gloo shares GPUs between ranks over "
                "gloo, for tests")  # fmt: skip
        raise UserError(f"--device must be cuda or cpu, not {given!r}", hint)
    if num_machines < 1:
        raise UserError(f"--num-machines must be at least 1 (got {num_machines})")
    if num_processes is None and device == "cuda" and not gpus:
        raise UserError("--device cuda, and this machine has no GPU to count the processes from",
                        "pass --num-processes N: the GPUs of the machines the plan is for")  # fmt: skip
    if num_processes is None:
        num_processes = (gpus if device == "cuda" else 1) * num_machines
    if num_processes < 1:
        raise UserError(f"--num-processes must be at least 1 (got {num_processes})")
    if num_processes % num_machines:
        raise UserError(
            f"--num-processes {num_processes} is not divisible by --num-machines {num_machines}",
            "--num-processes counts processes on all machines together, as in accelerate launch",
        )
    if not 0 <= machine_rank < num_machines:
        raise UserError(f"--machine-rank {machine_rank} is outside 0..{num_machines - 1}")
    if num_machines > 1 and not main_process_ip:
        raise UserError("--main-process-ip is required with --num-machines > 1", "give the address of machine rank 0")
    unused = ""
    if num_machines == 1 and hostfile is None and main_process_ip not in (None, *LOOPBACK):
        unused, main_process_ip = main_process_ip, None  # accelerate and torchrun ignore it on one machine too
    port = DEFAULT_PORT if main_process_port is None else main_process_port
    if not 1 <= port <= 65535:
        raise UserError(f"--main-process-port {port} is not a TCP port (1-65535)")
    per_machine = num_processes // num_machines
    if device == "cuda" and gpus and per_machine > gpus and backend != "gloo":
        raise UserError(
            f"{per_machine} processes per machine but this machine has {gpus} GPU(s)",
            "lower --num-processes, or rehearse on CPU with --device cpu",
        )
    return Cluster(num_processes, num_machines, machine_rank, main_process_ip or "127.0.0.1", port, device,
                   launcher, hostfile, not no_ssh, hosts, backend, unused)  # fmt: skip


def _check_address(address: str | None) -> None:
    """--main-process-ip: a host name or address, without the port (accelerate and torchrun take it apart)."""
    if address is None:
        return
    host, _, tail = address.rpartition(":")
    if (address.count(":") == 1 or (address.startswith("[") and host.endswith("]"))) and tail.isdigit():
        raise UserError(f"--main-process-ip {address} carries a port",
                        f"pass --main-process-ip {host} --main-process-port {tail}")  # fmt: skip
    if not address.strip() or any(c.isspace() or c in "/@" for c in address):
        raise UserError(f"--main-process-ip {address!r} is not a host name or address",
                        "give machine rank 0's IP address or host name")  # fmt: skip
