"""What the user's console shows of a run, and what only the logs keep.

Every line the ranks print reaches `<output_dir>/llmtune/logs/` unchanged. The console shows what the user caused:
llmtune's own lines (plan, warnings about the recipe, progress, summary), errors, and any line llmtune doesn't know
to be noise. Noise is silenced at its source first (a rank imports only the libraries its plan uses, and llmtune
passes today's argument names); what can't be silenced there is listed in NOISE, each entry narrow (the emitting
module and its message) and with the reason it can't be fixed where it starts. `--verbose` shows everything.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import IO

RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")


@dataclass(frozen=True)
class Noise:
    pattern: re.Pattern  # the line as the ranks print it
    why: str
    # where it starts, for llmtune's own process (eval, merge, chat...), which has no console in between:
    logger: str | None = None  # the library's logger, and the record's message there
    message: re.Pattern | None = None
    warning: str | None = None  # or the Python warning's message (warnings.filterwarnings: matched at its start)


def _noise(pattern: str, why: str, logger: str | None = None, message: str | None = None,
           warning: str | None = None) -> Noise:  # fmt: skip
    return Noise(re.compile(pattern), why, logger, re.compile(message) if message else None, warning)


NOISE = (
    _noise(
        r"transformers/modeling_utils\.py:\d+: FutureWarning: `is_gradient_checkpointing` is deprecated",
        "peft's PeftModel reads transformers' old property name itself (peft 0.21); nothing llmtune passes",
        warning=r"`is_gradient_checkpointing` is deprecated",
    ),
    _noise(
        r"\[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to CPU",
        "DeepSpeed announces its accelerator when imported; in a CPU rehearsal of a ZeRO plan that is the point, "
        "and the plan summary already says so",
        logger="DeepSpeed",
        message=r"^Setting accelerator to CPU",
    ),
    _noise(
        r"^Failed to load \S+/torchao/_C\w*\.\S+\.so: Could not load this library",
        "torchao's prebuilt CUDA kernels (qat and its optimizers only) don't load on every machine; llmtune uses "
        "its Python fake-quantizers and low-bit optimizers, which don't need them",
        logger="torchao",
        message=r"^Failed to load \S+/torchao/_C\w*\.\S+\.so: Could not load this library",
    ),
    _noise(
        r"torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass and is now natively supported",
        "torchao registers its enums with an older torch API at import (qat and its optimizers only); peft imports "
        "torchao whenever it is installed",
        logger="torch.utils._pytree",
        message=r"^<enum '\w+'> is an Enum subclass and is now natively supported",
    ),
    _noise(
        r"^Failed to load CPU gemm_4bit_forward from kernels-community",
        "bitsandbytes looks for an optional CPU kernel on the hub at import (4/8-bit runs only); its own kernel "
        "is used instead",
        logger="bitsandbytes.backends.cpu.ops",
        message=r"^Failed to load CPU gemm_4bit_forward from kernels-community",
    ),
    _noise(
        r"torch/distributed/run\.py:\d+\] (\*{10,}|Setting OMP_NUM_THREADS environment variable for each process"
        r"|\s*$)",
        "torchrun's notice that it sets OMP_NUM_THREADS=1 for its processes, at every multi-process launch",
    ),
    _noise(r"reducer\.cpp:\d+\] Warning: find_unused_parameters=True was specified in DDP constructor, but did not "
           r"find any unused parameters",
           "transformers asks DDP to look for unused parameters whenever gradient checkpointing is off, and torch "
           "then says it found none; llmtune keeps that default, since MoE and partly frozen models do leave some "
           "unused and a wrong false stops the run (ddp_find_unused_parameters: false takes the faster path)"),
    _noise(r"Token indices sequence length is longer than the specified maximum sequence length for this model "
           r"\(\d+ > \d+\)\. Running this sequence through the model will result in indexing errors",
           "a tokenizer warns once when a row is longer than its model_max_length, saying the model will fail on it; "
           "llmtune measures each row against sequence_len and drops or truncates it first (its data line says how "
           "many), so no such row reaches the model"),
    _noise(r"^DeepSpeed deepspeed\.ops\.comm\.deepspeed_shm_comm_op built successfully",
           "DeepSpeed's CPU accelerator loads its shared-memory collectives op in every rank of a rehearsal"),
    _noise(r"^\[RANK \d+\] Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config "
           r"has \d+\. Using DeepSpeed's value\.$",
           "the Trainer hands DeepSpeed runs an Accelerator without gradient accumulation (DeepSpeed's config carries "
           "it, as llmtune writes it) and accelerate warns at every ZeRO launch with accumulation above 1"),
    _noise(r"\[WARNING\] \[base_optimizer\.py:\d+:load_hp_checkpoint_state_from_checkpoint_dir\] MPU is not provided, "
           r"setting tp size to 1 in checkpoint loading\.$",
           "DeepSpeed's universal-checkpoint loader (a ZeRO resume on another world size) warns on every rank of a "
           "run without tensor parallelism, which is every llmtune ZeRO run"),
    _noise(r"^(Exception raised from \S+ at \S+ \(most recent call first\):|frame #\d+: .*\)|"
           r"<omitting python frames>)$",
           "torch's C++ stack under a c10d error (a socket timeout while a rendezvous waits, a store closing at the "
           "end): the error's own line is kept and llmtune's last line names the cause; the logs keep the frames"),
    _noise(r"(socket\.cpp:\d+\] \[c10d\] The client socket has timed out after|TCPStore\.cpp:\d+\] \[c10d\] TCP "
           r"client failed to connect/validate to host \S+ - (retrying|timed out))",
           "torch's c10d retries reaching the rendezvous store while the other machines start: llmtune says what it "
           "waits for, and names the machine if the wait runs out"),
    _noise(r"torch/distributed/run\.py:\d+\] node_rank is only used for static rdzv_backend",
           "accelerate launch hands torchrun its --machine_rank as node_rank whatever the rendezvous; under c10d "
           "torchrun assigns ranks itself and says it ignores it"),
    _noise(r"agent/server/api\.py:\d+\] Error waiting on exit barrier",
           "torchrun's exit barrier on a machine whose training finished, when machine 0's store closed first (the "
           "job succeeded; the exit code says so)"),
    _noise(r"peft/tuners/tuners_utils\.py:\d+: RuntimeWarning: The following (rank|alpha)_pattern keys did not match any "
           r"targeted module and were ignored: \['\.\*\\\\\.gate_up_proj'\]",
           "peft gives a fused gate_up_proj rank 2r (and alpha 2x) through rank_pattern and alpha_pattern entries it "
           "adds itself; where the recipe's targets leave the fused experts frozen the entries match nothing "
           "(llmtune says which experts stay frozen and the key that trains them)",
           warning=r"The following (rank|alpha)_pattern keys did not match any targeted module and were ignored: "
                   r"\['\.\*\\\\\.gate_up_proj'\]"),
    _noise(r"peft/tuners/lora/layer\.py:\d+: UserWarning: fan_in_fan_out is set to False but the target module is "
           r"`Conv1D`\. Setting fan_in_fan_out to True\.",
           "GPT-2-style Conv1D layers store their weights transposed; peft sets fan_in_fan_out on each such layer "
           "itself (what lora_fan_in_fan_out: true says), and the run trains as it should",
           warning=r"fan_in_fan_out is set to False but the target module is `Conv1D`"),
    _noise(r"torch/distributed/c10d_logger\.py:\d+: FutureWarning: `torch\.distributed\.(all_gather_into_tensor|"
           r"reduce_scatter_tensor)` is deprecated",
           "DeepSpeed 0.19's ZeRO calls torch's old collective names; llmtune's own collectives use today's",
           warning=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
)  # fmt: skip

# A Python warning's second line (the source line it points at) and a glog continuation are indented.
CONTINUATION = re.compile(r"^\s+\S")


def noise(text: str) -> Noise | None:
    """The NOISE entry this line matches (rank prefix removed first), or None."""
    text = RANK_PREFIX.sub("", text, count=1)
    return next((entry for entry in NOISE if entry.pattern.search(text)), None)


def quiet_libraries() -> None:
    """Silence NOISE where it starts, in llmtune's own process (eval, merge, infer, chat, and the launcher itself),
    whose stderr reaches the user without a Console in between: a filter on the library's logger for that message,
    or a warnings filter. Public logging and warnings APIs only; loggers not yet created are created empty and the
    library's getLogger returns them."""
    global _quiet
    if _quiet:
        return
    _quiet = True
    import logging
    import os
    import warnings

    if not sys.stderr.isatty():  # a log file or a pipe: download and loading bars would be one long line each
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    for entry in NOISE:
        if entry.logger and entry.message:
            pattern = entry.message
            logging.getLogger(entry.logger).addFilter(lambda record, p=pattern: not p.search(record.getMessage()))
        if entry.warning:
            warnings.filterwarnings("ignore", message=entry.warning)


