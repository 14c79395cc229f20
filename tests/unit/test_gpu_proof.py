"""scripts/gpu_proof.py (`make gpu-proof`) on CPU: the dry run, the no-GPU refusal, the resumable loop with a fake part
runner and a fake clock (state honoured, budget respected), the outcome readers and the RESULTS.md section."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_proof  # noqa: E402
from gpu_proof import Part  # noqa: E402

OLD_RESULTS = "# GPU tier results\n\nNewest first.\n\n## 2026-11-23: three runs\n\nold text\n"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Each part 'takes' its estimate on the fake clock (or `takes[name]`), and reports what `outcomes` says."""

    def __init__(self, clock, outcomes=None, takes=None):
        self.clock, self.outcomes, self.takes, self.ran = clock, outcomes or {}, takes or {}, []

    def __call__(self, part, deadline):
        self.ran.append(part.name)
        self.clock.now += self.takes.get(part.name, part.estimate)
        outcome = self.outcomes.get(part.name) or {"status": "done", "outcome": "passed"}
        if part.kind == "report":
            outcome = {"status": "done", "outcome": "complete", "report": "## Fake GPU: peak\n### 1b full\n| a |"}
        if part.kind == "memory":
            outcome = {"status": "done", "outcome": "measured", "row": MEMORY_ROW}
        return {"seconds": self.takes.get(part.name, part.estimate), **outcome}


MEMORY_ROW = {"estimate_allocated_bytes": 38e9, "measured_allocated_bytes": 38.1e9, "estimate_bytes": 41e9,
              "measured_reserved_bytes": 39.1e9, "rank_context_bytes": 0.9e9}  # fmt: skip


def parts(*specs) -> list[Part]:
    return [Part(name, kind, ["true"], estimate, parallel=kind == "tests") for name, kind, estimate in specs]


def fresh_state() -> dict:
    return gpu_proof.load_state(Path("/nonexistent/state.json"))


def test_the_loop_stops_before_a_part_that_would_not_fit_and_resumes():
    clock, state = Clock(), fresh_state()
    work = parts(("test a", "tests", 100), ("test b", "tests", 100), ("bench x", "bench", 300), ("test c", "tests", 50))
    runner = FakeRunner(clock)
    left = gpu_proof.run_parts(work, state, runner, budget=250, clock=clock)
    assert runner.ran == ["test a", "test b"]  # 50 s left < 300: bench x waits for the next call (test c too: order)
    assert [p.name for p in left] == ["bench x", "test c"]
    assert clock.now - 1000 <= 250
    runner.ran.clear()
    left = gpu_proof.run_parts(work, state, runner, budget=540, clock=clock)
    assert runner.ran == ["bench x", "test c"] and left == []
    runner.ran.clear()
    assert gpu_proof.run_parts(work, state, runner, budget=540, clock=clock) == [] and runner.ran == []


def test_a_part_longer_than_any_call_still_gets_a_whole_call():
    clock, state = Clock(), fresh_state()
    work = parts(("bench huge", "bench", 900), ("test a", "tests", 10))
    runner = FakeRunner(clock, takes={"bench huge": 500})
    gpu_proof.run_parts(work, state, runner, budget=540, clock=clock)
    assert runner.ran == ["bench huge", "test a"]
    state2, runner2 = fresh_state(), FakeRunner(Clock())
    gpu_proof.run_parts(parts(("test a", "tests", 10), ("bench huge", "bench", 900)), state2, runner2, 540,
                        clock=runner2.clock)  # fmt: skip
    assert runner2.ran == ["test a"]  # not first in this call: it waits for a call of its own


def test_a_bench_that_stops_for_time_ends_the_call_and_stays_pending():
    clock, state = Clock(), fresh_state()
    work = parts(("bench 1b full", "bench", 60), ("test z", "tests", 10))
    stopped = {"status": "pending", "outcome": "stopped for time (resumes)", "stop": True}
    runner = FakeRunner(clock, outcomes={"bench 1b full": stopped})
    left = gpu_proof.run_parts(work, state, runner, budget=540, clock=clock)
    assert runner.ran == ["bench 1b full"] and [p.name for p in left] == ["bench 1b full", "test z"]
    assert state["parts"]["bench 1b full"]["outcome"] == "stopped for time (resumes)"
    assert "stop" not in state["parts"]["bench 1b full"]


