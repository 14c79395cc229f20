"""The console shows what the user caused: noise filtered narrowly, everything kept in the logs, progress as numbers."""

from __future__ import annotations

import io

import pytest

from llmtune.launch.console import NOISE, Console, noise
from llmtune.launch.failures import StderrWatcher, records
from llmtune.train.runtime.progress import parse_step, startup_seconds, step_line

# One real line of each kind (copied from runs on this machine: torch 2.13, transformers 5.24, torchao 0.18,
# bitsandbytes 0.50, deepspeed 0.19.8), and the lines around them that must stay.
NOISY = [
    "/x/site-packages/transformers/modeling_utils.py:3312: FutureWarning: `is_gradient_checkpointing` is deprecated "
    "and will be removed in v6. Use `is_activation_checkpointing` instead.",
    "[2026-11-25 03:15:19,299] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you "
    "have GPU or other accelerator, we were unable to detect it.",
    "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library: "
    "/x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",
    "W1125 03:15:39.160000 3760 site-packages/torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum "
    "subclass and is now natively supported by torch.compile as an opaque value type.",
    "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you "
    "already `pip install kernels` and the kernels >= 0.11.1",
    "W1125 03:27:20.104000 14698 site-packages/torch/distributed/run.py:852] Setting OMP_NUM_THREADS environment "
    "variable for each process to be 1 in default, to avoid your system being overloaded",
    "[rank0]:[W1125 03:30:37.043346355 reducer.cpp:1529] Warning: find_unused_parameters=True was specified in DDP "
    "constructor, but did not find any unused parameters in the forward pass.",
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "[transformers] Token indices sequence length is longer than the specified maximum sequence length for this model "
    "(9700 > 256). Running this sequence through the model will result in indexing errors",
    "/x/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_tensor` "
    "is deprecated. Please use `torch.distributed.all_gather_single` instead.",
    "/x/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: `torch.distributed.reduce_scatter_tensor` is "
    "deprecated. Please use `torch.distributed.reduce_scatter_single` instead.",
    "/x/site-packages/peft/tuners/tuners_utils.py:1123: RuntimeWarning: The following rank_pattern keys did not "
    "match any targeted module and were ignored: ['.*\\\\.gate_up_proj'].",
    "/x/site-packages/peft/tuners/tuners_utils.py:1123: RuntimeWarning: The following alpha_pattern keys did not "
    "match any targeted module and were ignored: ['.*\\\\.gate_up_proj'].",
    "/x/site-packages/peft/tuners/lora/layer.py:2760: UserWarning: fan_in_fan_out is set to False but the target "
    "module is `Conv1D`. Setting fan_in_fan_out to True.",
    "[RANK 0] Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has 4. Using "
    "DeepSpeed's value.",
    "[2026-11-25 14:28:54,717] [WARNING] [base_optimizer.py:343:load_hp_checkpoint_state_from_checkpoint_dir] MPU is "
    "not provided, setting tp size to 1 in checkpoint loading.",
    # torch's c10d while machine 1 waits for machine 0's store, and its C++ stack (torch 2.13, a c10d rendezvous)
    "[W1127 17:24:39.928650113 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
    "127.0.0.1:29731 - retrying (try=0, timeout=15000ms, delay=6260ms): The client socket has timed out",
    "[E1127 17:24:39.928262516 socket.cpp:1028] [c10d] The client socket has timed out after 15000ms while trying "
    "to connect to (127.0.0.1, 29731).",
    "[E1127 17:24:45.194387087 TCPStore.cpp:328] [c10d] TCP client failed to connect/validate to host "
    "127.0.0.1:29731 - timed out (try=1, timeout=15000ms):",
    "Exception raised from throwTimeoutError at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/socket.cpp:1030 "
    "(most recent call first):",
    "frame #8: c10d::TCPStore::TCPStore(std::__cxx11::basic_string<char, std::char_traits<char>, "
    "std::allocator<char> >, c10d::TCPStoreOptions const&) + 0x41d (0x7f871ff4534d in /x/torch/lib/libtorch_cpu.so)",
    "<omitting python frames>",
    "W1127 17:24:29.709000 30239 site-packages/torch/distributed/run.py:865] node_rank is only used for static "
    "rdzv_backend. It will be ignored for rdzv_backend=c10d.",
    "E1127 10:01:02.000000 4242 site-packages/torch/distributed/elastic/agent/server/api.py:950] Error waiting on "
    "exit barrier. Elapsed: 0.5 seconds",
]
KEPT = [
    "[llmtune] data: 32 train / 0 eval examples",
    "error: datasets[0].type: unknown format 'alpacca' (hint: did you mean 'alpaca'?)",
    "/x/site-packages/transformers/trainer.py:10: UserWarning: a warning llmtune doesn't know",
    "Failed to load the tokenizer of some/model",  # only torchao's .so lines are noise, not every failure
    # peft's unmatched rank_pattern is noise only for the entry peft adds itself; the user's own ones stay
    "/x/site-packages/peft/tuners/tuners_utils.py:1123: RuntimeWarning: The following rank_pattern keys did not "
    "match any targeted module and were ignored: ['q_proj'].",
    # accelerate's mismatch is noise only as the Trainer causes it for DeepSpeed (its plugin at 1)
    "[RANK 0] Gradient accumulation steps mismatch: GradientAccumulationPlugin has 4, DeepSpeed config has 2. Using "
    "DeepSpeed's value.",
    "torch.distributed.DistNetworkError: The client socket has timed out after 15000ms",  # the error itself stays
    "frame #0 of the story",  # only a C++ frame's whole line is
]


