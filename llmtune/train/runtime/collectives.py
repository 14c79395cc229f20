"""Every torch.distributed collective llmtune issues, on the rank's communication device.

NCCL reduces only CUDA tensors; gloo takes CPU tensors (and, with ranks sharing one GPU, CUDA tensors for
most collectives). A collective on a tensor in the wrong place passes every CPU rehearsal and kills every GPU
rank ("No backend type associated with device type cpu"): on an H100 it did so after the last step of a
ZeRO run, before the model was saved. So the tensors llmtune reduces are built here, on the device this module
was configured with, and every tensor handed in is checked against it: a CPU tensor on a GPU plan fails under
gloo exactly as it would under NCCL. `tests/unit/test_collectives.py` fails if any other module of the package
calls a collective directly.
"""

from __future__ import annotations

_device = None  # torch.device of this rank's collectives, set by configure()
_recent: list[tuple[int, str, float]] = []  # the last collectives this module issued: (number, name, unix time)
_issued = 0


def _note(name: str) -> None:
    """Remember a collective as it is entered (hang reports name the last ones: llmtune/train/runtime/watchdog.py)."""
    import time

    global _issued
    _issued += 1
    _recent.append((_issued, name, time.time()))
    del _recent[:-16]


def recent() -> list[dict]:
    """The last collectives llmtune entered on this rank, oldest first (the engines' own are not among them)."""
    return [{"number": n, "name": name, "at": at} for n, name, at in _recent]


class MisplacedTensor(RuntimeError):
    """A tensor given to a collective lives elsewhere than the communication device (NCCL would refuse it)."""


def configure(device_type: str, local_rank: int) -> None:
    """Collectives of this rank run on `cuda:<its GPU>` for GPU plans, on the CPU for rehearsals.

    On GPUs this also makes the rank's GPU the current device: all_gather_object and barrier under NCCL use
    torch's current device, and every rank would otherwise pick GPU 0.
    """
    import torch

    global _device
    if device_type == "cuda":
        index = local_rank % torch.cuda.device_count()  # ranks sharing one GPU (gloo tier) share its index
        torch.cuda.set_device(index)
        _device = torch.device("cuda", index)
    else:
        _device = torch.device("cpu")


def device():
    """The communication device: as configured, else what the default group's backend implies."""
    import torch

    if _device is not None:
        return _device
    if active() and _dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist():
    import torch.distributed as dist

    return dist


def active() -> bool:
    """A process group exists (a multi-rank run): collectives are needed."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return _dist().get_world_size() if active() else 1


def rank() -> int:
    return _dist().get_rank() if active() else 0


def check(tensor) -> None:
    """Refuse a tensor off the communication device, naming where it is and where it should be."""
    want = device()
    if tensor.device.type != want.type or (want.type == "cuda" and tensor.device.index != want.index):
        raise MisplacedTensor(
            f"collective on a tensor on {tensor.device}, but this rank communicates on {want}: "
            "NCCL refuses such a tensor; build it with collectives.tensor()"
        )


def tensor(values, dtype=None):
    """A tensor on the communication device, ready for a collective."""
    import torch

    return torch.tensor(values, dtype=dtype or torch.float64, device=device())


def all_reduce(value, group=None):
    """Sum `value` over the ranks of `group` in place (checked to be on the communication device)."""
    if active():
        check(value)
        _note("all_reduce")
        _dist().all_reduce(value, group=group)
    return value


def sum_values(values: list[float], group=None) -> list[float]:
    """Sum a few numbers over the ranks (flags, counts, losses): one all-reduce, float64 on the right device."""
    if not active():
        return [float(v) for v in values]
    reduced = all_reduce(tensor([float(v) for v in values]), group)
    return [float(v) for v in reduced.tolist()]


def any_rank(flag: bool) -> bool:
    """True on every rank when at least one rank says True (stop requests, non-finite losses)."""
    return sum_values([float(flag)])[0] > 0


_host_group = None  # a gloo group for host-side flags, where the default group communicates on GPUs


def any_rank_on_host(flag: bool) -> bool:
    """`any_rank` without touching the GPU: the flag travels as a CPU tensor over gloo (a group of its own beside
    NCCL, created the first time every rank asks), so reading the result never waits for the GPU's queued work.
    Called at the same point by every rank (after each step)."""
    if not active():
        return flag
    import torch

    global _host_group
    dist = _dist()
    if device().type == "cpu":  # the rehearsal: the default gloo group already lives on the host
        group = None
    else:
        if _host_group is None:
            _host_group = dist.new_group(backend="gloo")
        group = _host_group
    value = torch.tensor([float(flag)], dtype=torch.float64)
    _note("all_reduce (host flag)")
    dist.all_reduce(value, group=group)
    return value.item() > 0


_checkpoint_group = None


def checkpoint_group():
    """A gloo group for DCP's background checkpoint writer (None without a process group): apart from the training's
    collectives and from the host flags, since the writer's thread runs beside both. Every rank creates it at the
    same point (the first async checkpoint, or the trainer's set-up)."""
    global _checkpoint_group
    if not active():
        return None
    if _checkpoint_group is None:
        _checkpoint_group = _dist().new_group(backend="gloo")
    return _checkpoint_group


def all_gather_tensors(value) -> list:
    """Every rank's copy of `value` (same shape on every rank), in rank order."""
    check(value)
    _note("all_gather")
    out = [value.new_empty(value.shape) for _ in range(world_size())]
    _dist().all_gather(out, value)
    return out


def broadcast(value, src: int = 0):
    """`value` from rank `src`, in place on every rank."""
    check(value)
    _note("broadcast")
    _dist().broadcast(value, src=src)
    return value


def exchange_in_ring(outgoing, incoming) -> None:
    """Send `outgoing` to the next rank while receiving `incoming` from the one before (a ring step)."""
    check(outgoing)
    check(incoming)
    dist, world, me = _dist(), world_size(), rank()
    _note("send/recv (ring)")
    for request in (dist.isend(outgoing, (me + 1) % world), dist.irecv(incoming, (me - 1) % world)):
        request.wait()


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, on every rank (picklable reports)."""
    if not active():
        return [obj]
    device()  # under NCCL the objects travel through the current CUDA device, which configure() set
    _note("all_gather_object")
    gathered: list = [None] * world_size()
    _dist().all_gather_object(gathered, obj)
    return gathered


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's `obj` on rank `dst` (None elsewhere)."""
    if not active():
        return [obj]
    dist = _dist()
    _note("gather_object")
    gathered: list | None = [None] * world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


def new_group(ranks: list[int]):
    """A process group of `ranks`; every rank must create every group, in the same order."""
    return _dist().new_group(ranks)


def barrier() -> None:
    """Wait for every rank. Under NCCL the barrier names this rank's GPU: without device_ids NCCL guesses one."""
    if not active():
        return
    dist = _dist()
    _note("barrier")
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device().index])
    else:
        dist.barrier()


def teardown() -> None:
    """Barrier, then destroy the group: a rank that exits without both can abort the whole launch."""
    if active():
        barrier()
        _dist().destroy_process_group()
