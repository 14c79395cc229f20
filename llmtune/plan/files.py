"""Write a plan's files: what `llmtune plan --write` and `llmtune train` leave for people to read."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from llmtune.plan.planner import Plan


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that a reader never sees it half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a run's files are meant to be shared
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plan_files(plan: Plan, recipe_dict: dict, recipe_path: str, notes: list[str]) -> dict[str, str]:
    """File name -> text for everything a run's llmtune/ folder holds."""
    files = {
        "plan.json": json.dumps(
            {"plan": plan.to_dict(), "recipe": recipe_dict, "recipe_path": recipe_path, "notes": notes},
            indent=2,
            sort_keys=False,
        )
        + "\n",
        "recipe.resolved.yaml": yaml.safe_dump(recipe_dict, sort_keys=False),
    }
    if plan.accelerate_config:
        files["accelerate_config.yaml"] = yaml.safe_dump(plan.accelerate_config, sort_keys=True)
    if plan.deepspeed_config:
        files["deepspeed.json"] = json.dumps(plan.deepspeed_config, indent=2) + "\n"
    cluster = plan.cluster
    if cluster.launcher == "deepspeed":
        if not cluster.hostfile:
            files["hostfile"] = f"localhost slots={cluster.processes_per_machine}\n"
        files["deepspeed_env"] = deepspeed_env_text(plan.env, os.environ)
    return files


# What the machines DeepSpeed starts over ssh must also see: network and NCCL/gloo settings, caches, offline mode.
FORWARDED_PREFIXES = ("GLOO_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "HF_HOME", "HF_HUB_", "HF_DATASETS_",
                      "TRANSFORMERS_", "CUDA_DEVICE_ORDER", "LLMTUNE_")  # fmt: skip
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASS", "CREDENTIAL", "AUTH", "PRIVATE")
UNSAFE = ("\n", '"', "$", "`", "\\")  # DeepSpeed quotes values with "...": the remote shell would still expand these


def deepspeed_env_text(plan_env: dict[str, str], environ) -> str:
    """DeepSpeed's environment file (DS_ENV_FILE): the plan's variables and the forwarded ones, never a secret."""
    values = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    values.update({k: v for k, v in plan_env.items() if k != "DS_ENV_FILE"})
    lines = [f"{k}={v}" for k, v in sorted(values.items())
             if not any(word in k.upper() for word in SECRET_WORDS) and not any(c in v for c in UNSAFE)]  # fmt: skip
    return "".join(line + "\n" for line in lines)


def write_plan_files(directory: Path, files: dict[str, str]) -> list[Path]:
    written = []
    for name, text in files.items():
        atomic_write(directory / name, text)
        written.append(directory / name)
    return written
