"""Turn a GGUF file into a plain, trainable Hugging Face checkpoint, cached by content hash.

transformers loads GGUF weights but flags the model as quantized, so the Trainer refuses to
train it and ``save_pretrained`` refuses to save it. We rebuild it once as an ordinary
float32 safetensors checkpoint (with the tokenizer and chat template) and reuse that.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from llmtune.errors import UserError

MARKER = "llmtune-gguf.json"  # written last; a cache folder without it is never used
HASH_INDEX = "sha256-index.json"
_CHUNK = 1 << 20
# Temp folders older than this are leftovers of a crash, not a build in progress.
_STALE_TMP_SECONDS = 6 * 3600


def default_cache_root() -> Path:
    """``$LLMTUNE_CACHE/gguf``, else ``~/.cache/llmtune/gguf``."""
    base = os.environ.get("LLMTUNE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "llmtune") / "gguf"


def file_sha256(path: Path, index: Path | None = None) -> str:
    """sha256 of a file, remembered in ``index`` by (path, size, mtime) so a big file is read once."""
    stat = path.stat()
    key, stamp = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
    entries: dict = {}
    if index is not None and index.is_file():
        try:
            entries = json.loads(index.read_text())
        except (OSError, ValueError):
            entries = {}  # a damaged index only costs a re-hash
    if entries.get(key, {}).get("stamp") == stamp:
        return entries[key]["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    if index is not None:
        entries[key] = {"stamp": stamp, "sha256": sha}
        _write_text_atomic(index, json.dumps(entries, indent=1))
    return sha


def materialize_gguf(gguf_path: str | Path, cache_root: Path | None = None) -> Path:
    """Return a folder holding ``gguf_path`` as a plain HF checkpoint, building it on first use.

    The folder is ``<cache_root>/<sha256 of the file>``; it appears atomically, complete or not at all.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise UserError(f"GGUF file not found: {gguf_path}", hint="check base_model / the file path")
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    sha = file_sha256(gguf_path, root / HASH_INDEX)
    final = root / sha
    if (final / MARKER).is_file():
        return final

    _remove_stale_tmp(root, sha)
    # Same parent as the final folder, so the rename below is atomic (same filesystem).
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{sha[:16]}-", dir=root))
    try:
        _build_checkpoint(gguf_path, tmp)
        info = {"source": str(gguf_path), "sha256": sha, "dtype": "float32", "created": time.time()}
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
        if final.exists() and not (final / MARKER).is_file():
            # Not made by us: we only ever rename complete folders into place.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process (e.g. another rank) finished first; its copy is as good as ours.
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_checkpoint(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = gguf_path.parent, gguf_path.name
    # dequantize=True: with the `kernels` package installed, transformers would otherwise keep
    # packed GGUF blocks in special modules, and their state dict is not a plain one.
    # float32: Q4/Q8 blocks dequantize to fp16-scale x int (+ fp16 offset), which bf16 cannot hold
    # exactly; float32 keeps the rebuilt model bit-identical to the GGUF one.
    loaded = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    config = copy.deepcopy(loaded.config)
    # The config serialises quantization_config whenever the attribute exists, even as None.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()  # tied embeddings (e.g. SmolLM2) must stay one tensor, not two copies
    model.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded
    model.save_pretrained(out, safe_serialization=True)
    # The tokenizer (vocab, merges, special tokens, chat template) lives in the GGUF metadata.
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def _remove_stale_tmp(root: Path, sha: str) -> None:
    now = time.time()
    for leftover in root.glob(f".tmp-{sha[:16]}-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
