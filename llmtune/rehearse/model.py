"""The shrunken model a rehearsal trains, and the tokenizer it uses.

The real model's config.json comes from a local folder, the HF cache, one fetch of config.json from the Hub, or
llmtune's table of known shapes (a GGUF file: its metadata); never its weights. The shrunken copy gets random
weights (fixed seed) and is cached by its config, so a second rehearsal starts at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from llmtune.errors import UserError
from llmtune.plan.shrink import FullConfig, read_full_config

MARKER = "llmtune-shrunk.json"  # written last: a folder without it is never used
SEED = 0
FORMAT = 1  # bump when the folder's layout or the weights' initialisation changes


def cache_root() -> Path:
    base = os.environ.get("LLMTUNE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "llmtune") / "rehearsal"


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection to the Hub (no retries): the libraries' own retries take about a minute to give up."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class TokenizerChoice:
    location: str  # what the ranks load (the recipe's tokenizer_config in the rehearsal)
    real: bool  # False: a stand-in, said in the report
    note: str


def _gguf_parts(recipe) -> tuple[FullConfig, str]:
    """A GGUF base: its config and its tokenizer come from the file's metadata (no tensor is read)."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(recipe.base_model)
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}", "rehearse reads a local .gguf file's metadata only")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    config.pop("quantization_config", None)
    folder = cache_root() / "gguf-tokenizers" / hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    if not (folder / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    return FullConfig(config, f"the GGUF file's metadata: {path}"), str(folder)


def full_config(recipe, online: bool) -> tuple[FullConfig, str | None]:
    """(the real config, the tokenizer folder a GGUF file holds, else None)."""
    if recipe.base_model.endswith(".gguf") and not recipe.base_model_config:
        return _gguf_parts(recipe)
    name = recipe.base_model_config or recipe.base_model
    found = read_full_config(name, fetch=online)
    if found is None:
        raise UserError(f"can't read the config of {name}: not a local folder, not in the HF cache, not in llmtune's "
                        f"table of known models{', and the Hub did not answer' if online else ', and offline'}",
                        "point base_model_config at a local config.json (only the config is needed, no weights)")  # fmt: skip
    return found, None


def _input_widths(shrunk) -> set[int]:
    """The input widths of the shrunken model's linear layers: hidden, attention output, the MLPs' (experts too)."""
    from llmtune.plan.shrink import text_config

    facts = shrunk.shrunk
    widths = {facts.hidden_size, facts.num_heads * facts.head_dim, facts.intermediate_size,
              facts.expert_intermediate_size, facts.shared_intermediate_size}  # fmt: skip
    text = text_config(shrunk.config)
    widths |= {value for key, value in text.items() if key.endswith("intermediate_size") and isinstance(value, int)}
    return widths - {0}


def shrink_for(recipe, config: dict, needed: int, hidden: int | None, layers: int | None, multiple: int = 1,
               split: int = 1) -> tuple[object, list[str]]:  # fmt: skip
    """The shrink (plan.shrink.shrink_config) with the sizes the recipe's own keys need, so that no refusal is the
    shrink's: layers for lisa_n_layers to choose from, widths in whole groups of qat.group_size. Returns (the
    shrunken config, notes saying what was raised and why)."""
    from llmtune.plan.shrink import shrink_config

    notes = []
    lisa = recipe.lisa_n_layers or 0
    if lisa >= max(needed, layers or 0):  # one more than LISA trains: it still chooses, as among the real layers
        notes.append(f"lisa_n_layers: {lisa}: the shrunken model keeps {lisa + 1} layers (LISA chooses {lisa} of "
                     "them each interval, as it does among the real layers)")  # fmt: skip
        layers = lisa + 1
    block = recipe.qat.block if recipe.qat else 0
    shrunk = shrink_config(config, needed, hidden, layers, multiple, split)
    if block <= 1 or all(width % block == 0 for width in _input_widths(shrunk)):
        return shrunk, notes
    # the smallest hidden size, from the asked one up, whose every input width splits into whole groups
    start = max(hidden or shrunk.shrunk.hidden_size, block)
    for candidate in range(-(-start // block) * block, 64 * block + 1, block):
        trial = shrink_config(config, needed, candidate, layers, multiple, split)
        if all(width % block == 0 for width in _input_widths(trial)):
            shrunk = trial
            break
    else:  # every projection's width in whole groups: always possible, sometimes wider
        shrunk = shrink_config(config, needed, hidden, layers, math.lcm(multiple, block), split)
    notes.append(f"qat: groups of {block}: the shrunken model's hidden size is {shrunk.shrunk.hidden_size} (every "
                 f"layer's input width a multiple of {block}, as the real model's are)")  # fmt: skip
    return shrunk, notes


def _cached_locally(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "tokenizer_config.json"), str)


# a folder holding none of these has no tokenizer (e.g. a config.json-only folder kept for the shapes)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt", "sentencepiece.bpe.model", "tiktoken.model")  # fmt: skip


def holds_tokenizer(folder: Path) -> bool:
    """Whether a local folder holds tokenizer files (a file, e.g. a .gguf, is taken at its word)."""
    return not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES)


def choose_tokenizer(recipe, gguf_tokenizer: str | None, stand_in: str | None, online: bool) -> TokenizerChoice:
    """The recipe's own tokenizer when it can be had (local, cached, or online), else the stand-in asked for."""
    name = recipe.tokenizer_config or gguf_tokenizer or recipe.base_model
    local = Path(name).expanduser()
    if local.exists() and not holds_tokenizer(local):
        if stand_in is None:
            raise UserError(f"{name} is a local folder without tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, "
                            "...): no tokenizer to rehearse with", "point tokenizer_config at the real tokenizer, or "
                            "pass --stand-in-tokenizer DIR to rehearse with another (labelled a stand-in in the "
                            "report)")  # fmt: skip
        return _stand_in(stand_in, f"the recipe's {name} holds no tokenizer files")
    if local.exists() or online or _cached_locally(name):
        where = "local" if local.exists() else "HF cache" if not online else "the Hub"
        if name == gguf_tokenizer:
            return TokenizerChoice(name, True, f"the recipe's tokenizer, from {recipe.base_model}'s metadata")
        return TokenizerChoice(name, True, f"the recipe's tokenizer: {name} ({where})")
    if stand_in is None:
        raise UserError(f"the tokenizer of {name} is not available offline (not local, not in the HF cache, the Hub "
                        "is unreachable)", f"fetch it once with network (`hf download {name} --include 'tokenizer*' "
                        "--include '*.json'`), or pass --stand-in-tokenizer DIR to rehearse with another tokenizer "
                        "(labelled a stand-in in the report)")  # fmt: skip
    return _stand_in(stand_in, f"the recipe's {name} is not available offline")


def _stand_in(stand_in: str, why: str) -> TokenizerChoice:
    if not Path(stand_in).is_dir():
        raise UserError(f"--stand-in-tokenizer {stand_in} is not a folder", "pass a folder saved by save_pretrained")
    return TokenizerChoice(str(Path(stand_in).resolve()), False,
                           f"STAND-IN tokenizer {stand_in}: {why}; token counts, chat template and special tokens "
                           "are the stand-in's, not the real run's")  # fmt: skip


def load_rehearsal_tokenizer(recipe, choice: TokenizerChoice):
    """The tokenizer exactly as the ranks will load it (llmtune.train.model.load.load_tokenizer)."""
    from llmtune.train.model.load import load_tokenizer

    return load_tokenizer(recipe.model_copy(update={"tokenizer_config": choice.location}), choice.location)


def _key(config: dict) -> str:
    payload = json.dumps({"config": config, "seed": SEED, "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def materialise(config: dict, label: str, tokenizer=None) -> Path:
    """A folder with the shrunken model (config + random safetensors weights), built once per config."""
    config = dict(config)
    if tokenizer is not None:  # special-token ids the config may lack (configs synthesised from the table)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, key, None)
            if config.get(key) is None and value is not None and value < config.get("vocab_size", 0):
                config[key] = value
    slug = "".join(c if c.isalnum() or c in "-._" else "-" for c in label.split("/")[-1])[:60]
    final = cache_root() / f"{slug}-{_key(config)}"
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        _build(config, tmp)
        (tmp / MARKER).write_text(json.dumps({"from": label, "seed": SEED}, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another rehearsal built it first: same config, same seed, same weights
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(config: dict, folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (folder / "config.json").write_text(json.dumps(config, indent=2))
    try:
        loaded = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(loaded, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as err:
        raise UserError(f"can't build a model of type {config.get('model_type')!r} from its config "
                        f"({str(err).splitlines()[0][:160]})",
                        "rehearse needs an architecture this transformers version knows (no remote code)") from None  # fmt: skip
    model.save_pretrained(folder, safe_serialization=True)
