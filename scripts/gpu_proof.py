"""`make gpu-proof`: the GPU test tier, the throughput benchmark and the memory calibration, in parts that resume.

    python3 scripts/gpu_proof.py [--budget 540] [--out DIR] [--only tests bench memory] [--jobs 3] [--commit SHA]
    python3 scripts/gpu_proof.py --dry-run        # the parts in order, with their estimates (anywhere)

Parts, in order: (a) `pytest tests/gpu -m gpu`, one part per test id (several at once, --jobs); (b)
benchmarks/gpu_throughput.py, one part per slice (1b full, 1b lora, 1b qlora, 8b lora; each resumes inside itself
arm by arm) and then its report; (c) benchmarks/gpu_memory.py, one part per configuration of the calibration matrix,
alone on the GPU. `.gpu-proof/state.json` records the finished parts. No part starts when the time left in
--budget is below its estimate: the script says what is left and exits 0, and the next call continues. When every
part is done it writes a dated section (GPU, commit, library versions, outcomes) into tests/gpu/RESULTS.md.

On the device machine only files under $OUT come back: --out (default $OUT) receives RESULTS.md, results.json, the
state, the logs and the benchmark JSONs after every part. To continue on a fresh machine, put that gpu-proof/ folder
back as .gpu-proof/ and carry it. Without a GPU it names the parts it would have run, writes nothing, and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_throughput as bench  # noqa: E402  (pure at import: its tables and the run order)

STATE_DIR = ROOT / ".gpu-proof"
RESULTS_MD = ROOT / "tests" / "gpu" / "RESULTS.md"
GRACE = 15  # seconds a part may run past the deadline before it is stopped
CUT_OFF_LIMIT = 3  # a part stopped at the deadline this often is recorded as not fitting in one call
# seconds per GPU test (first match of a substring of its id; measured on the H100 runs of 2026-11-23, 3 at a time)
TEST_SECONDS = [("activation_offload", 60), ("offload", 100), ("two_ranks", 55), ("kill_9", 90), ("merge_eval", 75),
                ("torch_compile", 120), ("default_run", 60), ("liger", 60), ("every_strategy", 40), ("one_gpu", 30),
                ("packed_rows", 10), ("varlen", 20), ("flash_attention", 10), ("pipeline", 10), ("cpu_tensor", 15)]  # fmt: skip
PYTEST_START = 8  # seconds pytest takes to start and collect one test
# The calibration matrix as the 2026-11-23 run measured it with expandable segments (tests/fixtures/h100_memory.json):
# shape, method, strategy, checkpointing, layout
MEMORY_ROWS = [("1b", "full", "single", "off", "packed"), ("1b", "full", "single", "off", "padded"),
               ("1b", "full", "single", "on", "packed"), ("1b", "full", "zero2", "off", "packed"),
               ("1b", "full", "zero3", "off", "packed"), ("1b", "full", "zero3_offload", "off", "packed"),
               ("1b", "full", "fsdp2", "off", "packed"), ("1b", "full", "fsdp2", "on", "padded"),
               ("1b", "lora", "single", "off", "packed"), ("1b", "lora", "single", "on", "padded"),
               ("1b", "qlora", "single", "on", "packed"), ("8b", "lora", "single", "on", "packed"),
               ("8b", "qlora", "single", "on", "packed"), ("8b", "qlora", "single", "on", "padded")]  # fmt: skip
LIBRARIES = ["torch", "transformers", "accelerate", "deepspeed", "peft", "trl", "flash_attn", "liger_kernel",
             "bitsandbytes", "datasets"]  # fmt: skip
# what a missing library costs the proof (None: optional, only noted among the versions)
NEEDED = {"deepspeed": "the ZeRO tests and memory rows fail", "peft": "LoRA/QLoRA tests and arms fail",
          "bitsandbytes": "QLoRA tests, arms and memory rows fail", "datasets": "llmtune and the plain arms can't load data",
          "liger_kernel": "the plain Liger arm is not run and the Liger GPU test fails", "trl": None, "flash_attn": None}  # fmt: skip
INSTALL = {"liger_kernel": "liger-kernel", "flash_attn": "flash-attn"}


@dataclass
class Part:
    name: str
    kind: str  # tests, bench, report, memory
    argv: list[str]
    estimate: float  # seconds the whole part takes
    minimum: float = 0.0  # seconds it needs to start usefully (a bench slice stops itself between runs)
    parallel: bool = False  # may run beside other parallel parts (the GPU tests)
    env: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.minimum = self.minimum or self.estimate


# ---- the parts ----------------------------------------------------------------------------------------------------


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_")[:120]


def test_seconds(test_id: str) -> float:
    return next((s for key, s in TEST_SECONDS if key in test_id), 60) + PYTEST_START


def test_parts(test_ids: list[str], logs: Path) -> list[Part]:
    """One part per test id; pytest's own file of outcomes per part (LLMTUNE_GPU_RUN_FILE)."""
    return [Part(f"test {tid}", "tests", [sys.executable, "-m", "pytest", tid, "-m", "gpu", "-v", "-p", "no:cacheprovider"],
                 test_seconds(tid), parallel=True, env={"LLMTUNE_GPU_RUN_FILE": str(logs / f"{slug(tid)}.md")})
            for tid in test_ids]  # fmt: skip


