"""The launcher's side of hang triage (the ranks' side: llmtune/train/runtime/watchdog.py).

Each stalled rank prints one line, `[llmtune] stall: {json}`. The launcher collects them for a short window after
the first (the ranks stopped together and time out together), names the rank that is behind (in data loading,
compute or a save while the others wait in a collective or the gradient all-reduce), prints one summary, writes it
to <output_dir>/llmtune/hang/report.txt and ends the job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

MARK = "[llmtune] stall: "  # as llmtune/train/runtime/watchdog.py prints it (torch-free here)
WAITING = ("a collective", "backward (gradient all-reduce under DDP/FSDP/ZeRO)")
EXIT_STALLED = 3


def parse(line: str) -> dict | None:
    at = line.find(MARK)
    if at < 0:
        return None
    try:
        found = json.loads(line[at + len(MARK) :])
    except ValueError:
        return None
    return found if isinstance(found, dict) and "rank" in found else None


class Stalls:
    """Stall reports as they arrive; `due` once the window after the first has passed (or every rank reported)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.reports: dict[int, dict] = {}
        self.first: float | None = None

    def add(self, found: dict) -> None:
        self.reports.setdefault(int(found["rank"]), found)
        self.first = self.first or time.monotonic()

    def due(self) -> bool:
        if self.first is None:
            return False
        window = min(15.0, max(2.0, min(r["threshold"] for r in self.reports.values()) / 4))
        return len(self.reports) >= self.ranks or time.monotonic() - self.first > window


def summary(reports: dict[int, dict]) -> list[str]:
    """The statement: who is behind and where, who waits in what; then the behind rank's stack tail."""
    ordered = [reports[r] for r in sorted(reports)]
    seconds = max(r["seconds"] for r in ordered)
    limit = min(r["threshold"] for r in ordered)
    behind = [r for r in ordered if r["phase"] not in WAITING]
    waiting = [r for r in ordered if r["phase"] in WAITING]

    def who(r: dict) -> str:
        return f"rank {r['rank']} ({r['host']})"

    parts = [f"{who(r)} has been in {r['phase']} for {r['seconds']:.0f} s (step {r['step']}, {r['where']})"
             for r in behind]  # fmt: skip
    by_phase: dict[tuple[str, str], list[int]] = {}
    for r in waiting:
        by_phase.setdefault((r["phase"], r["where"]), []).append(r["rank"])
    parts += [(f"ranks {', '.join(map(str, ranks))} wait" if len(ranks) > 1 else f"rank {ranks[0]} waits")
              + f" in {phase} ({where})" for (phase, where), ranks in by_phase.items()]  # fmt: skip
    if not behind:
        parts.append("no rank is elsewhere: a rank that reported nothing may have died, or a link is down")
    lines = [f"error: the run stalled: no step finished for {seconds:.0f} s (stall_timeout {limit:.0f} s): "
             + "; ".join(parts) + "; the job was stopped"]  # fmt: skip
    for r in behind:
        lines.append(f"{who(r)}'s stack, innermost last:")
        lines += [f"    {entry}" for entry in r.get("stack_tail") or []]
    files = [r["file"] for r in ordered if r.get("file")]
    if files:
        lines.append(f"every rank's stacks: {Path(files[0]).parent}/")
    lines.append("fix what holds the rank that is behind (its stack says where), then run the same command again "
                 "to resume from the last complete checkpoint")  # fmt: skip
    return lines


def write_report(config_dir: str, lines: list[str]) -> Path | None:
    path = Path(config_dir) / "hang" / "report.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    except OSError:
        return None
    return path
