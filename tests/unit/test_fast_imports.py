"""The CLI answers fast because heavy libraries stay out of its import."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "deepspeed", "datasets", "accelerate", "peft")


def test_importing_the_cli_and_planning_leaves_heavy_libraries_out():
    code = (
        "import sys, llmtune.cli, llmtune.plan, llmtune.recipe;"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == ""