def bench_parts(results: Path) -> list[Part]:
    """One part per default slice (resumable inside: --deadline), then the report that records the table."""
    script = str(ROOT / "benchmarks" / "gpu_throughput.py")
    parts = []
    for size, method in bench.DEFAULT_SLICES:
        _, _, _, run, build = bench.SIZES[size]
        runs = len(bench.METHOD_ARMS[method]) * 3
        argv = [sys.executable, script, "--sizes", size, "--methods", method, "--results", str(results), "--no-record",
                "--deadline", "{deadline}"]  # fmt: skip
        parts.append(Part(f"bench {size} {method}", "bench", argv, runs * run + build, minimum=run + build))
    argv = [sys.executable, script, "--report", "--record", "--results", str(results), "--device", "{device}"]
    return [*parts, Part("bench report", "report", argv, 15)]


def memory_parts(work: Path) -> list[Part]:
    script = str(ROOT / "benchmarks" / "gpu_memory.py")
    parts = []
    for shape, method, strategy, checkpointing, layout in MEMORY_ROWS:
        argv = [sys.executable, script, "--shape", shape, "--method", method, "--strategy", strategy,
                "--checkpointing", checkpointing, "--layout", layout, "--work", str(work)]  # fmt: skip
        seconds = 150 if shape == "8b" else 120 if "offload" in strategy else 60
        config = {
            "shape": shape,
            "method": method,
            "strategy": strategy,
            "checkpointing": checkpointing,
            "layout": layout,
        }
        parts.append(Part(f"memory {shape} {method} {strategy} checkpointing-{checkpointing} {layout}", "memory", argv,
                          seconds, meta=config))  # fmt: skip
    return parts


def plan(test_ids: list[str] | None, only: list[str], logs: Path, results: Path, work: Path) -> list[Part]:
    parts = []
    if "tests" in only:
        parts += test_parts(test_ids or [], logs)
    if "bench" in only:
        parts += bench_parts(results)
    if "memory" in only:
        parts += memory_parts(work)
    return parts


def collect_tests() -> tuple[list[str], str]:
    """The GPU tier's test ids (pytest --collect-only), or the test files when collection fails (and why)."""
    argv = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode == 0 and ids:
        return ids, ""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    return files, f"collection failed (exit {done.returncode}): {bench.last_line(done.stdout + done.stderr)}"


# ---- state and the loop -------------------------------------------------------------------------------------------


def load_state(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"version": 1, "parts": {}, "calls": [], "written": False}


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)  # a kill mid-write leaves the old state, never half of one


def is_done(state: dict, part: Part, device: str | None) -> bool:
    """Finished, with an outcome. Figures (bench, memory) count on the device that measured them only."""
    record = state["parts"].get(part.name) or {}
    if record.get("status") != "done":
        return False
    return part.kind == "tests" or device is None or record.get("device") == device


