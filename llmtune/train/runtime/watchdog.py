"""Hang triage on every rank: when no optimizer step has finished for `stall_timeout` seconds, the rank says where
it is, instead of waiting for NCCL's 30-minute timeout.

A thread watches the time since the last step ended. The threshold is the recipe's `stall_timeout`, else 5 times
the median step and at least 5 minutes (twice that before the first step ends: it compiles, fills buffers). Past
it, the rank writes <output_dir>/llmtune/hang/rank<N>.json (its Python stacks, the phase its main thread is in,
the last collectives llmtune issued) and prints one line that the launcher collates: the rank that is behind is
named with its stack, the others with what they wait in, and the launcher ends the job (launch/hangs.py).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

from transformers import TrainerCallback

MARK = "[llmtune] stall: "  # the line's prefix; the launcher reads the JSON after it
FLOOR = 300.0
# (phase, words that identify it in a frame's file or function): the first that matches, deepest frame first
PHASES = [
    (
        "a collective",
        (
            "all_reduce",
            "all_gather",
            "broadcast",
            "reduce_scatter",
            "barrier",
            "all_to_all",
            "gather_object",
            "wait_for_everyone",
        ),
    ),  # fmt: skip
    ("data loading", ("torch/utils/data", "collate", "__getitem__", "_next_data", "fetch")),
    ("checkpoint save", ("_save_checkpoint", "save_model", "checkpoint/")),
    ("backward (gradient all-reduce under DDP/FSDP/ZeRO)", ("autograd", "backward")),
    ("the optimizer step", ("optimizer", "optim/")),
    ("forward", ("forward",)),
]


def phase_of(frames: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(what the thread is doing, where: file:line of the frame that says so) from its stack, innermost first."""
    for name, words in PHASES:
        for frame in reversed(frames):
            text = f"{frame.filename} {frame.name}"
            if any(word in text for word in words):
                return name, f"{frame.filename}:{frame.lineno} in {frame.name}"
    last = frames[-1] if frames else None
    return "elsewhere", f"{last.filename}:{last.lineno} in {last.name}" if last else "?"


def threshold(configured: float | None, step_seconds: list[float]) -> float:
    if configured:
        return float(configured)
    if not step_seconds:
        return 2 * FLOOR
    return max(FLOOR, 5 * statistics.median(step_seconds))


class StallWatchdog(TrainerCallback):
    def __init__(self, output_dir: Path, rank: int, configured: float | None) -> None:
        self.folder = Path(output_dir) / "llmtune" / "hang"
        self.rank, self.configured = rank, configured
        self.step_seconds: list[float] = []
        self.last_end = time.monotonic()
        self.step = 0
        self.reported = False
        self.main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = time.monotonic()
        self.step = state.global_step
        self._thread = threading.Thread(target=self._watch, name="llmtune-stall-watchdog", daemon=True)
        self._thread.start()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.monotonic()
        self.step_seconds.append(now - self.last_end)
        self.last_end, self.step = now, state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            limit = threshold(self.configured, self.step_seconds[1:] or self.step_seconds)
            waited = time.monotonic() - self.last_end
            if waited > limit and not self.reported:
                self.reported = True
                self.report(waited, limit)
            self._stop.wait(min(max(limit / 8, 0.25), 5.0))

    def report(self, waited: float, limit: float) -> dict:
        from llmtune.train.runtime import collectives

        frames = sys._current_frames()
        main = traceback.extract_stack(frames[self.main]) if self.main in frames else []
        phase, where = phase_of(main)
        found = {
            "rank": self.rank, "host": os.environ.get("LLMTUNE_MACHINE_ADDRESS") or socket.gethostname(),
            "step": self.step + 1, "seconds": round(waited, 1), "threshold": round(limit, 1), "phase": phase,
            "where": where, "last_collectives": collectives.recent(),
            "stack": traceback.format_list(main),
            "threads": {str(ident): traceback.format_stack(frame)[-6:] for ident, frame in frames.items()
                        if ident not in (self.main, threading.get_ident())},
        }  # fmt: skip
        path = self.folder / f"rank{self.rank}.json"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(found, indent=1))
        except OSError:
            path = None
        line = {k: found[k] for k in ("rank", "host", "step", "seconds", "threshold", "phase", "where")}
        line["file"] = str(path) if path else None
        line["stack_tail"] = [part.strip() for entry in found["stack"][-4:] for part in entry.strip().splitlines()]
        print(MARK + json.dumps(line), file=sys.stderr, flush=True)
        return found
