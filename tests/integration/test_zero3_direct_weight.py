"""Liger's fused linear cross-entropy (and cut_cross_entropy, which runs as it) reads lm_head.weight without calling
lm_head. Under DeepSpeed ZeRO-3 that weight is partitioned between forwards; llmtune runs the kernel there because
DeepSpeed gathers a partitioned parameter when it is read. This checks that on 2 CPU ranks, with DeepSpeed's own
engine (the Triton kernel itself needs a GPU: tests/gpu): the weight is half on each rank outside the forward,
whole where the forward reads it, and the losses and lm_head's gradients equal those of calling the module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("zero3_direct_weight_run.py")


def test_zero3_gathers_a_weight_read_directly_with_the_module_s_gradients():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deepspeed_shm_comm" not in result.stdout + result.stderr  # formed as the rehearsal forms it
    [line] = [x for x in result.stdout.splitlines() if x.startswith("{")]
    report = json.loads(line)
    module, direct = report["module"], report["direct"]
    assert direct["partition"] == direct["full"] // 2  # partitioned between forwards
    assert direct["seen_in_forward"] == [direct["full"]]  # gathered where the forward reads it
    assert direct["losses"] == pytest.approx(module["losses"], abs=1e-6)
    assert direct["lm_head_grad_norms"] == pytest.approx(module["lm_head_grad_norms"], rel=1e-5)
    assert module["losses"][0] != module["losses"][-1]  # the steps trained
