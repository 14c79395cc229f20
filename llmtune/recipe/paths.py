"""Check the local files and folders a recipe names, and make them absolute.

Relative paths are read from the current directory, as Axolotl does. A name that is not
on disk and doesn't look like a path is taken as a hub id and left for the worker.
"""

from __future__ import annotations

from pathlib import Path

from llmtune.errors import UserError

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt", ".tsv")


def looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith((".gguf", *DATA_SUFFIXES))


def _hub_gguf(name: str) -> bool:
    # "org/repo/file.gguf" names a file in a hub repository.
    return name.endswith(".gguf") and not name.startswith(("/", ".", "~")) and name.count("/") >= 2


def resolve(name: str, key: str, recipe_path: Path, must_be_dir: bool = False) -> str:
    """The absolute path for a local name, the name itself for a hub id; UserError if missing."""
    candidate = Path(name).expanduser()
    if candidate.exists():
        if must_be_dir and not candidate.is_dir():
            raise UserError(f"{recipe_path}: {key}: {name} is a file, expected a folder", "point it at the folder")
        return str(candidate.resolve())
    if looks_local(name) and not _hub_gguf(name):
        raise UserError(f"{recipe_path}: {key}: {name} does not exist", f"relative paths are read from {Path.cwd()}")
    return name


def check_local_paths(recipe, recipe_path: Path) -> None:
    """Replace local names in the recipe by absolute paths, failing on ones that don't exist."""
    recipe.base_model = resolve(recipe.base_model, "base_model", recipe_path)
    for key in ("base_model_config", "tokenizer_config", "lora_model_dir"):
        value = getattr(recipe, key)
        if value:
            setattr(recipe, key, resolve(value, key, recipe_path))
    if recipe.resume_from_checkpoint:
        recipe.resume_from_checkpoint = resolve(
            recipe.resume_from_checkpoint, "resume_from_checkpoint", recipe_path, must_be_dir=True
        )
        if not Path(recipe.resume_from_checkpoint).exists():
            raise UserError(f"{recipe_path}: resume_from_checkpoint: {recipe.resume_from_checkpoint} does not exist")
    if isinstance(recipe.deepspeed, str) and (recipe.deepspeed.endswith(".json") or "/" in recipe.deepspeed):
        from llmtune.plan.deepspeed import preset_for_axolotl_file

        if preset_for_axolotl_file(recipe.deepspeed) is None or Path(recipe.deepspeed).exists():
            recipe.deepspeed = resolve(recipe.deepspeed, "deepspeed", recipe_path)
            if not Path(recipe.deepspeed).is_file():
                raise UserError(
                    f"{recipe_path}: deepspeed: {recipe.deepspeed} does not exist", "give a JSON file or a preset"
                )
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            key = f"{group}[{index}].path"
            spec.path = resolve(spec.path, key, recipe_path)
            base = Path(spec.path)
            if base.is_dir() and spec.data_files:
                files = [spec.data_files] if isinstance(spec.data_files, str) else spec.data_files
                for name in files:
                    if not (base / name).exists() and not Path(name).exists():
                        raise UserError(f"{recipe_path}: {group}[{index}].data_files: {name} not found in {base}")
