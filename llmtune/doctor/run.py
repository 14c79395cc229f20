"""The launcher side of `llmtune doctor`: the training plan with the doctor in place of the trainer, launched the
way `llmtune train` launches it (same check-in, ports, rendezvous), then judged on machine 0."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from llmtune.doctor import checks, report


def doctor_plan(recipe, cluster):
    """The recipe's plan, its files under <output_dir>/llmtune/doctor/, every rank running `llmtune.doctor`."""
    from llmtune.plan import make_plan

    config_dir = Path(recipe.output_dir) / "llmtune" / "doctor"
    plan = make_plan(recipe, cluster, config_dir=str(config_dir))
    plan.commands = [[("llmtune.doctor" if part == "llmtune.train" else part) for part in command]
                     for command in plan.commands]  # fmt: skip
    return plan


def needs(recipe, plan) -> tuple[float | None, float | None]:
    """(GPU bytes a rank needs, bytes of one checkpoint) from llmtune's estimate; None where the model's config
    can't be read here."""
    from llmtune.errors import UserError
    from llmtune.plan.memory.fit import model_facts_for, row_for_plan
    from llmtune.plan.memory.peak import estimate as rows_for
    from llmtune.plan.memory.states import trainable_parameters

    try:
        facts = model_facts_for(recipe)
    except UserError:
        return None, None
    name = row_for_plan(plan)
    rows = {r.name: r for r in rows_for(recipe, facts, plan.data_parallel_size, plan.cluster.processes_per_machine)}
    row = rows.get(name)
    # a checkpoint: the weights (fp32 master copy) and the optimizer's two moments of every trainable parameter
    checkpoint = 4.0 * facts.total_params() + 8.0 * trainable_parameters(recipe, facts)
    return (row.total if row is not None else None), checkpoint


def run_doctor(loaded, cluster, rdzv_timeout: float, json_output: bool, verbose: bool = False,
               quick: bool = False) -> int:  # fmt: skip
    """Launch the doctor's ranks, judge their reports on machine 0; 0 when healthy, 2 with problems. `quick` (the
    train preflight): no bandwidth measured."""
    import os

    from llmtune.launch.runner import run
    from llmtune.plan.files import plan_files, write_plan_files

    started = time.time()
    if quick:
        os.environ["LLMTUNE_DOCTOR_QUICK"] = "1"
    plan = doctor_plan(loaded.recipe, cluster)
    folder = Path(plan.config_dir)
    if (
        cluster.machine_rank == 0
    ):  # an earlier doctor's tokens and report (other machines' ranks write after the check-in)
        for stale in [*folder.glob("token-*"), folder / "doctor.json"]:
            stale.unlink(missing_ok=True)
    write_plan_files(folder, plan_files(plan, loaded.recipe.model_dump(mode="json"), "doctor", loaded.notes))
    print(f"[llmtune] doctor: {plan.world_size} rank(s) on {cluster.num_machines} machine(s), launched as "
          f"`llmtune train` would launch them", file=sys.stderr, flush=True)  # fmt: skip
    code = run(plan, [], rdzv_timeout, verbose=verbose)
    if code:
        return code
    if cluster.machine_rank != 0:
        print("[llmtune] doctor: this machine's ranks reported to machine 0, which prints the verdict",
              file=sys.stderr, flush=True)  # fmt: skip
        return 0
    written = json.loads((folder / "doctor.json").read_text())
    gpu_bytes, checkpoint_bytes = needs(loaded.recipe, plan)
    problems, notes = checks.findings(written["reports"], written["plan"], gpu_bytes, checkpoint_bytes)
    seconds = time.time() - started
    if json_output:
        print(json.dumps({"healthy": not problems, "seconds": round(seconds, 1),
                          "problems": [vars(p) for p in problems], "notes": notes,
                          "reports": written["reports"]}, indent=1))  # fmt: skip
    else:
        for line in report.machine_lines(written["reports"]) + report.collective_lines(written["reports"]):
            print(line)
        for line in report.verdict_lines(problems, notes, seconds):
            print(line)
    shutil.copyfile(folder / "doctor.json", folder / "doctor-last.json")
    return 2 if problems else 0