@pytest.mark.parametrize("line", NOISY)
def test_each_noise_entry_matches_its_line_and_nothing_llmtune_says(line):
    assert noise(line) is not None
    assert noise(f"[rank1]:{line}") is not None
    assert all(entry.why for entry in NOISE)
    for kept in KEPT:
        assert noise(kept) is None, kept


def test_the_console_drops_noise_with_its_continuation_and_shows_a_line_of_every_rank_once():
    out = io.StringIO()
    console = Console(out, live=False)
    lines = [
        "[llmtune] data: 32 train",
        NOISY[0],
        "  warnings.warn(",  # the warning's source line goes with it
        "[rank0]:[llmtune] step 1/2  loss 2.0000  lr 1.000e-03",
        "[rank0]:UserWarning: something new",
        "[rank1]:UserWarning: something new",  # another rank's copy of a line: shown once
        "[rank1]:UserWarning: something else",
        "  indented after a kept line stays",
    ]
    for line in lines:
        console.feed(line)
    shown = [lines[0], lines[3].removeprefix("[rank0]:"), lines[4], lines[6], lines[7]]  # rank 0's own lines bare
    assert out.getvalue().splitlines() == shown
    verbose = io.StringIO()
    everything = Console(verbose, verbose=True, live=False)
    for line in lines:
        everything.feed(line)
    assert verbose.getvalue().splitlines() == lines


def test_records_split_lines_and_carriage_return_redraws_across_reads():
    class Chunks(io.RawIOBase):
        def __init__(self, parts):
            self.parts = list(parts)

        def read1(self, _size=-1):
            return self.parts.pop(0) if self.parts else b""

    stream = Chunks([b"one\ntw", b"o\r\nbar 1/3\rbar 2/3\r", b"\nbar done\n", "é".encode()[:1], "é\n".encode()[1:]])
    assert list(records(stream)) == [("one", False), ("two", False), ("bar 1/3", True), ("bar 2/3", False),
                                     ("bar done", False), ("é", False)]  # fmt: skip


def test_the_watcher_logs_every_line_and_shows_the_filtered_ones(tmp_path):
    text = "\n".join(["[llmtune] kept", NOISY[1], "download 10%\rdownload 100%", "[llmtune] also kept"]) + "\n"
    out, log = io.StringIO(), io.StringIO()
    watcher = StderrWatcher(io.StringIO(text), console=Console(out, live=False), log=log, hold_tracebacks=False)
    watcher.run()
    assert out.getvalue() == "[llmtune] kept\ndownload 100%\n[llmtune] also kept\n"
    assert log.getvalue() == "[llmtune] kept\n" + NOISY[1] + "\ndownload 100%\n[llmtune] also kept\n"


def test_a_live_console_turns_step_lines_into_a_bar_and_prints_the_rest_above_it():
    out = io.StringIO()
    console = Console(out, live=True)
    console.feed("[llmtune] model: loaded")
    console.feed(step_line(1, 4, 2.5, 1e-3, 0.5, 1000.0, 3.0))
    assert console._bar is not None
    task = console._bar.progress.tasks[0]
    assert (task.completed, task.total) == (1, 4) and "loss 2.5000" in task.fields["numbers"]
    console.feed("[llmtune] eval at step 1: loss 2.4000")
    console.close()
    shown = out.getvalue()
    assert "[llmtune] model: loaded" in shown and "eval at step 1" in shown and "loss 2.5000" in shown


