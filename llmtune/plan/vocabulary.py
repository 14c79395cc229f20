"""Tokens a recipe adds (special_tokens, tokens) against the tokenizer's vocabulary: a token new to it gets a freshly
initialised embedding row, which an adapter trains only if the embedding and output layers are in
lora_modules_to_save. Checked at plan time from the tokenizer.json already on this machine (no torch, nothing
fetched), and again when the tokenizer loads (train/model/load.py), whatever its files."""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.memory.facts import embedding_modules_of, local_config, model_file
from llmtune.recipe.adapter import names_module
from llmtune.recipe.model import ADDITIONAL_SPECIAL_TOKENS


def wanted_tokens(recipe) -> list[tuple[str, str]]:
    """(key, token) for every token the recipe adds, in Axolotl's order: special_tokens, tokens, then
    special_tokens.additional_special_tokens."""
    named = {k: v for k, v in (recipe.special_tokens or {}).items() if k != ADDITIONAL_SPECIAL_TOKENS}
    additional = (recipe.special_tokens or {}).get(ADDITIONAL_SPECIAL_TOKENS) or []
    return [*named.items(), *(("tokens", t) for t in recipe.tokens or []),
            *((ADDITIONAL_SPECIAL_TOKENS, t) for t in additional)]  # fmt: skip


def new_tokens(recipe, known: set[str]) -> list[tuple[str, str]]:
    """The tokens the vocabulary lacks; a new pad token doesn't count: its row is never read by the loss (labels
    and the attention mask leave it out)."""
    return [(key, token) for key, token in wanted_tokens(recipe) if token not in known and key != "pad_token"]


def check_modules_to_save(recipe, new: list[tuple[str, str]], name: str, modules: tuple[str, str],
                          ids: list[int] | None = None, tied: bool = False) -> None:  # fmt: skip
    """Refuse new tokens under an adapter that would leave their embedding rows frozen at random values: the input
    and output embeddings must be in lora_modules_to_save, or their new rows in peft_trainable_token_indices (`ids`:
    the new tokens' ids, known once the tokenizer holds them; a tied output head follows the input embedding)."""
    if not new or not recipe.adapter:
        return
    saved, rows = recipe.lora_modules_to_save or [], getattr(recipe, "peft_trainable_token_indices", None)
    if recipe.lora_model_dir:  # a loaded adapter trains the modules_to_save and token rows it was saved with
        config = _saved_config(recipe.lora_model_dir)
        if config is None:
            return
        saved, rows = list(config.get("modules_to_save") or []), config.get("trainable_token_indices")
    if all(module in saved for module in modules):
        return
    tokens = ", ".join(dict.fromkeys(t for _, t in new))
    if rows is not None:
        if ids is None:
            return  # plan time: the ids exist once the tokenizer adds the tokens, where this runs again
        frozen = untrained_rows(rows, saved, modules, ids, tied)
        if not frozen:
            return
        wanted = ", ".join(f"{module}: {sorted(set(ids) | set(_listed(rows, module, modules) or ()))}"
                           for module in (modules[:1] if tied else modules))  # fmt: skip
        where = f"lora_model_dir: {recipe.lora_model_dir}'s adapter" if recipe.lora_model_dir else \
            "peft_trainable_token_indices"  # fmt: skip
        raise UserError(f"tokens the vocabulary of {name} lacks ({tokens}, ids {sorted(ids)}) have rows in "
                        f"{' and '.join(frozen)} that {where} doesn't train: they would stay frozen at random values",
                        f"set peft_trainable_token_indices: {{{wanted}}}" if not recipe.lora_model_dir else
                        "train a new adapter that trains those rows")  # fmt: skip
    if recipe.lora_model_dir:
        raise UserError(f"tokens the vocabulary of {name} lacks ({tokens}) "
                        f"with lora_model_dir: {recipe.lora_model_dir}, whose adapter doesn't train "
                        f"{' and '.join(modules)} (its modules_to_save): the new embedding rows would train frozen at "
                        "random values", "use tokens the vocabulary has, or train a new adapter with "
                        f"lora_modules_to_save: [{', '.join(modules)}]")  # fmt: skip
    keys = list(dict.fromkeys(key if key == "tokens" else f"special_tokens.{key}" for key, _ in new))
    raise UserError(f"{' and '.join(keys)} add{'s' if len(keys) == 1 else ''} tokens the vocabulary of {name} lacks "
                    f"({tokens}) with adapter: {recipe.adapter}, but lora_modules_to_save doesn't hold "
                    f"{' and '.join(modules)}: their new embedding rows would train frozen at random values",
                    f"set lora_modules_to_save: [{', '.join(modules)}], or peft_trainable_token_indices for their "
                    "rows alone (or use tokens the vocabulary has)")  # fmt: skip


def _listed(rows, module: str, modules: tuple[str, str]) -> list[int] | None:
    """The ids peft's trainable tokens train in `module`: a list names the input embedding's, a mapping names
    modules by name (peft matches the end of the module path)."""
    if isinstance(rows, dict):
        return next((ids for key, ids in rows.items() if names_module(key, module)), None)
    return rows if module == modules[0] else None


