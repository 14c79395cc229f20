"""Write a plan's files: what `llmtune plan --write` and `llmtune train` leave for people to read.

Also the write helpers the commands share (atomic_write, make_folder, writing): a path that can't be written is one
line naming it (a UserError), with nothing half-written left behind."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from llmtune.errors import UserError

if TYPE_CHECKING:
    from llmtune.plan.planner import Plan


def write_error(path: Path, err: OSError) -> UserError:
    """One line for a file or folder that can't be written: the path, the system's reason, what to do."""
    if err.errno == errno.EISDIR:
        return UserError(f"can't write {path} (it is a folder)", "give a file name, not a folder")
    if err.errno in (errno.ENOTDIR, errno.EEXIST):
        return UserError(f"can't write {path} (a file is in the way: a folder was expected)",
                         "choose another path, or move that file away")  # fmt: skip
    reason = (err.strerror or type(err).__name__).lower()
    # a folder on the way (mkdir -p) is named; the temporary file beside the target is not
    where = f" at {err.filename}" if err.filename and Path(err.filename) in Path(path).parents else ""
    return UserError(f"can't write {path} ({reason}{where})", "choose a path in a folder you can write to")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError from writing `path` into one line naming it (a UserError)."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err) from None


def make_folder(path: Path) -> None:
    """mkdir -p, or one line saying why not."""
    with writing(path):
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
        path.mkdir(parents=True, exist_ok=True)


def check_writable(path: Path) -> None:
    """Before long work whose result goes to `path` (infer's generations): one line now, not after the work, when
    it can't be written there. Probes with a temporary file in the nearest folder that exists; makes nothing."""
    path = Path(path)
    with writing(path):
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
        folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(folder))
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that a reader never sees it half-written; one line (a UserError) when it can't be."""
    path = Path(path)
    tmp = None
    with writing(path):
        try:
            if path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a run's files are meant to be shared
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(tmp, path)
            tmp = None
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


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
    make_folder(directory)
    written = []
    for name, text in files.items():
        atomic_write(directory / name, text)
        written.append(directory / name)
    return written
