"""Rank-0 console output for the worker: progress for long steps, and plain log lines."""

from __future__ import annotations

import os
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