def test_a_part_cut_off_three_times_is_recorded_as_too_long():
    clock, state = Clock(), fresh_state()
    work = parts(("test slow", "tests", 10))
    cut = {"status": "pending", "outcome": "cut off at the deadline", "cut_off": True, "stop": True}
    runner = FakeRunner(clock, outcomes={"test slow": cut})
    for attempt in range(1, 4):
        left = gpu_proof.run_parts(work, state, runner, budget=540, clock=clock)
        assert state["parts"]["test slow"]["attempts"] == attempt
    assert left == [] and state["parts"]["test slow"]["outcome"].startswith("cut off 3 times")


def test_figures_count_on_their_own_device_and_test_outcomes_anywhere():
    state = fresh_state()
    work = parts(("test a", "tests", 10), ("memory m", "memory", 10))
    runner = FakeRunner(Clock())
    gpu_proof.run_parts(work, state, runner, 540, clock=runner.clock, device="NVIDIA H100 80GB HBM3")
    runner.ran.clear()
    left = gpu_proof.run_parts(work, state, runner, 540, clock=runner.clock, device="NVIDIA H200")
    assert runner.ran == ["memory m"] and left == []


def test_gpu_tests_share_the_gpu_up_to_jobs_and_the_benchmark_runs_alone():
    lock, running, peak, order = threading.Lock(), [0], [0], []

    def runner(part, deadline):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            order.append((part.name, running[0]))
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return {"status": "done", "outcome": "passed"}

    work = parts(*[(f"test {i}", "tests", 1) for i in range(5)], ("bench b", "bench", 1), ("test 9", "tests", 1))
    gpu_proof.run_parts(work, fresh_state(), runner, budget=540, jobs=3)
    assert peak[0] == 3
    assert ("bench b", 1) in order  # alone on the GPU


