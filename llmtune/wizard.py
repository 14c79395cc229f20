"""`llmtune config`: the questions `accelerate config` asks, plus model, method and data, then a recipe.

Every question has a flag; a question whose flag was given is not asked. `--yes` takes the default of
every other question (for scripts). The strategy question shows the estimate table of the recipe as it will be
written and preselects the recommended strategy (wizard_sft.py; the CPU memory is asked where it offloads); the
recipe's header gives the estimate of its plan. A user error is one line naming the flag, and nothing is written:
with --yes and no --strategy, nothing fitting is one too. Text questions show their default in brackets: Enter takes it, typing replaces it, and
a local path that doesn't exist is refused in place, with the reason, until the answer is one that does.

A base model that is an llmtune run's result (or a preference flag such as --rl) turns the data questions into
preference training's (wizard_preference.py).

(About 350 lines: one conversation, kept in one file in the order the questions are asked.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import fields
from datetime import date
from pathlib import Path
from typing import Any

from llmtune import wizard_preference as preference
from llmtune.errors import UserError
from llmtune.recipe.writer import (
    STRATEGIES,
    Answers,
    first_row,
    format_mismatch,
    guess_dataset_type,
    machine_commands,
    recipe_text,
)
from llmtune.wizard_sft import (
    Fit,
    check_numbers,
    choose_strategy,
    gpu_count,
    gpu_ids_problem,
    load_text,
    offer_async_checkpoint,
    plan_of,
    sft_problem,
    size_problem,
    verdict,
)

DATASET_TYPES = ["alpaca", "chat_template", "completion", "input_output"]


class Asker:
    """Asks with arrow-key menus (questionary), or takes every default (--yes)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive

    def _run(self, question) -> Any:
        answer = question.ask()
        if answer is None:  # Ctrl-C inside questionary
            raise KeyboardInterrupt
        return answer

    def select(self, message: str, choices: list[tuple[str, str]], default: str) -> str:
        if not self.interactive:
            return default
        import questionary

        options = [questionary.Choice(title=title, value=value) for value, title in choices]
        return self._run(
            questionary.select(message, choices=options, default=next(o for o in options if o.value == default))
        )

    def text(self, message: str, default: str, check: Callable[[str], str | None] | None = None) -> str:
        """A typed answer; Enter alone takes the default shown in brackets (typing replaces it, as in accelerate)."""
        if not self.interactive:
            return default
        import questionary

        def answer(typed: str) -> str:
            return typed.strip() or default

        def validate(typed: str):
            problem = check(answer(typed)) if check else None
            return True if problem is None else problem

        return answer(self._run(questionary.text(_with_default(message, default), validate=validate)))

    def confirm(self, message: str, default: bool) -> bool:
        if not self.interactive:
            return default
        import questionary

        return bool(self._run(questionary.confirm(message, default=default)))

    def show(self, text: str) -> None:
        print(text, file=sys.stderr if not self.interactive else sys.stdout)


def _with_default(message: str, default: str) -> str:
    """`Model (hub id or local folder) [org/name]:`: the default shown, not pre-filled (so typing replaces it)."""
    if not default:
        return message
    stem, colon = (message[:-1], ":") if message.endswith(":") else (message, "")
    return f"{stem} [{default}]{colon}"


def _existing_if_local(value: str) -> str | None:
    """An answer that names a local path (by the recipe's own rule) must exist; a hub id passes."""
    from llmtune.recipe.paths import resolve

    try:
        resolve(value, "path", Path("recipe.yaml"))
    except UserError:
        return f"{value} does not exist here (relative to {Path.cwd()}); give an existing path or a hub id"
    return None


def _positive_int(value: str) -> str | None:
    return None if value.strip().isdigit() and int(value) > 0 else "a whole number above 0"


def _size(value: str) -> str | None:
    problem = size_problem("gpu_memory", value)
    return problem and f"{problem}: write e.g. 80GB or 24GiB"


def _detected_gpus() -> tuple[int, str | None]:
    from llmtune.plan.cluster import count_local_gpus
    from llmtune.plan.memory.buffers import GB
    from llmtune.plan.memory.fit import gpu_memory_of_this_machine

    count = count_local_gpus()
    memory = gpu_memory_of_this_machine() if count else None
    return count, (f"{memory / GB:.0f}GB" if memory else None)


CHOICES = {
    "method": ["full", "lora", "qlora"], "dataset_type": DATASET_TYPES, "mixed_precision": ["bf16", "fp16", "no"],
    "interconnect": ["fast", "slow"], "strategy": list(STRATEGIES), "fsdp_version": [1, 2],
    "fsdp_auto_wrap_policy": ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"],
    "fsdp_state_dict_type": ["FULL_STATE_DICT", "SHARDED_STATE_DICT"],
    "pipeline_schedule": ["gpipe", "1f1b", "interleaved_1f1b"], "rdzv_backend": ["static", "c10d", "etcd"],
}  # fmt: skip