def run_parts(parts: list[Part], state: dict, runner, budget: float, jobs: int = 1, clock=time.time, device=None,
              saved=lambda: None) -> list[Part]:  # fmt: skip
    """Run the parts not done, in order, until one would not fit in the time left. `runner(part, deadline)` returns
    {"status": "done" | "pending", "outcome": ..., "seconds": ..., ...}. Returns the parts still to do."""
    began = clock()
    deadline = began + budget
    queue = [p for p in parts if not is_done(state, p, device)]
    running: dict = {}
    started, stop = 0, False
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        while queue or running:
            while queue and not stop:
                part = queue[0]
                if running and not (
                    part.parallel and len(running) < jobs and all(p.parallel for p in running.values())
                ):
                    break
                left = deadline - clock()
                never_fits = started == 0 and part.minimum > budget  # it gets a whole call, or it would never run
                if left < part.minimum and not never_fits:
                    stop = True
                    break
                queue.pop(0)
                started += 1
                print(f"[{clock() - began:5.0f} s] {part.name} (about {part.estimate:.0f} s)", flush=True)
                running[pool.submit(runner, part, deadline)] = part
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                part = running.pop(future)
                record = state["parts"].setdefault(part.name, {"attempts": 0})
                try:
                    outcome = future.result()
                except Exception as err:  # the runner itself broke: record it, go on with the next part
                    outcome = {"status": "done", "outcome": f"gpu_proof could not run it: {err!r}"[:300]}
                record["attempts"] = record.get("attempts", 0) + (1 if outcome.get("cut_off") else 0)
                if outcome.get("cut_off") and record["attempts"] >= CUT_OFF_LIMIT:
                    outcome = {
                        **outcome,
                        "status": "done",
                        "outcome": f"cut off {CUT_OFF_LIMIT} times: longer than a call",
                    }
                record.update({k: v for k, v in outcome.items() if k not in ("stop", "cut_off")}, device=device,
                              kind=part.kind)  # fmt: skip
                print(f"[{clock() - began:5.0f} s] {part.name}: {record['outcome']}", flush=True)
                stop |= bool(outcome.get("stop"))
                saved()
    return [p for p in parts if not is_done(state, p, device)]


# ---- the real runner ----------------------------------------------------------------------------------------------


class Runner:
    """Runs a part as its own process group, logs it, and reads its outcome."""

    def __init__(self, logs: Path, memory_work: Path, device: str, clock=time.time):
        self.logs, self.memory_work, self.device, self.clock = logs, memory_work, device, clock

    def __call__(self, part: Part, deadline: float) -> dict:
        argv = [a.replace("{deadline}", f"{deadline:.0f}").replace("{device}", bench.device_slug(self.device))
                for a in part.argv]  # fmt: skip
        log = self.logs / f"{slug(part.name)}.log"
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **part.env}
        began = self.clock()
        with log.open("w") as out:
            process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
            try:
                code = process.wait(timeout=max(1.0, deadline + GRACE - began))
            except subprocess.TimeoutExpired:
                stop_group(process)
                code = None
        seconds = round(self.clock() - began, 1)
        trim(log)
        text = log.read_text(errors="replace")
        if code is None:
            return {"status": "pending", "outcome": "cut off at the deadline", "seconds": seconds, "cut_off": True,
                    "stop": True}  # fmt: skip
        read = {"tests": read_test, "bench": read_bench, "report": read_report, "memory": self.read_memory}[part.kind]
        return {"seconds": seconds, "exit": code, **read(part, code, text)}

    def read_memory(self, part: Part, code: int, text: str) -> dict:
        if code != 0:
            return {"status": "done", "outcome": f"failed (exit {code}): {bench.last_line(text)}"}
        row = None
        rows = self.memory_work / "rows.jsonl"
        for line in rows.read_text().splitlines() if rows.exists() else []:
            found = json.loads(line)
            if all(found.get("configuration", {}).get(k) == v for k, v in part.meta.items()):
                row = found  # the last one: this part's
        if row is None:
            return {"status": "done", "outcome": "failed: no row in rows.jsonl"}
        return {"status": "done", "outcome": f"error: {row['error']}" if row.get("error") else "measured", "row": row}


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (it started it; its ranks and loaders are in it), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def trim(log: Path, head: int = 16_000, tail: int = 200_000) -> None:
    """Long logs keep their start and their end (what travels back is limited)."""
    data = log.read_bytes()
    if len(data) > head + tail:
        log.write_bytes(data[:head] + b"\n[... cut ...]\n" + data[-tail:])