def test_dry_run_lists_the_parts_in_order_and_writes_nothing(tmp_path, capsys):
    assert gpu_proof.main(["--dry-run", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    names = [line.split(":")[0].strip() for line in out.splitlines()[1:]]
    assert names[0] == "GPU tests" and "tests/gpu/test_gpu.py" in out
    assert names[1:6] == ["bench 1b full", "bench 1b lora", "bench 1b qlora", "bench 8b lora", "bench report"]
    assert names[6].startswith("memory 1b full single") and names[-1].startswith("memory 8b qlora")
    assert not list(tmp_path.iterdir())


def test_without_a_gpu_it_says_so_runs_nothing_writes_nothing_and_exits_2(tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text(OLD_RESULTS)
    argv = ["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out"), "--results-md", str(results_md)]
    assert gpu_proof.main(argv, runner=lambda *a: pytest.fail("ran a part"), gpu=lambda: None) == 2
    out = capsys.readouterr().out
    assert out.startswith("gpu_proof: no GPU present") and "bench 1b full" in out and "memory 8b qlora" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS.md"] and results_md.read_text() == OLD_RESULTS
    import torch

    if not torch.cuda.is_available():  # the real check, on this machine
        assert gpu_proof.main(argv) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS.md"]


def test_main_resumes_across_calls_and_writes_the_section_once(tmp_path, capsys):
    results_md, out = tmp_path / "RESULTS.md", tmp_path / "out"
    results_md.write_text(OLD_RESULTS)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    ids = ["tests/gpu/test_gpu.py::test_one", "tests/gpu/test_varlen_gpu.py::test_two"]
    (state_dir / "state.json").write_text(json.dumps({**fresh_state(), "test_ids": ids}))  # already collected
    argv = ["--state-dir", str(state_dir), "--out", str(out), "--results-md", str(results_md), "--commit", "abc1234",
            "--budget", "540", "--memory-work", str(tmp_path / "memory"), "--jobs", "1"]  # fmt: skip
    clock = Clock()
    runner = FakeRunner(clock)
    assert gpu_proof.main(argv, runner=runner, gpu=lambda: "NVIDIA H100 80GB HBM3", clock=clock) == 0
    first = capsys.readouterr().out
    assert "part(s) left" in first and results_md.read_text() == OLD_RESULTS
    assert runner.ran[:3] == ["test " + ids[0], "test " + ids[1], "bench 1b full"]
    assert json.loads((out / "gpu-proof" / "state.json").read_text())["parts"]  # copied out after every part
    calls = 1
    while "part(s) left" in capsys.readouterr().out or calls == 1:
        done_before = len(runner.ran)
        assert gpu_proof.main(argv, runner=runner, gpu=lambda: "NVIDIA H100 80GB HBM3", clock=clock) == 0
        assert len(runner.ran) > done_before  # every call makes progress
        calls += 1
        assert calls < 20
    assert len(runner.ran) == len(set(runner.ran)) == 2 + 5 + len(gpu_proof.MEMORY_ROWS)  # each part once
    text = results_md.read_text()
    assert text.startswith("# GPU tier results\n\nNewest first.\n\n## ")
    assert text.index("make gpu-proof on NVIDIA H100 80GB HBM3 (commit abc1234)") < text.index("## 2026-11-23")
    assert (out / "RESULTS.md").read_text() == text
    assert gpu_proof.main(argv, runner=runner, gpu=lambda: "NVIDIA H100 80GB HBM3", clock=clock) == 0
    assert "every part is done" in capsys.readouterr().out and results_md.read_text() == text


def test_the_section_names_date_gpu_commit_stack_and_every_outcome():
    state = fresh_state()
    state["calls"] = [{"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "jobs": 3,
                       "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "transformers": "5.17.0",
                                    "liger_kernel": "0.8.5"}}]  # fmt: skip
    work = [*gpu_proof.test_parts(["tests/gpu/test_gpu.py::test_a", "tests/gpu/test_gpu.py::test_b"], Path("/l")),
            Part("bench 1b full", "bench", [], 10), Part("bench report", "report", [], 10),
            gpu_proof.memory_parts(Path("/m"))[0]]  # fmt: skip
    state["parts"] = {
        "test tests/gpu/test_gpu.py::test_a": {"status": "done", "outcome": "passed", "test_seconds": 23.9},
        "test tests/gpu/test_gpu.py::test_b": {"status": "done", "outcome": "failed", "seconds": 12.0,
                                               "detail": "AssertionError: 0.013 off"},
        "bench 1b full": {"status": "done", "outcome": "complete"},
        "bench report": {"status": "done", "report": "## NVIDIA H100: peak\n\n### 1b full: batch 8\n\n| arm |"},
        work[-1].name: {"status": "done", "outcome": "measured", "row": MEMORY_ROW},
    }  # fmt: skip
    text = gpu_proof.section(state, work, "2026-11-27")
    lines = text.splitlines()
    assert lines[0] == "## 2026-11-27: make gpu-proof on NVIDIA H100 80GB HBM3 (commit abc1234)"
    assert lines[2].startswith("Stack: torch 2.11.0+cu130 (CUDA 13.0), transformers 5.17.0, accelerate not installed")
    assert "liger_kernel 0.8.5" in lines[2] and "flash_attn not installed" in lines[2]
    assert "| test_gpu.py::test_a | **passed** | 23.9 |  |" in lines
    assert "| test_gpu.py::test_b | failed | 12.0 | AssertionError: 0.013 off |" in lines
    assert "Totals: 1 failed, 1 passed." in lines
    assert (
        "- bench 1b full: complete" in lines and "#### NVIDIA H100: peak" in lines and "#### 1b full: batch 8" in lines
    )
    assert not any(line.startswith(("## NVIDIA", "### 1b")) for line in lines)  # demoted under this section
    row = next(line for line in lines if line.startswith("| 1b full single"))
    assert (
        row == "| 1b full single checkpointing-off packed | 38.00 | 38.10 | 0.997 | 41.00 | 40.00 | 1.025 | 0.90 |  |"
    )
    new = gpu_proof.insert_section(OLD_RESULTS, text)
    assert new.startswith("# GPU tier results\n\nNewest first.\n\n## 2026-11-27") and new.endswith(
        "\n\n## 2026-11-23: three runs\n\nold text\n"
    )


def test_reading_a_test_part(tmp_path):
    part = gpu_proof.test_parts(["tests/gpu/test_gpu.py::test_a[x]"], tmp_path)[0]
    run_file = Path(part.env["LLMTUNE_GPU_RUN_FILE"])
    assert run_file.parent == tmp_path and part.parallel and part.estimate > gpu_proof.PYTEST_START
    run_file.write_text(
        "# GPU tier run\n\n| test | outcome | seconds |\n| --- | --- | --- |\n| test_a[x] | passed | 31.2 |\n"
    )
    assert gpu_proof.read_test(part, 0, "") == {"status": "done", "outcome": "passed", "test_seconds": 31.2,
                                                "detail": ""}  # fmt: skip
    run_file.unlink()  # no run file (no CUDA in that process): pytest's summary decides
    failed = "FAILED tests/gpu/test_gpu.py::test_a[x] - AssertionError: loss fell 0.45\n===== 1 failed in 3.2s ====="
    assert gpu_proof.read_test(part, 1, failed)["outcome"] == "failed"
    assert gpu_proof.read_test(part, 1, failed)["detail"] == "AssertionError: loss fell 0.45"
    skipped = "SKIPPED [1] tests/gpu/test_kernels_gpu.py:40: flash-attn not installed\n===== 1 skipped in 2.0s ====="
    assert gpu_proof.read_test(part, 0, skipped) == {"status": "done", "outcome": "skipped", "test_seconds": None,
                                                     "detail": "flash-attn not installed"}  # fmt: skip
    assert gpu_proof.read_test(part, 5, "")["outcome"] == "not collected"


def test_reading_bench_outcomes():
    assert gpu_proof.read_bench(None, 3, "")["status"] == "pending"
    assert gpu_proof.read_bench(None, 0, "") == {"status": "done", "outcome": "complete"}
    assert gpu_proof.read_bench(None, 1, "x\nRuntimeError: boom\n")["outcome"] == "failed (exit 1): RuntimeError: boom"
    assert gpu_proof.read_report(None, 0, "noise\n## GPU: peak\n| a |\n")["report"] == "## GPU: peak\n| a |"


def test_missing_pieces_are_named_one_line_each(tmp_path):
    found = {name: "1.0" for name in gpu_proof.LIBRARIES}
    assert gpu_proof.missing_lines(found, tokenizer=tmp_path) == []
    found.update(liger_kernel=None, bitsandbytes=None, trl=None, flash_attn=None)
    lines = gpu_proof.missing_lines(found, tokenizer=tmp_path / "absent")
    assert len(lines) == 3 and all(line.startswith("missing: ") for line in lines)
    assert any("liger-kernel" in line and "fetch-wheels.sh liger-kernel" in line for line in lines)
    assert any("bitsandbytes" in line for line in lines) and any(".gpu/tok" in line for line in lines)


def test_the_parts_plan_follows_the_benchmark_and_the_calibration_matrix():
    work = gpu_proof.plan(["t::a"], ["tests", "bench", "memory"], Path("/l"), Path("/r"), Path("/w"))
    kinds = [p.kind for p in work]
    assert kinds == ["tests"] + ["bench"] * 4 + ["report"] + ["memory"] * len(gpu_proof.MEMORY_ROWS)
    bench_1b = work[1]
    assert bench_1b.argv[-2:] == ["--deadline", "{deadline}"] and "--no-record" in bench_1b.argv
    assert bench_1b.minimum < bench_1b.estimate  # it stops itself between runs, so it may start with less
    assert {"--report", "--record"} <= set(work[5].argv)
    fixture = json.loads((ROOT / "tests" / "fixtures" / "h100_memory.json").read_text())["rows"]
    measured = {tuple(r["configuration"][k] for k in ("shape", "method", "strategy", "checkpointing", "layout"))
                for r in fixture if r["allocator"].startswith("expandable")}  # fmt: skip
    assert set(gpu_proof.MEMORY_ROWS) == measured  # the matrix the estimate is held to, measured again
