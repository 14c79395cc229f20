"""Check the local files and folders a recipe names, and make them absolute.

Relative paths are read from the current directory, as Axolotl does. A name that is not
on disk and doesn't look like a path is taken as a hub id and left for the worker.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from llmtune.errors import UserError

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt", ".tsv")


def looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith((".gguf", *DATA_SUFFIXES))


def _hub_gguf(name: str) -> bool:
    # "org/repo/file.gguf" names a file in a hub repository.
    return name.endswith(".gguf") and not name.startswith(("/", ".", "~")) and name.count("/") >= 2


# Axolotl ships these DeepSpeed files in its repository; a recipe naming one that isn't on disk gets the preset with
# the same stage and offload (read from the files, v0.4.0 to v0.18.0: zero2*.json offload the optimizer to CPU;
# zero3_bf16_cpuoffload_params.json the parameters only). Precision follows the recipe, not the files' bf16.
AXOLOTL_FILES = {
    "zero1": "zero1", "zero1_torch_compile": "zero1", "zero2": "zero2_offload", "zero2_torch_compile": "zero2_offload",
    "zero3": "zero3", "zero3_bf16": "zero3", "zero3_bf16_cpuoffload_all": "zero3_offload",
    "zero3_bf16_cpuoffload_params": "zero3_offload_params",
}  # fmt: skip


def preset_for_axolotl_file(name: str) -> str | None:
    """'deepspeed_configs/zero3_bf16.json' -> 'zero3' for Axolotl's shipped files that aren't on disk."""
    if not name.endswith(".json") or on_disk(name, "deepspeed"):
        return None
    return AXOLOTL_FILES.get(Path(name).stem)


def on_disk(name: str, key: str, recipe_path: Path | None = None) -> Path | None:
    """`name` as a path when something exists there, else None; a name no file system takes is a UserError.

    Too long a name (ENAMETOOLONG), a NUL byte or `~user` for a user this machine lacks would otherwise end in a
    traceback from the first stat().
    """
    try:
        candidate = Path(name).expanduser()
        return candidate if candidate.exists() else None
    except (OSError, ValueError, RuntimeError) as err:
        reason = getattr(err, "strerror", None) or str(err).split(":")[0]
        where = f"{recipe_path}: " if recipe_path else ""
        raise UserError(f"{where}{key}: not a usable path ({reason}; {len(name)} characters)",
                        "give an existing file or folder, or a hub id") from None  # fmt: skip


def resolve(name: str, key: str, recipe_path: Path, must_be_dir: bool = False) -> str:
    """The absolute path for a local name, the name itself for a hub id; UserError if missing."""
    candidate = on_disk(name, key, recipe_path)
    if candidate is not None:
        if must_be_dir and not candidate.is_dir():
            raise UserError(f"{recipe_path}: {key}: {name} is a file, expected a folder", "point it at the folder")
        return str(candidate.resolve())
    if looks_local(name) and not _hub_gguf(name):
        hint = "check the path" if Path(name).is_absolute() else f"relative paths are read from {Path.cwd()}"
        raise UserError(f"{recipe_path}: {key}: {name} does not exist", hint)
    return name


def is_glob(name: str) -> bool:
    """A data_files name with wildcards, which `datasets` (and Axolotl through it) expands."""
    return any(char in name for char in "*?[")


def check_output_dir(value: str, recipe_path: Path | None, key: str = "output_dir") -> None:
    """output_dir is a folder, or can be made one: no file on the way, and the nearest existing folder writable."""
    import os

    where = f"{recipe_path}: " if recipe_path else ""
    try:
        path = Path(value).expanduser().absolute()
    except RuntimeError:  # ~user for a user this machine lacks
        raise UserError(f"{where}{key}: not a usable path (no home folder for {value.split('/')[0]} here)",
                        "give a folder llmtune can create") from None  # fmt: skip
    for folder in (path, *path.parents):
        try:
            exists = folder.exists()
        except OSError:
            exists = False
        if not exists:
            continue
        if not folder.is_dir():
            raise UserError(f"{where}{key}: {folder} is a file, not a folder", f"point {key} at a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"{where}{key}: {path} can't be created ({folder} is not writable)",
                            f"point {key} at a folder you can write")  # fmt: skip
        return


def check_checkpoint_kind(folder: Path, adapter: str | None, recipe_path: Path | None) -> None:
    """A checkpoint resumes the kind of run that saved it: an adapter's with an adapter, a whole model's without one
    (the optimizer state of the one doesn't fit the other: the Trainer fails after loading everything).
    `recipe_path` None: the checkpoint auto-resume found in output_dir."""
    where = f"{recipe_path}: resume_from_checkpoint: {folder}" if recipe_path else f"{folder} (auto-resume)"
    saved_adapter = (folder / "adapter_config.json").is_file()
    whole_model = (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))
    if saved_adapter and not adapter:
        raise UserError(f"{where} was saved by a LoRA run, and this recipe "
                        "trains the whole model", "resume it with the adapter settings it was trained with, or start "
                        "from a merged model (llmtune merge) as base_model")  # fmt: skip
    if adapter and whole_model and not saved_adapter:
        raise UserError(f"{where} was saved by a full fine-tune, and this "
                        f"recipe trains a {adapter} adapter", "use that folder as base_model for a new adapter, or "
                        "resume it without adapter:")  # fmt: skip


def check_not_an_adapter(folder: Path, recipe_path: Path) -> None:
    """base_model naming a LoRA adapter's folder (an SFT run's output): transformers would load the adapter's base
    with it attached, and a new adapter would train from the base (the SFT weights dropped), or a full fine-tune find
    nothing to train. Refused in one line with the two ways to go on from it."""
    import json

    config = folder / "adapter_config.json"
    if not config.is_file() or (folder / "config.json").is_file():
        return
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path") or "its base model"
    except (OSError, ValueError):
        base = "its base model"
    raise UserError(f"{recipe_path}: base_model: {folder} is a LoRA adapter (adapter_config.json, trained on {base}), "
                    "not a model", f"to go on training it: base_model: {base}, lora_model_dir: {folder} and adapter: "
                    f"lora; to train from its weights: llmtune merge {folder} first, then base_model: the merged "
                    "folder")  # fmt: skip


# `datasets`' file readers, named as a dataset's path with data_files (path: json)
BUILDERS = ("json", "jsonl", "csv", "parquet", "arrow", "text")


def one_split_only(label: str, split: str | None, where) -> UserError | None:
    """A local file (or a builder's data_files) is one split, 'train': any other split names nothing in it."""
    if (split or "train").split("[", 1)[0].strip() == "train":
        return None
    return UserError(f"{label}.split: '{split}': {where} is read as one split, 'train' (Axolotl's load_dataset "
                     "raised for any other)", "remove split, take a slice (split: train[90%:]), or point path at a "
                     "folder whose file names say the splits (train.jsonl, test.jsonl)")  # fmt: skip


def adapter_trained_on(folder: str | Path, base_model: str) -> str | None:
    """The base an adapter folder says it was trained on (its adapter_config.json), where that names another model
    than `base_model` by its last name (a hub id and its download, or a moved folder, are the same model); else None."""
    try:
        named = json.loads((Path(folder) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return named if named and Path(str(named)).name != Path(str(base_model)).name else None


def check_adapter_folder(recipe, recipe_path: Path) -> None:
    """lora_model_dir is an adapter (peft fails deep in loading on a merged or fully fine-tuned model folder), and
    not, for a preference or RL run, the folder the run writes into (the adapter it starts from is its reference)."""
    folder = Path(recipe.lora_model_dir) if recipe.lora_model_dir else None
    if folder is None or not folder.is_dir():
        return
    if not (folder / "adapter_config.json").is_file():
        model = (folder / "config.json").is_file()
        raise UserError(f"{recipe_path}: lora_model_dir: {folder} holds no adapter (adapter_config.json)"
                        + (": it is a whole model (a merged or fully fine-tuned folder)" if model else ""),
                        f"train on from it as base_model: {folder} (without lora_model_dir)" if model else
                        "point lora_model_dir at a LoRA run's output_dir or a saved adapter")  # fmt: skip
    if recipe.rl and folder.resolve() == Path(recipe.output_dir).expanduser().resolve():
        raise UserError(f"{recipe_path}: output_dir is lora_model_dir ({folder}): rl: {recipe.rl} would overwrite the "
                        "adapter it starts from, which is also its reference (eval could not measure against it)",
                        "give this run its own output_dir")  # fmt: skip


def check_output_apart(recipe, recipe_path: Path) -> None:
    """output_dir is not a folder the run reads: the base model's (its weights would be overwritten) or a local
    dataset folder's (or one inside it: the next run would read the saved model's files as data)."""
    try:
        out = Path(recipe.output_dir).expanduser().resolve()
    except (OSError, ValueError, RuntimeError):
        return  # not a usable path: check_output_dir says so
    if looks_local(recipe.base_model) and Path(recipe.base_model).is_dir() and Path(recipe.base_model).resolve() == out:
        raise UserError(f"{recipe_path}: output_dir is base_model ({out}): the run would overwrite the model it "
                        "starts from", "give the run its own output_dir")  # fmt: skip
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            folder = Path(spec.path).expanduser()
            if folder.is_dir() and (out == folder.resolve() or folder.resolve() in out.parents):
                raise UserError(f"{recipe_path}: output_dir {out} is in {group}[{index}].path ({folder}): the saved "
                                "model's files would be read as data by the next run", "give the run an output_dir "
                                "outside the data folder")  # fmt: skip


def check_local_paths(recipe, recipe_path: Path) -> None:
    """Replace local names in the recipe by absolute paths, failing on ones that don't exist."""
    check_output_dir(recipe.output_dir, recipe_path)
    recipe.base_model = resolve(recipe.base_model, "base_model", recipe_path)
    check_not_an_adapter(Path(recipe.base_model), recipe_path)
    for key in ("base_model_config", "tokenizer_config", "lora_model_dir"):
        value = getattr(recipe, key)
        if value:
            setattr(recipe, key, resolve(value, key, recipe_path))
    check_adapter_folder(recipe, recipe_path)
    if recipe.dataset_prepared_path:
        check_output_dir(recipe.dataset_prepared_path, recipe_path, "dataset_prepared_path")
    if recipe.resume_from_checkpoint:
        in_output = Path(recipe.output_dir).expanduser() / recipe.resume_from_checkpoint
        if (
            not Path(recipe.resume_from_checkpoint).is_absolute()
            and not on_disk(recipe.resume_from_checkpoint, "resume_from_checkpoint", recipe_path)
            and in_output.is_dir()
        ):
            raise UserError(f"{recipe_path}: resume_from_checkpoint: {recipe.resume_from_checkpoint} does not exist "
                            f"in {Path.cwd()}", f"did you mean {in_output}? (relative paths are read from the "
                            "current folder, as Axolotl reads them)")  # fmt: skip
        recipe.resume_from_checkpoint = resolve(
            recipe.resume_from_checkpoint, "resume_from_checkpoint", recipe_path, must_be_dir=True
        )
        if not Path(recipe.resume_from_checkpoint).exists():
            raise UserError(f"{recipe_path}: resume_from_checkpoint: {recipe.resume_from_checkpoint} does not exist")
        check_checkpoint_kind(Path(recipe.resume_from_checkpoint), recipe.adapter, recipe_path)
    if isinstance(recipe.deepspeed, str) and (recipe.deepspeed.endswith(".json") or "/" in recipe.deepspeed):
        if on_disk(recipe.deepspeed, "deepspeed", recipe_path) or preset_for_axolotl_file(recipe.deepspeed) is None:
            recipe.deepspeed = resolve(recipe.deepspeed, "deepspeed", recipe_path)
            if not Path(recipe.deepspeed).is_file():
                raise UserError(
                    f"{recipe_path}: deepspeed: {recipe.deepspeed} does not exist", "give a JSON file or a preset"
                )
    rewards = (recipe.trl or {}).get("reward_funcs")
    if isinstance(rewards, list):  # a reward model's folder (module.function names are the loader's to import)
        from llmtune.recipe.user_code import looks_like_function

        for index, name in enumerate(rewards):
            if isinstance(name, str) and (not looks_like_function(name) or on_disk(name, "trl.reward_funcs")):
                rewards[index] = resolve(name, f"trl.reward_funcs[{index}]", recipe_path)
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            key = f"{group}[{index}].path"
            spec.path = resolve(spec.path, key, recipe_path)
            base = Path(spec.path)
            refused = one_split_only(f"{group}[{index}]", spec.split, base) if base.is_file() else None
            if refused:
                raise UserError(f"{recipe_path}: {refused.message}", refused.hint)
            if base.is_dir() and spec.data_files:
                files = [spec.data_files] if isinstance(spec.data_files, str) else spec.data_files
                for name in files:
                    where = f"{group}[{index}].data_files"
                    if is_glob(name) and glob.glob(str(base / name), recursive=True):
                        continue  # a glob, as `datasets` expands it
                    if not on_disk(str(base / name), where, recipe_path) and not on_disk(name, where, recipe_path):
                        raise UserError(f"{recipe_path}: {group}[{index}].data_files: {name} not found in {base}")
            elif spec.path in BUILDERS and spec.data_files:  # path: json with local data_files (Axolotl's usual form)
                files = [spec.data_files] if isinstance(spec.data_files, str) else spec.data_files
                for name in files:
                    if "://" in name or (is_glob(name) and glob.glob(name, recursive=True)):
                        continue  # a URL (the hub route reads it), or a glob that matches
                    if not Path(name).expanduser().exists():
                        raise UserError(f"{recipe_path}: {group}[{index}].data_files: {name} does not exist"
                                        + (" (no file matches the pattern)" if is_glob(name) else ""),
                                        "relative paths are read from the folder llmtune runs in, as Axolotl "
                                        "reads them")  # fmt: skip
    check_output_apart(recipe, recipe_path)
