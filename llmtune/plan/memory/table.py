"""The estimate as `llmtune estimate`, `llmtune config` and the rehearsal show it: the table, its notes, and the
sizes people type (80GB, 24GiB)."""

from __future__ import annotations

from llmtune.plan.memory.buffers import FIT_FRACTION, GB


def parse_size_option(flag: str, text: str) -> float:
    from llmtune.errors import UserError

    try:
        size = parse_size(text)
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a size", "write e.g. 80GB or 24GiB") from None
    if not size > 0:
        raise UserError(f"{flag} {text!r} is not above zero", "write e.g. 80GB or 24GiB")
    return size


def parse_size(text: str) -> float:
    """'80GB', '24 GiB', '512MB', '100KB' -> bytes (a bare number is GB)."""
    units = {"gib": 2**30, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12, "kib": 2**10, "kb": 1e3}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if cleaned.endswith(unit):
            return float(cleaned[: -len(unit)]) * scale
    return float(cleaned) * 1e9


ESTIMATE_NOTES = (
    "peak: what torch.cuda.max_memory_allocated should show, the larger of the start of backward (params, optim, "
    "gradients held from earlier micro-batches, buffers, activ, logits) and the optimizer step (params, grads, "
    "optim, buffers); total = peak + reserve + context",
    "buffers: the layer ZeRO-3/FSDP gather, DeepSpeed's fp32 gradient copy and reduce buckets, DDP's gradient "
    "buckets, the optimizer's scratch at the step; activ: saved for backward, with autocast's 16-bit weight copies; "
    "logits: three fp32 tokens x vocab tensors at the loss",
    "reserve: what PyTorch's caching allocator keeps but can't use at the peak (idle blocks, fragmentation); "
    "context: the CUDA context, outside the allocator",
)

REFERENCE_NOTE = ("ref: the frozen reference model (no gradients, no optimizer states), allocated through the whole "
                  "step; counted in peak at every phase")  # fmt: skip


def _count(n: int) -> str:
    """A parameter count at a readable scale: 8.03B, 41.9M, 147.8K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.{2 if suffix == 'B' else 1}f}{suffix}"
    return str(n)


def basis_notes(rows) -> list[str]:
    """Which rows a recorded GPU run checks, and one line per reason the others are only modelled."""
    measured = [row for row in rows if not row.basis_reason]
    lines = [f"{measured[0].basis} ({', '.join(row.name for row in measured)}): recorded GPU runs of this "
             "method and strategy, on other models, checked the arithmetic of these rows (docs/estimate.md)"] if measured else []  # fmt: skip
    reasons: dict[str, list[str]] = {}
    for row in rows:
        if row.basis_reason:
            reasons.setdefault(row.basis_reason, []).append(row.name)
    every = len(reasons) == 1 and not measured
    return lines + [f"modelled ({'every row' if every else ', '.join(names)}): {reason}"
                    for reason, names in reasons.items()]  # fmt: skip


def estimate_cells(row, reference: bool = False) -> list[str]:
    """One row of the estimate table, in GB: the ZeRO paper's terms (and a preference recipe's reference model),
    then what the GPU adds."""
    terms = [row.params, row.grads, row.optimizer, *([row.reference] if reference else []), row.buffers,
             row.activations + row.weight_copies, row.logits]  # fmt: skip
    cells = [f"{term / GB:.1f}" for term in terms]
    cells.append(f"{row.allocated / GB:.1f} ({row.peak_at})")
    return cells + [f"{term / GB:.1f}" for term in (row.reserve, row.overhead, row.total)]


def reference_notes(report) -> list[str]:
    """For a preference recipe: what each step runs, and one line per way the rows hold the reference model."""
    if not report.preference:
        return []
    held: dict[str, list[str]] = {}
    for row in report.rows:
        held.setdefault(row.reference_where, []).append(row.name)
    every = len(held) == 1
    return [f"preference: {report.preference}; activ and logits count them"] + [
        f"reference model ({'every row' if every else ', '.join(names)}): {where}" for where, names in held.items()
    ]


def print_estimate(report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.model}: {_count(report.total_params)} parameters "
                        f"({_count(report.trainable_params)} trainable), {report.num_machines} x "
                        f"{report.gpus_per_machine} GPUs of {report.gpu_memory / GB:.0f} GB")  # fmt: skip
    reference = bool(report.preference)  # a preference recipe: a column for its reference model, 0 where it has none
    columns = ("strategy (GB per GPU)", "params", "grads", "optim", *(["ref"] if reference else []), "buffers",
               "activ", "logits", "peak (at)", "reserve", "context", "total", "fits", "CPU/machine", "basis")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column.startswith(("strategy", "basis")) else "right")
    for row in report.rows:
        cpu = f"{row.cpu / GB:.1f}" + (" + NVMe" if row.nvme else "") if row.cpu or row.nvme else ""
        table.add_row(row.strategy, *estimate_cells(row, reference), "yes" if report.fits(row) else "no", cpu,
                      row.basis)  # fmt: skip
    console = Console(width=None if Console().is_terminal else 160)
    console.print(table)
    for note in [*ESTIMATE_NOTES, *([REFERENCE_NOTE] if reference else []), *reference_notes(report)]:
        console.print(note, highlight=False)
    if report.assumes:
        console.print(report.assumes, highlight=False)
    for line in basis_notes(report.rows):
        console.print(line, highlight=False)
    console.print(f"fits: total under {FIT_FRACTION:.0%} of the GPU's {report.gpu_memory / GB:.0f} GB "
                  f"({FIT_FRACTION * report.gpu_memory / GB:.1f} GB)", highlight=False)  # fmt: skip
    if report.choice is None:
        console.print(f"[red]nothing fits[/]: {report.remedy}")
    else:
        console.print(f"[bold]recommended:[/] {report.choice[0].strategy} ({report.choice[1]})")