def untrained_rows(rows, saved: list[str], modules: tuple[str, str], ids: list[int], tied: bool) -> list[str]:
    """The embedding modules (input, output) in which some of `ids` would not train."""

    def trains(module: str) -> bool:
        return module in saved or set(ids) <= set(_listed(rows, module, modules) or ())

    head = trains(modules[1]) or (tied and trains(modules[0]))
    return [module for module, ok in ((modules[0], trains(modules[0])), (modules[1], head)) if not ok]


def _saved_config(folder: str) -> dict | None:
    try:
        return json.loads((Path(folder) / "adapter_config.json").read_text())
    except (OSError, ValueError, AttributeError):
        return None  # not readable here: peft says so when it loads


def vocabulary_on_disk(name: str) -> set[str] | None:
    """Every token of a tokenizer.json already on this machine (the model's vocabulary and its added tokens), or
    None where there is none to read."""
    found = model_file(name, "tokenizer.json")
    if found is None:
        return None
    try:
        data = json.loads(found.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        known = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}  # Unigram: [token, score]
        known.update(entry["content"] for entry in data.get("added_tokens") or [])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # a format read only by its own tokenizer class: checked when it loads
    return known


def check_new_tokens(recipe) -> None:
    """At plan time: the tokens an adapter recipe adds, against the local tokenizer.json (skipped where the
    tokenizer isn't on this machine yet; the same check runs when it loads)."""
    if not recipe.adapter or not wanted_tokens(recipe):
        return
    name = recipe.tokenizer_config or recipe.base_model
    known = vocabulary_on_disk(name)
    if known is None:
        return
    new = new_tokens(recipe, known)
    if not new:
        return
    model_type = local_config(recipe.base_model_config or recipe.base_model).get("model_type")
    check_modules_to_save(recipe, new, name, embedding_modules_of(model_type))


def _to_32(rows: int) -> int:
    return -(-rows // 32) * 32


def embedding_rows_for(recipe, tokens: int) -> int:
    """The embedding rows a vocabulary of `tokens` needs: rounded up to 32 with resize_token_embeddings_to_32x."""
    return _to_32(tokens) if getattr(recipe, "resize_token_embeddings_to_32x", False) else tokens


def adapter_embedding_rows(folder: str, module: str) -> int | None:
    """The rows of `module` (the input embedding) an adapter folder holds, read from its safetensors header (nothing
    loaded): peft saves an embedding whole when it trained it (modules_to_save) or when the run grew it. None where
    the adapter holds none, or the file can't be read here (peft says so when it loads)."""
    import re

    try:
        with (Path(folder) / "adapter_model.safetensors").open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size)) if 0 < size < 1 << 27 else {}
    except (OSError, ValueError):
        return None
    pattern = re.compile(rf"(^|\.){re.escape(module)}(\.modules_to_save|\.original_module)?\.weight$")
    shapes = [entry.get("shape") for key, entry in header.items() if isinstance(entry, dict) and pattern.search(key)]
    return next((shape[0] for shape in shapes if isinstance(shape, list) and len(shape) == 2), None)


def check_adapter_rows(recipe, rows: int, module: str) -> None:
    """lora_model_dir's saved embedding rows against the `rows` this run's model has once its tokenizer is fitted
    (the tokens it adds, resize_token_embeddings_to_32x): peft refuses to load a different size (a state-dict size
    mismatch from every rank, after the model loaded)."""
    saved = adapter_embedding_rows(recipe.lora_model_dir, module)
    if saved is None or saved == rows:
        return
    if not recipe.resize_token_embeddings_to_32x and saved == _to_32(rows):
        hint = "set resize_token_embeddings_to_32x: true, as the run that trained it had"
    elif recipe.resize_token_embeddings_to_32x and rows % 32 == 0 and rows - 32 < saved < rows:
        hint = "remove resize_token_embeddings_to_32x: the run that trained it hadn't set it"
    else:
        hint = ("use the tokenizer, tokens and special_tokens of the run that trained it (its output folder holds "
                "its tokenizer), and its resize_token_embeddings_to_32x")  # fmt: skip
    size = " (rounded up to 32: resize_token_embeddings_to_32x)" if recipe.resize_token_embeddings_to_32x else ""
    raise UserError(f"lora_model_dir: {recipe.lora_model_dir}'s adapter holds {saved} embedding rows ({module}) but "
                    f"this run's model has {rows}{size}: the adapter was trained on another vocabulary size and "
                    "won't load", hint)  # fmt: skip


def check_adapter_vocabulary(recipe) -> None:
    """At plan time: check_adapter_rows with the rows counted from the local tokenizer.json and config.json (the
    vocabulary the run loads, the tokens it adds); skipped where either isn't on this machine yet (the same check
    runs before peft loads the adapter)."""
    if not recipe.adapter or not recipe.lora_model_dir:
        return
    folder = Path(recipe.lora_model_dir)
    name = recipe.tokenizer_config or (str(folder) if (folder / "tokenizer_config.json").is_file() else None)
    config = local_config(recipe.base_model_config or recipe.base_model)
    vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    known = vocabulary_on_disk(name or recipe.base_model)
    if known is None or not isinstance(vocab_size, int):
        return
    tokens = len(known | {token for _, token in wanted_tokens(recipe)})
    rows = max(vocab_size, embedding_rows_for(recipe, tokens))
    check_adapter_rows(recipe, rows, embedding_modules_of(config.get("model_type"))[0])