def _check_flags(given: dict[str, Any]) -> None:
    for name, allowed in CHOICES.items():
        value = given.get(name)
        if value is not None and value not in allowed:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} {value!r} is not one of {', '.join(map(str, allowed))}")
    check_numbers(given)


def _base_model_check(value: str) -> str | None:
    return _existing_if_local(value) or sft_problem(value)


def ask_all(given: dict[str, Any], ask: Asker, given_preference: dict[str, Any] | None = None,
            ) -> tuple[Answers, Fit, preference.Preference | None]:  # fmt: skip
    """Fill Answers: flags first, then questions (or defaults). Returns the answers, what the strategy question's
    estimate found and the preference answers (None for SFT)."""
    _check_flags(given)
    answers = Answers(**{k: v for k, v in given.items() if v is not None})
    fixed = {k for k, v in given.items() if v is not None}
    named = gpu_count(given.get("gpu_ids") or "all")
    if named and given.get("gpus_per_machine") is None:  # --gpu-ids 0,1: two GPUs per machine, not asked
        answers.gpus_per_machine = named
        fixed.add("gpus_per_machine")

    def want(name: str) -> bool:
        return name not in fixed

    if want("base_model"):
        answers.base_model = ask.text("Model (hub id or local folder):", answers.base_model, _base_model_check)
    sft_flags = not (want("dataset") and want("dataset_type"))
    pref = preference.start(given_preference or {}, answers, ask, want, sft_flags)
    if want("method") and not (pref and pref.sft and pref.sft.adapter is not None):
        answers.method = ask.select("Fine-tuning method:", [("lora", "LoRA (adapters, 16-bit base)"),
                                    ("qlora", "QLoRA (adapters, 4-bit base)"), ("full", "Full fine-tune")], "lora")  # fmt: skip
    if pref:
        preference.ask_data(given_preference or {}, pref, ask, _existing_if_local)
    else:
        _ask_dataset(answers, ask, want)
    gpus, memory = _detected_gpus()
    if want("num_machines"):
        answers.num_machines = int(ask.text("How many machines?", "1", _positive_int))
    if answers.num_machines > 1:
        if want("main_process_ip"):
            answers.main_process_ip = ask.text("IP address of machine rank 0 (the main process):", "",
                                               lambda v: None if v.strip() else "the address the other machines reach")  # fmt: skip
        if not answers.main_process_ip:
            raise UserError(
                "--main-process-ip is required with --num-machines > 1", "give the address of machine rank 0"
            )
        if want("main_process_port"):
            answers.main_process_port = int(ask.text("Rendezvous port on machine rank 0:", "29500", _positive_int))
        if want("interconnect"):
            answers.interconnect = ask.select("Network between the machines:", [
                ("fast", "fast (InfiniBand, RoCE, NVLink across nodes)"), ("slow", "slow (Ethernet)")], "fast")  # fmt: skip
        _ask_rendezvous(answers, ask, want)
    if want("gpus_per_machine"):
        answers.gpus_per_machine = int(ask.text("How many GPUs per machine?", str(gpus or 1), _positive_int))
    if want("gpu_ids"):
        answers.gpu_ids = ask.text("Which GPU ids on each machine (comma separated, or all)?", "all",
                                   lambda v: gpu_ids_problem(v, answers.gpus_per_machine))  # fmt: skip
    answers.gpu_ids = ",".join(i.strip() for i in answers.gpu_ids.split(",")) if gpu_count(answers.gpu_ids) else "all"
    if want("gpu_memory"):
        answers.gpu_memory = ask.text("Memory of one GPU:", memory or answers.gpu_memory, _size)
    if want("mixed_precision"):
        answers.mixed_precision = ask.select("Mixed precision:", [("bf16", "bf16 (Ampere and newer)"),
                                             ("fp16", "fp16 (older GPUs)"), ("no", "no (fp32)")],
                                             answers.mixed_precision)  # fmt: skip
    if want("torch_compile"):  # accelerate config's dynamo question, as the recipe's key
        answers.torch_compile = ask.confirm("Compile the model with torch.compile (inductor)?", False)
    from llmtune.plan.memory.facts import model_positions

    longest = model_positions(answers.base_model)
    if want("sequence_len"):  # the default, cut to what the model was trained on
        answers.sequence_len = min(answers.sequence_len, longest or answers.sequence_len)
        answers.sequence_len = int(ask.text("Sequence length (tokens):", str(answers.sequence_len), _positive_int))
    if longest and answers.sequence_len > longest:
        ask.show(f"note: sequence_len {answers.sequence_len} is beyond the {longest} positions {answers.base_model} "
                 "was trained on (max_position_embeddings): longer rows need rope_scaling or another model")  # fmt: skip
    if want("micro_batch_size"):
        answers.micro_batch_size = int(
            ask.text("Micro-batch size per GPU:", str(answers.micro_batch_size), _positive_int)
        )

    def text_of(answers: Answers) -> str:
        return _recipe_text(answers, pref, Path("recipe.yaml"), None)

    # the estimate is of the recipe as it is written (accumulation, packing, ...), with no strategy's keys
    offered = [key for key in STRATEGIES if not (pref and key in preference.SPLIT_STRATEGIES)]
    fit = choose_strategy(answers, ask, want, text_of, offered, gpus)
    _strategy_details(answers, ask, want)
    offer_async_checkpoint(answers, ask, want, fit, text_of)
    if want("output_dir"):
        default = (preference.default_output_dir(answers, pref) if pref
                   else f"./outputs/{answers.base_model.rstrip('/').split('/')[-1].lower()}-{answers.method}")  # fmt: skip
        answers.output_dir = ask.text("Output folder:", default)
    return answers, fit, pref


