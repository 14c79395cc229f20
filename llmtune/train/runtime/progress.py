"""Rank-0 console output for the worker: progress for long steps, and plain log lines."""

from __future__ import annotations

import os
import re
import sys


def is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log(message: str) -> None:
    if is_main_rank():
        print(f"[llmtune] {message}", file=sys.stderr, flush=True)


def track(items, description: str, total: int | None = None):
    """Iterate with a progress bar on rank 0 (the total is often unknown: rows stream from files)."""
    if not is_main_rank() or not sys.stderr.isatty():
        yield from items
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)


# One training step's progress, as rank 0 prints it at each logging step. The launcher parses the same line back
# (parse_step) to drive its live bar on a terminal; in logs and pipes it reads as it is.
_STEP = re.compile(
    r"^\[llmtune\] step (?P<step>\d+)/(?P<total>\d+)  loss (?P<loss>\S+)  lr (?P<lr>\S+)"
    r"(?:  grad_norm (?P<grad_norm>\S+))?(?:  tok/s (?P<tokens_per_second>[\d,.]+))?(?:  eta (?P<eta>\S+))?$"
)


def step_line(step: int, total: int, loss: float, lr: float, grad_norm: float | None = None,
              tokens_per_second: float | None = None, eta_seconds: float | None = None) -> str:  # fmt: skip
    line = f"[llmtune] step {step}/{total}  loss {loss:.4f}  lr {lr:.3e}"
    if grad_norm is not None:
        line += f"  grad_norm {grad_norm:.3f}"
    if tokens_per_second is not None:
        line += f"  tok/s {tokens_per_second:,.0f}"
    if eta_seconds is not None:
        minutes, seconds = divmod(int(round(eta_seconds)), 60)
        line += f"  eta {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    return line


def parse_step(line: str) -> dict | None:
    """The numbers of a step_line (None for any other line)."""
    match = _STEP.match(line.rstrip())
    if not match:
        return None
    found = match.groupdict()
    numbers = {"step": int(found["step"]), "total": int(found["total"]), "loss": float(found["loss"]),
               "lr": float(found["lr"]), "eta": found["eta"]}  # fmt: skip
    numbers["grad_norm"] = float(found["grad_norm"]) if found["grad_norm"] else None
    numbers["tokens_per_second"] = (
        float(found["tokens_per_second"].replace(",", "")) if found["tokens_per_second"] else None
    )
    return numbers


# The moments from `llmtune train` to the first optimizer step. The launcher's marks reach the ranks through the
# environment; each rank adds its own, and metrics.json keeps the seconds between consecutive marks.
TIMELINE_ENV = "LLMTUNE_TIMELINE"
_marks: dict[str, float] = {}


def mark(name: str, at: float | None = None) -> None:
    """Note the wall-clock moment a start-up phase ended."""
    import time

    _marks[name] = time.time() if at is None else at


def launcher_marks() -> str:
    """This process's marks, for the ranks' environment."""
    return ",".join(f"{name}={at:.6f}" for name, at in _marks.items())


def startup_seconds() -> dict[str, float]:
    """Seconds each phase took, in order: the launcher's (from the environment) then this rank's."""
    marks = []
    for item in filter(None, os.environ.get(TIMELINE_ENV, "").split(",")):
        name, _, at = item.partition("=")
        marks.append((name, float(at)))
    marks += sorted(_marks.items(), key=lambda item: item[1])
    return {name: round(at - marks[i][1], 3) for i, (name, at) in enumerate(marks[1:])}


def library_bars_off() -> None:
    """transformers' own bars (loading and writing weights) are off: llmtune reports those phases itself. Hub
    downloads keep theirs, unless the user turned them off (HF_HUB_DISABLE_PROGRESS_BARS)."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as transformers_logging

    downloads = not hub.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # turns the hub's off too
    if downloads:
        hub.enable_progress_bars()
