"""What `llmtune train` checks before any process starts: each a question the ranks would answer too late.

A missing tracker would fail in every rank, a finished run would resume at its end and train nothing, and a plan
that can't fit the GPUs would fail after the model loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.errors import UserError, did_you_mean

TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check_trackers(recipe) -> None:
    """A tracker the recipe asks for must be installed: say so before any process starts, not in every rank."""
    import importlib.util

    missing = [name for name in recipe.trackers if importlib.util.find_spec(TRACKER_MODULES[name]) is None]
    if missing:
        raise UserError(f"report_to asks for {', '.join(missing)}, which is not installed",
                        "pip install 'llmtune[trackers]' (or the package itself), or remove it from report_to")  # fmt: skip


def check_local_splits(recipe) -> None:
    """A local dataset folder whose file names say their splits has the split each entry asks for (the ranks would
    find out after the launch, each with its own copy of the error)."""
    from llmtune.train.data.sources import local_files

    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            if Path(spec.path).expanduser().is_dir():
                try:
                    local_files(spec)
                except UserError as err:
                    raise UserError(f"{group}[{index}].split: {err.message}", err.hint) from None


def finished_run(recipe) -> str | None:
    """Rerunning a finished run (same recipe, auto-resume on) trains nothing: say so instead of resuming at the end."""
    from llmtune.recipe.loader import recipe_fingerprint

    metrics_file = Path(recipe.output_dir) / "metrics.json"
    if not recipe.auto_resume_from_checkpoints or not metrics_file.is_file():
        return None
    try:
        metrics = json.loads(metrics_file.read_text())
    except (OSError, ValueError):
        return None
    if metrics.get("recipe_fingerprint") != recipe_fingerprint(recipe):
        return None
    loss = metrics.get("final_loss")
    shown = f", final loss {loss:.4f}" if isinstance(loss, int | float) else ""
    return (f"{recipe.output_dir} already holds this recipe's finished run ({metrics.get('steps')} steps{shown}); "
            "nothing to do. To train again, use another output_dir, remove it, "
            "or set auto_resume_from_checkpoints: false")  # fmt: skip


def async_io_builds() -> bool:
    import contextlib
    import io

    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception:  # no deepspeed at all: the plan's own import fails with its own message
        return True
    with contextlib.redirect_stdout(io.StringIO()):  # its warnings go to stdout; our message replaces them
        return bool(AsyncIOBuilder().is_compatible(verbose=False))


def check_nvme_offload(plan, compatible=async_io_builds) -> None:
    """ZeRO-Infinity swaps to NVMe through DeepSpeed's async_io op, which builds only where libaio and its headers
    are: without them every rank dies after loading the model (measured on an H100 image). Say so first."""
    if plan.offload != "nvme" or plan.cluster.device != "cuda":
        return  # CPU rehearsal runs the NVMe config through DeepSpeed's CPU accelerator, which checks for itself
    if not compatible():
        raise UserError("NVMe offload needs DeepSpeed's async_io op, which can't build on this machine (libaio and "
                        "its headers not found)", "install libaio-dev (apt) or libaio-devel (dnf), or offload to "
                        "cpu (deepspeed: zero3_offload)")  # fmt: skip


def check_deepspeed_schema(recipe, plan) -> None:
    """A user's DeepSpeed JSON checked against DeepSpeed's own ZeRO config model, which forbids unknown keys and
    wrong values: a typo (stage3_prefetch_bucket_sizes) or device "gpu" otherwise stops every rank at start-up.
    llmtune's presets are left alone (they are written from that model's keys)."""
    from llmtune.plan.deepspeed import PRESETS, preset_for_axolotl_file

    config = plan.deepspeed_config
    named = recipe.deepspeed
    if not config or (isinstance(named, str) and (named in PRESETS or preset_for_axolotl_file(named))):
        return
    import contextlib
    import io

    try:
        import pydantic

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import deepspeed  # it announces its accelerator at import: not this command's output
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except Exception:  # no deepspeed here: the ranks' own import names it
        return
    try:
        DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in ("zero_optimization", *first["loc"]))
        where = "the inline deepspeed mapping" if isinstance(named, dict) else f"deepspeed file {named}"
        fields = DeepSpeedZeroConfig.model_fields
        allowed = [f.alias or name for name, f in fields.items()] if first["type"] == "extra_forbidden" else []
        guess = did_you_mean(str(first["loc"][-1]), allowed) if allowed else None
        raise UserError(f"{where}: {key}: {first['msg']} (DeepSpeed {deepspeed.__version__}, installed here, would "
                        "stop every rank at start-up)",
                        f"did you mean {guess}?" if guess else "fix or remove it; DeepSpeed's ZeRO keys are in its "
                        "config docs") from None  # fmt: skip


def memory_check(recipe, plan, gpu_memory: str | None) -> str | None:
    """On GPUs (or when --gpu-memory is given), refuse a plan the estimate says can't fit; else the fit, in words."""
    from llmtune.plan.memory.facts import read_model_facts
    from llmtune.plan.memory.fit import fits_line, gpu_memory_of_this_machine
    from llmtune.plan.memory.table import parse_size_option

    if gpu_memory is not None:
        memory = parse_size_option("--gpu-memory", gpu_memory)
    elif plan.cluster.device == "cuda":
        memory = gpu_memory_of_this_machine()
    else:
        return None  # a CPU rehearsal: nothing to check against
    facts = read_model_facts(recipe.base_model_config or recipe.base_model, fetch=True) if memory else None
    if facts is None:
        return None  # unknown GPU size or model shape: the estimate can't judge, so it doesn't block
    return fits_line(recipe, plan, memory, facts)
