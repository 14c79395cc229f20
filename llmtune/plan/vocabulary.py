"""Tokens a recipe adds (special_tokens, tokens) against the tokenizer's vocabulary: a token new to it gets a freshly
initialised embedding row, which an adapter trains only if the embedding and output layers are in
lora_modules_to_save. Checked at plan time from the tokenizer.json already on this machine (no torch, nothing
fetched), and again when the tokenizer loads (train/model/load.py), whatever its files."""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.memory.facts import local_config, model_file
from llmtune.recipe.adapter import names_module
from llmtune.recipe.model import ADDITIONAL_SPECIAL_TOKENS

# The input and output embedding modules by config model_type (Axolotl's get_linear_embedding_layers)
EMBEDDING_MODULES = {"gpt_neox": ("embed_in", "embed_out"), "falcon": ("word_embeddings", "lm_head"),
                     "nemotron_h": ("embeddings", "lm_head"), "gpt2": ("wte", "lm_head")}  # fmt: skip
DEFAULT_EMBEDDING_MODULES = ("embed_tokens", "lm_head")


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


def embedding_modules_of(model_type: str | None) -> tuple[str, str]:
    """The names of a model type's input and output embedding modules, as lora_modules_to_save wants them."""
    return EMBEDDING_MODULES.get(model_type or "", DEFAULT_EMBEDDING_MODULES)


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