def _ask_rendezvous(answers: Answers, ask: Asker, want: Callable[[str], bool]) -> None:
    """accelerate config's "same local network?" and, where not, its rendezvous backend; then how that one meets."""
    if want("same_network") and want("rdzv_backend"):
        answers.same_network = ask.confirm("Are all the machines on the same local network? (no: cloud nodes, or "
                                           "machines that may start late or restart)", True)  # fmt: skip
    if want("rdzv_backend"):
        answers.rdzv_backend = "static" if answers.same_network else ask.select("Rendezvous backend:", [
            ("c10d", "c10d: torchrun's elastic rendezvous on rank 0 (machines join in any order, and may restart)"),
            ("etcd", "etcd: an etcd server outside the job holds the rendezvous"),
            ("static", "static: each machine starts with its fixed rank")], "c10d")  # fmt: skip
    if answers.rdzv_backend == "etcd" and want("rdzv_endpoint"):
        answers.rdzv_endpoint = ask.text("etcd server (host:port, its v2 API on):", answers.rdzv_endpoint or "",
                                         lambda v: None if ":" in v else "host:port")  # fmt: skip
    if answers.rdzv_backend == "etcd" and not answers.rdzv_endpoint:
        raise UserError("--rdzv-backend etcd needs --rdzv-endpoint", "give the etcd server as host:port")
    if answers.rdzv_backend == "c10d" and want("min_machines"):
        answers.min_machines = int(ask.text("Start once how many machines have joined?", str(answers.num_machines),
                                            _positive_int))  # fmt: skip


def _ask_dataset(answers: Answers, ask: Asker, want: Callable[[str], bool]) -> None:
    if want("dataset"):
        answers.dataset = ask.text(
            "Dataset (local .jsonl/.json/.parquet file or hub id):",
            answers.dataset,
            _existing_if_local,
        )
    local = Path(answers.dataset).expanduser()
    guessed, row = (guess_dataset_type(local), first_row(local)) if local.is_file() else (None, None)
    if guessed and want("dataset_type"):
        answers.dataset_type, answers.dataset_extra = guessed
    if want("dataset_type"):
        if ask.interactive and not guessed and row is not None:
            ask.show(f"note: the format of {answers.dataset} can't be told from its first row (fields: "
                     f"{', '.join(row)}); choose it, and map its fields in the written recipe")  # fmt: skip
        answers.dataset_type = ask.select("Dataset format:", [(t, t) for t in DATASET_TYPES], answers.dataset_type)
        if guessed and answers.dataset_type != guessed[0]:
            answers.dataset_extra = {}
    problem = format_mismatch(local, answers.dataset_type, answers.dataset_extra) if local.is_file() else None
    if problem:  # a recipe that validates and then can't read a row: never written
        raise UserError(problem, "pass --dataset-type with the file's format (alpaca, chat_template, completion, "
                        "input_output); for fields of other names, write the datasets entry by hand with a "
                        "mapping (type: {field_instruction: q, field_output: a})")  # fmt: skip