def read_test(part: Part, code: int, text: str) -> dict:
    """The outcome from the run file tests/gpu/conftest.py wrote, the reason from pytest's summary lines."""
    run_file = Path(part.env["LLMTUNE_GPU_RUN_FILE"])
    rows = []
    if run_file.exists():
        for line in run_file.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[1] in ("passed", "failed", "skipped", "error"):
                rows.append(cells)
    outcome = rows[0][1] if rows else summary_outcome(text, code)
    if any(r[1] == "failed" for r in rows):
        outcome = "failed"
    reason = next((line.split(" - ", 1)[-1] if " - " in line else line.split(": ", 1)[-1]
                   for line in text.splitlines() if line.startswith(("FAILED ", "ERROR ", "SKIPPED "))), "")  # fmt: skip
    return {"status": "done", "outcome": outcome, "test_seconds": float(rows[0][2]) if rows else None,
            "detail": reason[:300]}  # fmt: skip


def summary_outcome(text: str, code: int) -> str:
    """Without a run file (no CUDA device in that process): pytest's last summary line, e.g. '1 skipped'."""
    for line in reversed(text.splitlines()):
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)
        if counts and line.startswith("="):
            words = {"error" if word.startswith("error") else word for _, word in counts}
            return next(w for w in ("failed", "error", "passed", "skipped") if w in words)
    return {0: "passed", 5: "not collected"}.get(code, f"failed (exit {code})")


def read_bench(part: Part, code: int, text: str) -> dict:
    if code == bench.INCOMPLETE:  # it stopped itself for time: the rest of this call is too short for another run
        return {"status": "pending", "outcome": "stopped for time (resumes)", "stop": True}
    if code == 0:
        return {"status": "done", "outcome": "complete"}
    return {"status": "done", "outcome": f"failed (exit {code}): {bench.last_line(text)}"}


def read_report(part: Part, code: int, text: str) -> dict:
    start = text.find("## ")
    body = text[start:].strip() if start >= 0 else text.strip()
    word = {0: "complete", bench.INCOMPLETE: "some arms failed or are missing"}.get(code, f"failed (exit {code})")
    return {"status": "done", "outcome": word, "report": body}


# ---- the machine, and the section of RESULTS.md -------------------------------------------------------------------