_quiet = False


class Console:
    """Shows the ranks' output on the user's console: filtered, and with a live progress bar on a terminal.

    `feed` takes one record the ranks printed: a line, or (transient=True) a progress bar's redraw that ended in
    a carriage return. Progress lines of llmtune's (train.progress.step_line) drive the live bar on a terminal and
    print as lines elsewhere. A line every rank prints (a library's warning) is shown once.
    """

    def __init__(self, out: IO[str] | None = None, verbose: bool = False, live: bool | None = None) -> None:
        self.out = out or sys.stderr
        self.verbose = verbose
        self.live = self.out.isatty() if live is None else live
        self._dropping: set[str | None] = set()  # ranks inside a dropped warning: its continuation lines go too
        self._shown: set[str] = set()  # what was shown, without rank prefixes: other ranks' copies are dropped
        self._bar = None

    def feed(self, text: str, transient: bool = False) -> None:
        if transient:  # a third-party bar's redraw (downloads): only a terminal can show it in place
            if self.live:
                self._progress().status(RANK_PREFIX.sub("", text, count=1).strip())
            return
        if not self.verbose and not self._keep(text):
            return
        rank = RANK_PREFIX.match(text)
        if not self.verbose and rank and rank.group(1) == "0" and text[rank.end() :].startswith("[llmtune]"):
            text = text[rank.end() :]  # llmtune speaks from rank 0 only: the prefix says nothing
        if self.live:
            from llmtune.train.runtime.progress import parse_step

            step = parse_step(RANK_PREFIX.sub("", text, count=1))
            if step:
                self._progress().update(step)
                return
            if self._bar is not None:
                self._bar.print(text)
                return
        self.out.write(text + "\n")
        self.out.flush()

    def _keep(self, text: str) -> bool:
        # per rank: another rank's line may come between a dropped warning and its source line
        rank = RANK_PREFIX.match(text)
        source = rank.group(1) if rank else None
        if source in self._dropping and (CONTINUATION.match(RANK_PREFIX.sub("", text, count=1)) or not text.strip()):
            return False  # a dropped line's continuation, or the blank line that ends a dropped C++ stack
        if noise(text) is not None:
            self._dropping.add(source)
            return False
        self._dropping -= {source, None}  # lines without a rank prefix come in order: any other line ends theirs
        body = text[rank.end() :] if rank else text
        if rank and rank.group(1) != "0" and body in self._shown:
            return False
        if len(self._shown) < 100_000:
            self._shown.add(body)
        return True

    def _progress(self) -> _LiveBar:
        if self._bar is None:
            self._bar = _LiveBar(self.out)
        return self._bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _LiveBar:
    """rich's progress bar on the launcher's terminal: step/total, loss, learning rate, tokens/s, ETA."""

    def __init__(self, out: IO[str]) -> None:
        from rich.console import Console as RichConsole
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[numbers]}"), console=RichConsole(file=out), transient=False,
        )  # fmt: skip
        self.task = self.progress.add_task("", total=None, numbers="")
        self.progress.start()

    def status(self, text: str) -> None:
        self.progress.update(self.task, description=text[:60])

    def update(self, step: dict) -> None:
        numbers = f"loss {step['loss']:.4f}  lr {step['lr']:.2e}"
        if step.get("tokens_per_second") is not None:
            numbers += f"  {step['tokens_per_second']:,.0f} tok/s"
        if step.get("eta"):
            numbers += f"  eta {step['eta']}"
        self.progress.update(self.task, description="training", completed=step["step"], total=step["total"],
                             numbers=numbers)  # fmt: skip

    def print(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        self.progress.stop()
