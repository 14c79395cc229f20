"""A model folder's weights, read one tensor at a time and written as size-capped safetensors shards.

What folding an adapter and consolidating a checkpoint share: neither holds two copies of a model. Peak memory
is one output shard plus the tensor being read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llmtune.errors import UserError, reading


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / name for name in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("adapter_")]
    if files:
        return files
    return sorted(folder.glob("pytorch_model*.bin"))


def iter_tensors(folder: Path) -> Iterator[tuple[str, object]]:
    """(name, tensor) over a model folder's weight files, one file open at a time."""
    files = _weight_files(folder)
    if not files:
        raise UserError(f"no model weights in {folder}", "it needs *.safetensors or pytorch_model*.bin files")
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with reading(path), safe_open(str(path), framework="pt") as handle:  # damaged: named, one line
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        else:  # legacy pickles: weights only, memory-mapped
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def read_tensor(folder: Path, wanted: str):
    """One tensor of a model folder."""
    for name, tensor in iter_tensors(folder):
        if name == wanted:
            return tensor
    raise KeyError(wanted)


def base_folder(source: str, revision: str | None = None) -> Path:
    """A local folder with the base model's files (a hub id is fetched or taken from the HF cache)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]))  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the hub raises many kinds; all mean "can't get it"
        raise UserError(f"could not get the base model '{source}' ({str(err).splitlines()[0][:160]})",
                        "check base_model, your network or HF_TOKEN") from None  # fmt: skip


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and RSS would creep up shard by shard)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@dataclass
class ShardWriter:
    """Tensors in, safetensors shards of at most max_bytes out (a bigger tensor gets a shard of its own)."""

    folder: Path
    max_bytes: int
    pending: dict = field(default_factory=dict)
    pending_bytes: int = 0
    written: list[tuple[str, list[str]]] = field(default_factory=list)
    total_bytes: int = 0
    names: set = field(default_factory=set)

    def add(self, name: str, tensor) -> None:
        if name in self.names:
            raise RuntimeError(f"merge: tensor {name} written twice")
        self.names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        part = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / part), metadata={"format": "pt"})
        self.written.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0
        _release_freed_memory()

    def finish(self) -> list[str]:
        self.flush()
        if len(self.written) == 1:
            os.replace(self.folder / self.written[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        count, weight_map, names = len(self.written), {}, []
        for number, (part, keys) in enumerate(self.written, 1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / part, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names
