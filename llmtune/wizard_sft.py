"""What `llmtune config`'s conversation (wizard.py) stands on:

- the supervised run a preference step starts from (`llmtune config --base-model <an llmtune output_dir>`): its
  resolved recipe and what it saved (a LoRA adapter or a full model); a folder with no model yet is refused;
- the flags' numbers, sizes and GPU ids, checked before anything is estimated;
- the fit: the estimate the strategy question shows is of the recipe text as it will be written (no strategy keys),
  and the header's figure is of the written recipe's plan, the row `llmtune train`'s memory check reads
  (planned_row), so the wizard, `llmtune estimate` and `llmtune train` see one recipe. Where the planner takes
  background checkpoints is asked of the planner."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.recipe.writer import ROW_TO_STRATEGY, STRATEGIES, Answers


@dataclass
class SftResult:
    folder: str  # as the user gave it
    recipe: dict  # the SFT run's resolved recipe
    adapter: dict | None  # adapter_config.json; None for a full model

    @property
    def base(self) -> str:
        """What the adapter was trained on: the SFT recipe's base_model (a GGUF file stays one), else peft's record."""
        return self.recipe.get("base_model") or (self.adapter or {}).get("base_model_name_or_path") or self.folder

    def describe(self) -> str:
        return f"a LoRA adapter on {self.base}" if self.adapter is not None else "a full model"


def read_sft_result(name: str) -> SftResult | None:
    """The llmtune run a base-model answer names, or None when it names none."""
    folder = Path(name).expanduser()
    plan_file = folder / "llmtune" / "plan.json"
    if not plan_file.is_file():
        return None
    try:
        recipe = json.loads(plan_file.read_text()).get("recipe") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"--base-model {name}: llmtune/plan.json can't be read ({err})",
                        "point at a run's output_dir") from None  # fmt: skip
    if recipe.get("num_labels") or recipe.get("reward_model") or recipe.get("process_reward_model"):
        return None  # a reward model scores texts; it is no policy to train on preferences
    if (folder / "adapter_config.json").is_file():
        return SftResult(name, recipe, json.loads((folder / "adapter_config.json").read_text()))
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return SftResult(name, recipe, None)
    raise UserError(f"--base-model {name} is an llmtune run folder with no saved model yet (no adapter_config.json, "
                    "no config.json with safetensors)", "point at a finished run's output_dir")  # fmt: skip


def sft_problem(name: str) -> str | None:
    """For the base-model question: a run folder that holds no model yet is refused in place."""
    try:
        read_sft_result(name)
    except UserError as err:
        return err.message
    return None


# --- the answers' numbers, checked before anything is estimated ---------------------------------------------------

# flag -> (the least it takes, what it is): a flag below it is one line naming the flag, before any estimate
LEAST = {
    "num_machines": (1, "the machines in the job, e.g. 1"),
    "min_machines": (1, "the machines that must join before training starts, e.g. 2"),
    "gpus_per_machine": (1, "the GPUs each machine trains on, e.g. 8"),
    "main_process_port": (1, "a TCP port on machine rank 0, e.g. 29500"),
    "sequence_len": (1, "tokens per row, e.g. 2048"),
    "micro_batch_size": (1, "rows per GPU per step, e.g. 1 or 2"),
    "pipeline_stages": (2, "2 or more (one stage is no pipeline)"),
    "tensor_parallel_size": (2, "2 or more GPUs that split each layer"),
    "context_parallel_size": (2, "2 or more GPUs that split each row"),
}
# (least, most) bytes: outside them the answer is a slip of units (a bare number is GB: 1e11 meant bytes)
SIZES = {"gpu_memory": (1e9, 10e12, "one GPU"), "cpu_memory": (1e9, 100e12, "one machine's CPU memory")}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def size_problem(name: str, text: str) -> str | None:
    """Why a size answer can't be a GPU's (or a machine's) memory, or None."""
    from llmtune.plan.memory.table import parse_size

    try:
        size = parse_size(text)
    except ValueError:
        return f"{text!r} is not a size"
    least, most, what = SIZES[name]
    if not least <= size <= most:
        return f"{text!r} is {size / 1e9:.3g} GB, not the memory of {what} (a bare number is GB)"
    return None


def gpu_ids_problem(text: str, count: int | None) -> str | None:
    """GPU ids are distinct indices, as many as the GPUs each machine trains on ("all": every GPU), or None."""
    ids = [part.strip() for part in text.split(",")]
    if text.strip().lower() in ("all", ""):
        return None
    if not all(part.isascii() and part.isdigit() for part in ids):
        return f"{text!r} is not a comma-separated list of GPU indices (0,1,...) or all"
    if len(set(map(int, ids))) < len(ids):
        return f"{text!r} names a GPU twice"
    if count is not None and len(ids) != count:
        return f"{text!r} names {len(ids)} GPU(s), and each machine trains on {count} (--gpus-per-machine)"
    return None


def check_numbers(given: dict[str, Any]) -> None:
    """The flags' numbers, sizes and GPU ids: one line naming the flag (nothing estimated or written yet)."""
    for name, (least, what) in LEAST.items():
        value = given.get(name)
        if value is not None and value < least:
            raise UserError(f"{flag(name)} {value} is below {least}", f"give {what}")
    port = given.get("main_process_port")
    if port is not None and port > 65535:
        raise UserError(f"--main-process-port {port} is not a TCP port", "give one from 1 to 65535, e.g. 29500")
    for name in SIZES:
        problem = given.get(name) is not None and size_problem(name, given[name])
        if problem:
            raise UserError(f"{flag(name)} {problem}", "write e.g. 80GB or 24GiB")
    ids = given.get("gpu_ids")
    problem = ids is not None and gpu_ids_problem(ids, given.get("gpus_per_machine"))
    if problem:
        raise UserError(f"--gpu-ids {problem}", "give as many distinct indices as --gpus-per-machine (e.g. 0,1), "
                        "or all")  # fmt: skip


def gpu_count(ids: str) -> int | None:
    """How many GPUs an answer of ids names (None: all)."""
    return None if ids.strip().lower() in ("all", "") else len(ids.split(","))


# --- the estimate and the plan of the recipe the wizard writes ----------------------------------------------------


@dataclass
class Fit:
    """What the strategy question showed: the estimate of the recipe as it is written, without a strategy."""

    facts: Any = None  # ModelFacts; None: the model's config can't be read here
    recommended: str | None = None  # a STRATEGIES key; None: no estimate, or nothing fits
    reason: str = ""


def load_text(text: str, path: Path, check_files: bool = False):
    """The Recipe a recipe text is; its refusals said as the answers' (the file isn't written)."""
    import yaml

    from llmtune.recipe.loader import recipe_from_mapping

    try:
        return recipe_from_mapping(yaml.safe_load(text), path, check_files=check_files).recipe
    except UserError as err:
        message = err.message.removeprefix(f"{path}: ")
        raise UserError(f"these answers make a recipe that doesn't validate, so nothing is written: {message}",
                        err.hint) from None  # fmt: skip


def plan_of(recipe, answers: Answers):
    """The plan of the recipe on the cluster it is written for (GPUs), as `llmtune train` would make it there."""
    from llmtune.plan import make_cluster, make_plan

    cluster = make_cluster(answers.gpus_per_machine * answers.num_machines, answers.num_machines, 0,
                           answers.main_process_ip, answers.main_process_port, "cuda")  # fmt: skip
    return make_plan(recipe, cluster)


def report_of(recipe, answers: Answers, facts):
    """`llmtune estimate` of the recipe on the answers' cluster."""
    from llmtune.plan.memory.fit import report_for
    from llmtune.plan.memory.table import parse_size

    cpu = parse_size(answers.cpu_memory) if answers.cpu_memory else None
    return report_for(recipe, facts, answers.gpus_per_machine, answers.num_machines, parse_size(answers.gpu_memory),
                      cpu, answers.interconnect)  # fmt: skip


def nothing_fits(report, answers: Answers) -> tuple[str, str]:
    """Why no strategy fits (the message), and what would help (the hint)."""
    from llmtune.plan.memory.buffers import FIT_FRACTION, GB

    least = min(report.rows, key=lambda row: row.total)
    remedy = report.remedy
    if least.fits(report.gpu_memory):
        remedy = f"machines with more CPU memory, {remedy}"
        why = (f"the strategies that fit the GPUs offload more than the {report.cpu_memory / GB:.0f} GB of CPU memory "
               "each machine has")  # fmt: skip
    else:
        why = (f"the least any strategy needs is {least.total / GB:.1f} GB per GPU ({least.strategy}), above "
               f"{FIT_FRACTION:.0%} of {report.gpu_memory / GB:.0f} GB")  # fmt: skip
    return (f"nothing fits: {answers.method} fine-tuning of {answers.base_model} on {answers.num_machines} machine(s) "
            f"x {answers.gpus_per_machine} GPU(s) of {report.gpu_memory / GB:.0f} GB: {why}"), remedy  # fmt: skip


def verdict(answers: Answers, fit: Fit, recipe, plan, recipe_path: str) -> tuple[str, bool]:
    """The recipe header's line on memory, from the estimate of the written recipe's plan (the row `llmtune train`'s
    memory check reads), and whether it is a warning."""
    from llmtune.plan.memory.buffers import FIT_FRACTION, GB
    from llmtune.plan.memory.fit import planned_row

    label = STRATEGIES[answers.strategy][0]
    if fit.facts is None:
        return (
            f"No memory estimate: the config of {answers.base_model} can't be read here (not local, not cached, "
            f"Hub unreachable), so {label} is the default, not a recommendation. Check it where the config can be "
            f"read: llmtune estimate {recipe_path} --gpus-per-machine {answers.gpus_per_machine} --num-machines "
            f"{answers.num_machines} --gpu-memory {answers.gpu_memory}",
            False,
        )  # said on the console already
    report = report_of(recipe, answers, fit.facts)
    row = planned_row(report, plan)
    figure = f"{row.total / GB:.1f} GB per GPU of {report.gpu_memory / GB:.0f} GB"
    recommended = fit.recommended and STRATEGIES[fit.recommended][0]
    chosen = "Chosen" + (f" instead of the recommended {recommended}" if recommended else " (nothing fits, so none "
                         "is recommended)")  # fmt: skip
    if answers.strategy == fit.recommended:  # (a plan's row may differ from the table's: FSDP2's HSDP, offloads)
        chosen = f"Recommended because {fit.reason}"
    if report.fits(row):
        unchecked = ("" if row.cpu <= 0 or report.cpu_memory is not None else
                     f"; it holds about {row.cpu / GB:.0f} GB in each machine's CPU memory (not checked: no CPU "
                     "memory given)")  # fmt: skip
        held = (f"; it holds about {row.cpu / GB:.0f} GB of each machine's {report.cpu_memory / GB:.0f} GB of CPU "
                "memory" if row.cpu > 0 and report.cpu_memory is not None else unchecked)  # fmt: skip
        if answers.strategy == fit.recommended:
            return f"Estimated {figure}; recommended because {fit.reason}{held}.", bool(unchecked)
        return f"{chosen}; estimated {figure}, which fits{held}.", bool(unchecked)
    if row.fits(report.gpu_memory):
        problem = (f"{row.strategy} holds about {row.cpu / GB:.0f} GB in each machine's CPU memory, which has "
                   f"{report.cpu_memory / GB:.0f} GB")  # fmt: skip
    else:
        problem = (f"estimated {figure}, which does NOT fit (llmtune refuses above {FIT_FRACTION:.0%}, "
                   f"{FIT_FRACTION * report.gpu_memory / GB:.1f} GB)")  # fmt: skip
    better = report.choice
    instead = (f"{better[0].strategy} would fit (--strategy {ROW_TO_STRATEGY.get(better[0].name, '?')})" if better
               else f"nothing fits on these GPUs: {report.remedy}")  # fmt: skip
    if better and ROW_TO_STRATEGY.get(better[0].name) == answers.strategy:  # the table and the plan's row disagree
        instead = (f"the estimate table's {better[0].strategy} row, {better[0].total / GB:.1f} GB, fits, but the "
                   "memory check reads the row of the plan")  # fmt: skip
    return (f"{chosen}; {problem}: `llmtune train` refuses to launch it (its memory check) unless given "
            f"--no-memory-check; {instead}.", True)  # fmt: skip


def this_machines_cpu_memory(gpus_here: int) -> str:
    """The CPU-memory question's default: where this machine has GPUs (the job likely runs here), its memory, which
    `llmtune train`'s memory check reads; else none (not checked)."""
    from llmtune.plan.memory.buffers import GB
    from llmtune.plan.memory.fit import cpu_memory_of_this_machine

    memory = cpu_memory_of_this_machine() if gpus_here else None
    return f"{memory / GB:.0f}GB" if memory else ""


def _report(answers: Answers, drafts: list, facts):
    """The estimate of the recipe as written without a strategy (packed), or, where the recipe as written for context
    parallelism (rows not packed, which it needs) is recommended context parallelism, that one's."""
    reports = [report_of(draft, answers, facts) for draft in drafts]
    split = reports[-1].choice
    return reports[-1] if split is not None and split[0].name == "context parallel" else reports[0]


def choose_strategy(answers: Answers, ask, want: Callable[[str], bool], text_of: Callable[[Answers], str],
                    offered: list[str], gpus_here: int) -> Fit:  # fmt: skip
    """The estimate of the recipe as it is written (every strategy's row), the recommended strategy preselected; the
    CPU memory asked where the recommendation offloads to it. With --yes and no --strategy, nothing fitting is a
    refusal: a recipe that `llmtune train` would refuse isn't written unasked."""
    from dataclasses import replace

    from llmtune.plan.memory.facts import read_model_facts
    from llmtune.plan.memory.table import print_estimate

    asking = want("strategy")
    bare = replace(answers, strategy="ddp", async_checkpoint=False)  # no strategy's keys
    drafts = [load_text(text_of(bare), Path("recipe.yaml"))]
    if "context_parallel" in offered:  # its degree left to the estimate
        drafts.append(load_text(text_of(replace(bare, strategy="context_parallel", context_parallel_size=1)),
                                Path("recipe.yaml")))  # fmt: skip
    fit = Fit(read_model_facts(drafts[0].base_model_config or drafts[0].base_model, fetch=True))
    default = "ddp"
    if fit.facts is None:
        ask.show(f"note: no estimate: the config of {answers.base_model} can't be read here (not local, not cached, "
                 "Hub unreachable); DDP is the default, not a recommendation, and the recipe's header says so")  # fmt: skip
    else:
        report = _report(answers, drafts, fit.facts)
        if report.choice and report.choice[0].cpu > 0 and not answers.cpu_memory and want("cpu_memory"):
            answers.cpu_memory = ask.text("CPU memory of one machine (the recommended strategy offloads to it; "
                                          "Enter alone: not checked):", this_machines_cpu_memory(gpus_here),
                                          lambda v: size_problem("cpu_memory", v) if v.strip() else None) or None  # fmt: skip
            report = _report(answers, drafts, fit.facts) if answers.cpu_memory else report
        if asking:
            print_estimate(report)
        if report.choice is not None:
            row, fit.reason = report.choice
            key = ROW_TO_STRATEGY.get(row.name)
            fit.recommended = key if key in offered else None  # (a row the wizard doesn't offer here: none)
            default = fit.recommended or default
            degree = row.strategy.split("(")[-1].split("-")[0]  # "... (8-way)": the degree the estimate used
            if row.name == "tensor parallel" and want("tensor_parallel_size"):
                answers.tensor_parallel_size = int(degree)
            if row.name == "context parallel" and want("context_parallel_size"):
                answers.context_parallel_size = int(degree)
        else:
            message, remedy = nothing_fits(report, answers)
            if asking and not ask.interactive:
                raise UserError(f"{message}; nothing written", f"{remedy}; or give --strategy to write one anyway "
                                "(`llmtune train` refuses it unless --no-memory-check)")  # fmt: skip
            ask.show(f"note: {message}; the recipe's header will say so")
            rows = {ROW_TO_STRATEGY[r.name]: r.total for r in report.rows if r.name in ROW_TO_STRATEGY}
            default = min((key for key in offered if key in rows), key=rows.__getitem__, default="ddp")
    if asking:
        choices = [(key, STRATEGIES[key][0] + ("  [recommended]" if key == fit.recommended else "")) for key in offered]
        answers.strategy = ask.select("Distributed strategy:", choices, default)
    return fit


ASYNC_FROM_PARAMETERS = 1e9  # a full fine-tune's synchronous save stops every GPU for a while from here on


def offer_async_checkpoint(answers: Answers, ask, want: Callable[[str], bool], fit: Fit,
                           text_of: Callable[[Answers], str]) -> None:  # fmt: skip
    """Background checkpoints (async_checkpoint), offered for large full fine-tunes where the written recipe's plan
    takes them (the planner refuses them under DeepSpeed, FSDP1 and pipelines) and the CPU memory given holds their
    copy; yes by default there."""
    from dataclasses import replace

    from llmtune.plan.memory.fit import planned_row

    if not want("async_checkpoint") or answers.method != "full" or fit.facts is None:
        return
    if fit.facts.total_params() < ASYNC_FROM_PARAMETERS:
        return
    trial = replace(answers, async_checkpoint=True)
    try:
        recipe = load_text(text_of(trial), Path("recipe.yaml"))
        plan = plan_of(recipe, trial)
    except UserError:  # the planner's rule, not a copy of it
        return
    if trial.cpu_memory:
        report = report_of(recipe, trial, fit.facts)
        if planned_row(report, plan).cpu > report.cpu_memory:
            return
    size = fit.facts.total_params() * 16 / 2**30  # fp32 weights and Adam's two moments: what a checkpoint writes
    answers.async_checkpoint = ask.confirm(
        f"Write checkpoints in the background (async_checkpoint)? A synchronous save stops every GPU while about "
        f"{size:.0f} GB are written; in the background they stop only for the copy to host memory", True)  # fmt: skip