def _strategy_details(answers: Answers, ask: Asker, want: Callable[[str], bool]) -> None:
    """The follow-up questions `accelerate config` asks for DeepSpeed and FSDP, and ours for pipeline."""
    key = answers.strategy
    if key == "zero3_nvme" and want("nvme_path"):
        answers.nvme_path = ask.text("NVMe folder for offload (on every machine):", answers.nvme_path)
    if key.startswith("fsdp"):
        if want("fsdp_version"):
            answers.fsdp_version = int(ask.select("FSDP version:", [("2", "2 (per-parameter sharding, recommended)"),
                                                                    ("1", "1 (flat parameters)")], "2"))  # fmt: skip
        if want("fsdp_auto_wrap_policy"):
            answers.fsdp_auto_wrap_policy = ask.select("Wrap policy:", [
                ("TRANSFORMER_BASED_WRAP", "TRANSFORMER_BASED_WRAP (each decoder layer)"),
                ("SIZE_BASED_WRAP", "SIZE_BASED_WRAP (by parameter count)"), ("NO_WRAP", "NO_WRAP")],
                "TRANSFORMER_BASED_WRAP")  # fmt: skip
        if want("fsdp_state_dict_type"):
            answers.fsdp_state_dict_type = ask.select("Checkpoint state dict:", [
                ("FULL_STATE_DICT", "FULL_STATE_DICT (one file set, gathered on rank 0)"),
                ("SHARDED_STATE_DICT", "SHARDED_STATE_DICT (a shard per rank, faster for big models)")],
                "FULL_STATE_DICT")  # fmt: skip
        if want("fsdp_offload_params"):
            answers.fsdp_offload_params = ask.confirm("Offload parameters and optimizer states to CPU?", False)
    if key == "context_parallel" and want("context_parallel_size"):
        answers.context_parallel_size = int(ask.text("Context-parallel degree (GPUs that split each row; rows are "
                                                     "padded to a multiple of twice it):",
                                                     str(answers.context_parallel_size), _positive_int))  # fmt: skip
    if key == "tensor_parallel" and want("tensor_parallel_size"):
        default = str(answers.tensor_parallel_size if answers.tensor_parallel_size > 1 else answers.gpus_per_machine)
        answers.tensor_parallel_size = int(ask.text("Tensor-parallel degree (GPUs that split each layer; it must "
                                                    "divide the attention and KV heads):", default, _positive_int))  # fmt: skip
    if key == "pipeline":
        if want("pipeline_stages"):
            default = str(max(2, answers.gpus_per_machine))
            answers.pipeline_stages = int(ask.text("Pipeline stages:", default, _positive_int))
        if want("pipeline_schedule"):
            answers.pipeline_schedule = ask.select("Pipeline schedule:", [("1f1b", "1F1B (less activation memory)"),
                                                   ("gpipe", "GPipe"), ("interleaved_1f1b", "interleaved 1F1B (smaller bubble)")],
                                                   "1f1b")  # fmt: skip


def _recipe_text(answers: Answers, pref: preference.Preference | None, output: Path, estimate_line: str | None,
                 ) -> str:  # fmt: skip
    today = date.today().isoformat()
    if pref:
        return preference.recipe_text(answers, pref, str(output), estimate_line, today)
    return recipe_text(answers, str(output), estimate_line, today)


def run_config(given: dict[str, Any], output: Path, yes: bool, force: bool) -> tuple[Path, list[str]]:
    from llmtune.plan.files import atomic_write

    known = {f.name for f in fields(Answers)}
    interactive = not yes
    if interactive and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError("llmtune config asks questions but this is not a terminal",
                        "pass --yes to take the defaults, with flags for the answers you want")  # fmt: skip
    if output.exists() and not force:
        if yes or not Asker(True).confirm(f"{output} exists. Overwrite it?", False):
            raise UserError(f"{output} already exists", "pass --force to overwrite it, or choose another --output")
    ask = Asker(interactive)
    answers, fit, pref = ask_all({k: v for k, v in given.items() if k in known}, ask,
                                 {k: v for k, v in given.items() if k in preference.FLAGS})  # fmt: skip
    # The written recipe must validate and plan for the cluster it was written for, before it is written; its
    # header's estimate is of that plan, as `llmtune train`'s memory check will make it.
    recipe = load_text(_recipe_text(answers, pref, output, None), output, check_files=True)
    try:
        plan = plan_of(recipe, answers)
    except UserError as err:
        raise UserError(f"these answers make a recipe that doesn't plan on {answers.num_machines} x "
                        f"{answers.gpus_per_machine} GPUs, so nothing is written: {err.message}", err.hint) from None  # fmt: skip
    estimate_line, warning = verdict(answers, fit, recipe, plan, str(output))
    if warning:
        ask.show(f"note: {estimate_line}")
    atomic_write(output, _recipe_text(answers, pref, output, estimate_line))
    return output, machine_commands(answers, str(output))