def gpu_name() -> str | None:
    """The GPU's name, asked in a process of its own: this one holds no CUDA context while the parts measure memory."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip().splitlines() or [""])[-1] or None if done.returncode == 0 else None


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        found[name] = None
        for dist in (name, name.replace("_", "-")):
            try:
                found[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    try:
        import torch

        found["cuda"] = torch.version.cuda
    except ImportError:
        found["cuda"] = None
    return found


def missing_lines(found: dict, tokenizer: Path = ROOT / ".gpu" / "tok") -> list[str]:
    """One line per missing piece the proof needs, with what it costs and how to bring it."""
    lines = []
    if not tokenizer.is_dir():
        lines.append("missing: .gpu/tok (SmolLM2's tokenizer): the benchmark's models fall back to the 512-token test "
                     "tokenizer (rows 2.5x longer, a tiny lm_head); see ../shared/gpu/README.md, step 2")  # fmt: skip
    for name, cost in NEEDED.items():
        if found.get(name) is None and cost:
            pip = INSTALL.get(name, name)
            lines.append(f"missing: {pip}: {cost} (bring it: bash ../shared/gpu/fetch-wheels.sh {pip})")
    return lines


def commit(given: str | None) -> str:
    if given:
        return given
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    return (found.stdout.strip() or "unknown") + ("+changes" if dirty else "") + " (as git reads it on the device)"


def stack_line(found: dict) -> str:
    shown = [f"{name} {found.get(name) or 'not installed'}" for name in LIBRARIES]
    shown[0] += f" (CUDA {found.get('cuda') or '?'})"
    return ", ".join(shown)


def section(state: dict, parts: list[Part], date: str) -> str:
    """The dated section for tests/gpu/RESULTS.md: machine, stack, and every part's outcome."""
    calls = state.get("calls") or [{}]
    devices = sorted({c.get("device") for c in calls if c.get("device")}) or ["?"]
    lines = [f"## {date}: make gpu-proof on {' and '.join(devices)} (commit {calls[-1].get('commit', '?')})", "",
             f"Stack: {stack_line(calls[-1].get('versions') or {})}.",
             f"{len(calls)} device call(s); GPU tests {calls[-1].get('jobs', 1)} at a time, the benchmark and the "
             "memory rows alone on the GPU.", ""]  # fmt: skip
    records = state["parts"]
    tests = [p for p in parts if p.kind == "tests"]
    if tests:
        counts: dict[str, int] = {}
        lines += ["### GPU tests (`pytest tests/gpu -m gpu`, one part per test)", "",
                  "| test | outcome | seconds | note |", "| --- | --- | --- | --- |"]  # fmt: skip
        for p in tests:
            r = records.get(p.name, {})
            outcome = r.get("outcome", "not run")
            counts[outcome] = counts.get(outcome, 0) + 1
            seconds = r.get("test_seconds") or r.get("seconds")
            shown = "**passed**" if outcome == "passed" else outcome
            name = p.name.removeprefix("test tests/gpu/")
            lines.append(f"| {name} | {shown} | {seconds if seconds is not None else '-'} | {r.get('detail', '')} |")
        lines += ["", "Totals: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ".", ""]
    if any(p.kind == "bench" for p in parts):
        lines += ["### Throughput (`benchmarks/gpu_throughput.py`, 3 repeats in rotating order)", ""]
        for p in parts:
            if p.kind == "bench":
                lines.append(f"- {p.name}: {records.get(p.name, {}).get('outcome', 'not run')}")
        report = records.get("bench report", {}).get("report")
        lines += ["", demote(report) if report else "(no report)", ""]
    memory = [p for p in parts if p.kind == "memory"]
    if memory:
        lines += ["### Memory calibration (`benchmarks/gpu_memory.py`, one configuration per part)", "",
                  "| configuration | est alloc GB | meas alloc GB | ratio | est total GB | reserved + context GB | ratio "
                  "| rank context GB | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for p in memory:
            r = records.get(p.name, {})
            lines.append(memory_row(p.name[7:], r.get("row") or {}, r.get("outcome", "not run")))
        lines.append("")
    return "\n".join(lines) + "\n"


def demote(report: str) -> str:
    """The benchmark's headings under this section's."""
    return "\n".join(
        "#### " + line.lstrip("#").strip() if line.startswith("#") else line for line in report.splitlines()
    )


def memory_row(name: str, row: dict, outcome: str) -> str:
    gb = lambda v: f"{v / 1e9:.2f}" if v else "-"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    alloc, est_alloc = row.get("measured_allocated_bytes"), row.get("estimate_allocated_bytes")
    context = row.get("rank_context_bytes") or row.get("cuda_context_bytes")
    whole = row["measured_reserved_bytes"] + context if row.get("measured_reserved_bytes") and context else None
    note = "" if outcome == "measured" else outcome
    return (f"| {name} | {gb(est_alloc)} | {gb(alloc)} | {ratio(est_alloc, alloc)} | {gb(row.get('estimate_bytes'))} | "
            f"{gb(whole)} | {ratio(row.get('estimate_bytes'), whole)} | {gb(row.get('rank_context_bytes'))} | {note} |")  # fmt: skip


def insert_section(text: str, new: str) -> str:
    """RESULTS.md lists runs newest first: the new section goes above the first existing one."""
    at = text.find("\n## ")
    new = new.rstrip("\n") + "\n"
    if at < 0:
        return text.rstrip("\n") + "\n\n" + new
    return text[: at + 1] + new + "\n" + text[at + 1 :]


def sync_out(out: Path | None, state_dir: Path, memory_work: Path, results_md: Path = RESULTS_MD) -> None:
    """Copy what must come back from the device machine: only files under $OUT do."""
    if out is None:
        return
    target = out / "gpu-proof"
    shutil.copytree(state_dir, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("data-*.jsonl", "*.tmp"))
    for source, name in ((results_md, "RESULTS.md"), (ROOT / "benchmarks" / "results.json", "results.json"),
                         (memory_work / "rows.jsonl", "gpu-proof/memory-rows.jsonl")):  # fmt: skip
        if source.exists():
            shutil.copy2(source, out / name)


# ---- command line -------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=540, help="seconds this call may use (default 540)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--only", nargs="+", choices=["tests", "bench", "memory"], default=["tests", "bench", "memory"])
    parser.add_argument(
        "--jobs", type=int, default=3, help="GPU tests at once (the benchmark and memory rows run alone)"
    )
    parser.add_argument("--state-dir", type=Path, default=STATE_DIR)
    parser.add_argument(
        "--memory-work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "llmtune-gpu-proof-memory"
    )
    parser.add_argument("--commit", help="the commit sent (the device's .git may be stale)")
    parser.add_argument("--results-md", type=Path, default=RESULTS_MD, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="list the parts in order; run nothing")
    parser.add_argument("--write-partial", action="store_true", help="write the RESULTS.md section now, parts missing")
    return parser.parse_args(argv)


def describe(parts: list[Part], state: dict, only: list[str]) -> list[str]:
    lines = []
    if "tests" in only and not state.get("test_ids"):
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
        lines.append(f"  GPU tests: one part per test id of {', '.join(files)}, collected on the GPU machine "
                     "(about 30 tests of 20-130 s; --jobs at a time)")  # fmt: skip
    for p in parts:
        done = (state["parts"].get(p.name) or {}).get("status") == "done"
        lines.append(f"  {p.name}: about {p.estimate:.0f} s{' (done)' if done else ''}")
    return lines


def main(argv=None, runner=None, gpu=gpu_name, clock=time.time) -> int:
    args = parse_args(argv)
    state_path = args.state_dir / "state.json"
    state = load_state(state_path)
    logs, results = args.state_dir / "logs", args.state_dir / "bench"
    test_ids = state.get("test_ids")
    parts = plan(test_ids, args.only, logs, results, args.memory_work)
    device = None if args.dry_run else gpu()
    if args.dry_run or device is None:
        head = "gpu_proof --dry-run: the parts, in order" if args.dry_run else (
            "gpu_proof: no GPU present (torch.cuda.is_available() is False): nothing run, nothing written. "
            "On a GPU machine it would run, in order")  # fmt: skip
        total = sum(p.estimate for p in parts)
        print(f"{head} (the parts listed: about {total / 60:.0f} min):")
        print("\n".join(describe(parts, state, args.only)))
        return 0 if args.dry_run else 2
    found = versions()
    for line in missing_lines(found):
        print(line)
    earlier = {c.get("device") for c in state.get("calls", [])} - {device}
    if earlier:
        print(f"earlier calls ran on {', '.join(sorted(earlier))}: test outcomes are kept; benchmark and memory parts "
              f"measured there run again on {device} (figures count on one device)")  # fmt: skip
    state.setdefault("calls", []).append({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
                                          "commit": commit(args.commit), "versions": found, "jobs": args.jobs})  # fmt: skip
    began = clock()
    if "tests" in args.only and not test_ids:
        test_ids, problem = collect_tests()
        state["test_ids"] = test_ids
        if problem:
            print(f"GPU tests: {problem}; one part per file instead")
        parts = plan(test_ids, args.only, logs, results, args.memory_work)
    save_state(state_path, state)

    def saved():
        save_state(state_path, state)
        sync_out(args.out, args.state_dir, args.memory_work, args.results_md)

    runner = runner or Runner(logs, args.memory_work, device)
    budget = args.budget - (clock() - began)
    left = run_parts(parts, state, runner, budget, args.jobs, clock=clock, device=device, saved=saved)
    if not left and state.get("written") and not args.write_partial:
        print(f"\nevery part is done and the section was written; delete {args.state_dir} to start a new proof")
    elif left and not args.write_partial:
        rest = sum(p.estimate for p in left)
        print(f"\n{len(left)} part(s) left, about {rest / 60:.0f} min: run `make gpu-proof` again "
              f"(on a fresh machine, carry .gpu-proof; $OUT/gpu-proof holds it). Next: {left[0].name}")  # fmt: skip
    elif not state.get("written") or args.write_partial:
        md = args.results_md
        text = md.read_text() if md.exists() else "# GPU tier results\n"
        md.write_text(insert_section(text, section(state, parts, time.strftime("%Y-%m-%d", time.gmtime()))))
        state["written"] = not left
        print(f"\nall {len(parts)} parts done; the section is in {md}" if not left
              else f"\n{len(left)} part(s) missing; a partial section is in {md}")  # fmt: skip
    saved()
    return 0


if __name__ == "__main__":
    sys.exit(main())
