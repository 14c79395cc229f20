"""`llmtune train --profile` (or the recipe's profiler_steps): torch's profiler over a few steps after the warm-up,
a Chrome trace per rank under <output_dir>/llmtune/profile/, and the share of those steps the GPU sat idle.

Idle is measured from the trace itself: the union of the CUDA kernels' and copies' intervals against the span from
the first profiled step's start to the last one's end. An idle GPU between kernels is what host syncs, launches
and data loading cost; the trace shows where. On the CPU rehearsal only the host is traced and no idle fraction is
given (there is no GPU to be idle).
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from llmtune.recipe.training import PROFILE_START as DEFAULT_START
from llmtune.recipe.training import PROFILE_STEPS as DEFAULT_STEPS


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of [start, end] covered by the union of `intervals` (microseconds)."""
    covered, reach = 0.0, start
    for first, last in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if last <= reach:
            continue
        covered += last - max(first, reach)
        reach = last
    return covered / (end - start) if end > start else 0.0


class ProfileSteps(TrainerCallback):
    """Profiles optimizer steps start+1 .. start+steps of this rank; `report` holds what it measured."""

    def __init__(self, folder: Path, rank: int, steps: int = DEFAULT_STEPS, start: int = DEFAULT_START) -> None:
        self.folder, self.rank, self.steps, self.start = Path(folder), rank, steps, start
        self.profiler = None
        self.report: dict | None = None
        self._window: tuple[float, float] = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.profiler is None and self.report is None and state.global_step == self.start:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler = profile(activities=activities, record_shapes=False, with_stack=False)
            self.profiler.__enter__()
            self._first_step = state.global_step + 1
            self._clock = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None or state.global_step < self.start + self.steps:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._clock
        self.profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.json"
        self.profiler.export_chrome_trace(str(trace))
        self.report = {"steps": [self._first_step, state.global_step], "seconds": round(seconds, 4),
                       "trace": str(trace), **self._gpu_idle()}  # fmt: skip
        self.profiler = None

    def _gpu_idle(self) -> dict:
        from torch.autograd import DeviceType

        events = self.profiler.events()
        device = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        if not device:
            return {"gpu_busy": None, "gpu_idle": None}
        host = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CPU]
        start = min(a for a, _ in host + device)
        end = max(b for _, b in host + device)
        busy = busy_fraction(device, start, end)
        return {"gpu_busy": round(busy, 4), "gpu_idle": round(1 - busy, 4)}

    def line(self) -> str:
        """The run's one line about the profile (rank 0's)."""
        r = self.report
        if r is None:
            return "profile: the run ended before the profiled steps (fewer than profiler_steps_start + profiler_steps)"
        first, last = r["steps"]
        idle = (f"GPU idle {r['gpu_idle']:.1%} of the time (busy {r['gpu_busy']:.1%})" if r["gpu_idle"] is not None
                else "no GPU here, so no idle fraction (the trace shows the host)")  # fmt: skip
        return f"profile: steps {first}-{last} took {r['seconds']:.2f} s; {idle}; trace {r['trace']}"
