"""Rehearsal wall time (issue 20's budget: at most 3 minutes a recipe on 2 cores, offline).

Rehearses shipped recipes at the world size their header names, with the same stand-in data and tokenizer as
tests/integration/test_rehearse.py (nothing downloaded), and prints each one's wall time beside the budget and
the phases the report timed. Appends to benchmarks/results.json.

    python benchmarks/rehearse.py                       # zero3-offload (8 processes) and qlora-fsdp-70b (8)
    python benchmarks/rehearse.py recipes/fsdp2.yaml    # any recipe
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, record

sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
BUDGET_S = 180.0
DEFAULT = ["recipes/zero3-offload.yaml", "recipes/qlora-fsdp-70b.yaml"]


def main() -> None:
    from test_rehearse import offline_inputs, rehearse, world_flags

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = {}
    for name in sys.argv[1:] or DEFAULT:
        path = ROOT / name
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            recipe, stand_ins = offline_inputs(path, folder)
            flags = world_flags(path)
            started = time.monotonic()
            result = rehearse(recipe, *flags, *stand_ins, "--output", folder / "out", env={"HF_HUB_OFFLINE": "1"})
            wall = time.monotonic() - started
            if result.returncode:
                sys.exit(f"{name}: rehearsal failed: {result.stderr.strip().splitlines()[-1]}")
            phases = json.loads((folder / "out" / "rehearsal.json").read_text()).get("timings_s", {})
        verdict = "within" if wall <= BUDGET_S else "OVER"
        print(f"{path.stem:16} {' '.join(flags) or '1 process':34} {wall:6.0f} s  {verdict} the {BUDGET_S:.0f} s budget"
              f"  phases {phases}")  # fmt: skip
        rows[path.stem] = {"flags": flags, "wall_s": round(wall, 1), "phases_s": phases, "cpus": os.cpu_count()}
    record("rehearse", rows)


if __name__ == "__main__":
    main()