def test_step_lines_carry_numbers_and_parse_back():
    line = step_line(3, 8, 6.20501, 8.54e-4, 0.58, 1234.4, 62)
    assert line == "[llmtune] step 3/8  loss 6.2050  lr 8.540e-04  grad_norm 0.580  tok/s 1,234  eta 0:01:02"
    assert parse_step(line) == {"step": 3, "total": 8, "loss": 6.2050, "lr": 8.54e-4, "grad_norm": 0.58,
                                "tokens_per_second": 1234.0, "eta": "0:01:02"}  # fmt: skip
    assert parse_step(step_line(1, 2, float("nan"), 0.0))["grad_norm"] is None
    assert parse_step("[llmtune] data: 3 rows") is None


def test_startup_seconds_follow_the_marks_from_the_launcher_to_the_rank(monkeypatch):
    from llmtune.train.runtime import progress

    monkeypatch.setattr(progress, "_marks", {})
    monkeypatch.setenv(progress.TIMELINE_ENV, "start=100.0,plan=100.5")
    progress.mark("launch", 101.0)
    progress.mark("data", 103.25)
    assert startup_seconds() == {"plan": 0.5, "launch": 0.5, "data": 2.25}


def test_a_dropped_warnings_source_line_goes_with_it_when_another_rank_prints_between():
    out = io.StringIO()
    console = Console(out, live=False)
    for line in [f"[rank3]:{NOISY[9]}", "[rank2]:UserWarning: kept", "[rank3]:  return func(*args, **kwargs)",
                 "[rank2]:  its own source line stays"]:  # fmt: skip
        console.feed(line)
    assert out.getvalue().splitlines() == ["[rank2]:UserWarning: kept", "[rank2]:  its own source line stays"]


def test_a_c10d_wait_that_runs_out_shows_llmtune_s_lines_not_torch_s_c_plus_plus_stack():
    """Machine 1 alone under c10d printed ~50 lines of TCPStore frames before llmtune's one line."""
    out = io.StringIO()
    console = Console(out, live=False)
    stack = [NOISY[-5], *[f"frame #{i}: <unknown function> + 0x{i:x} (0x7f in /x/libtorch_cpu.so)" for i in range(9)],
             NOISY[-3], "frame #36: _start + 0x21 (0x5 in /x/bin/python)", ""]  # fmt: skip
    for line in ["[llmtune] c10d rendezvous at 127.0.0.1:29731: waiting up to 15 s for 2 machines", NOISY[-7],
                 *stack, NOISY[-6], *stack, "[llmtune] after"]:  # fmt: skip
        console.feed(line)
    assert out.getvalue().splitlines() == ["[llmtune] c10d rendezvous at 127.0.0.1:29731: waiting up to 15 s for 2 "
                                           "machines", "[llmtune] after"]  # fmt: skip


QUIET_PROBE = r"""
import logging, sys, warnings
from llmtune.launch.console import NOISE, quiet_libraries
quiet_libraries()
logging.basicConfig(format="%(name)s: %(message)s")
for line in sys.argv[1:]:
    for entry in NOISE:
        if entry.logger and entry.pattern.search(line):
            message = line[line.index(next(m for m in ("Failed", "Setting", "<enum") if m in line)):]
            logging.getLogger(entry.logger).warning(message)
            logging.getLogger(entry.logger).warning("kept: " + message)  # the same logger's other lines stay
        if entry.warning and entry.pattern.search(line):
            message = line.split("Warning: ", 1)[1]
            warnings.warn(message, FutureWarning)
            warnings.warn("kept: " + message, FutureWarning)
"""


def test_llmtune_s_own_process_silences_the_same_noise_at_its_logger_and_keeps_the_rest():
    """eval, merge, infer and chat run in llmtune's process, with no Console between the libraries and the user:
    each NOISE entry that names its logger or warning is filtered there, and nothing else is."""
    import subprocess
    import sys

    sourced = [line for line in NOISY if (entry := noise(line)) and (entry.logger or entry.warning)]
    assert len(sourced) >= 10  # torchao, pytree, bitsandbytes, DeepSpeed's accelerator, six Python warnings
    done = subprocess.run([sys.executable, "-c", QUIET_PROBE, *sourced], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    shown = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("  ")]
    assert len(shown) == len(sourced), done.stderr
    assert all("kept: " in line for line in shown), done.stderr
