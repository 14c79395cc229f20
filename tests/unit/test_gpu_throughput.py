"""benchmarks/gpu_throughput.py's arithmetic and bookkeeping, on CPU: FLOPs and MFU by hand, the rotating order, the
spread, the hash check that refuses other batches, the goal verdicts, the resumable results folder and the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_throughput as bench  # noqa: E402

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "tie_word_embeddings": True, "vocab_size": 128256}  # fmt: skip
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "tie_word_embeddings": False, "vocab_size": 128256}  # fmt: skip


def test_parameter_counts_are_the_published_ones():
    # Llama-3.2-1B and Llama-3.1-8B as their model cards count them
    assert bench.llama_parameters(LLAMA_1B) == 1_235_814_400
    assert bench.llama_parameters(LLAMA_8B) == 8_030_261_248
    assert bench.attention_shape(LLAMA_8B) == (32, 32, 128)


def test_parameter_count_matches_a_built_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=tied))
        assert bench.llama_parameters({**shape, "tie_word_embeddings": tied}) == model.num_parameters()


def test_attention_flops_by_hand():
    # rows of 3 and 5 tokens: causal pairs 3*4/2 + 5*6/2 = 21; x 3 (fwd+bwd) x 2 matmuls x 2 FLOPs = 12 per pair,
    # per layer, head and head dimension
    assert bench.attention_flops([3, 5], layers=2, heads=4, head_dim=8) == 12 * 21 * 2 * 4 * 8
    assert bench.attention_flops([1], 1, 1, 1) == 12  # one token attends to itself
    assert bench.attention_flops([], 16, 32, 64) == 0


def test_matmul_flops_per_token():
    assert bench.flops_per_token("full", 1000, 1000) == 6000
    assert bench.flops_per_token("lora", 1000, 10) == 4 * 1000 + 6 * 10
    assert bench.flops_per_token("qlora", 1000, 10) == 4060


def test_mfu_counts_real_tokens_and_attention_after_the_warmup():
    result = {"method": "full", "base_parameters": 1000, "trainable_parameters": 1000,
              "step_seconds": [9.0, 1.0, 2.0, 2.0], "real_tokens": [50, 100, 100, 100]}  # fmt: skip
    figures = bench.repeat_figures(result, warmup=1, step_attention=[7.0, 10.0, 20.0, 30.0])
    flops = 6000 * 300 + 60  # the warm-up step (9 s, 50 tokens, 7 attention FLOPs) is left out
    assert figures["flops_per_s"] == pytest.approx(flops / 5.0)
    assert figures["tokens_per_s"] == pytest.approx(300 / 5.0)
    assert figures["step_s"] == 2.0
    summary = bench.summarize([figures], peak=1e6)
    assert summary["mfu"] == pytest.approx(flops / 5.0 / 1e6)


def test_rotation_starts_each_repeat_at_the_next_arm():
    arms = ["a", "b", "c"]
    assert [bench.rotation(arms, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                          ["a", "b", "c"]]  # fmt: skip
    order = bench.schedule([("1b", "full"), ("1b", "lora")], {"full": arms, "lora": ["x", "y"]}, repeats=3)
    assert len(order) == 3 * 3 + 2 * 3 == len(set(order))
    assert [arm for _, method, arm, _ in order if method == "lora"] == ["x", "y", "y", "x", "x", "y"]


def test_spread_is_min_to_max_of_the_per_repeat_medians():
    repeats = [{"step_s": s, "tokens_per_s": t, "flops_per_s": 1.0} for s, t in [(0.3, 10), (0.1, 30), (0.2, 20)]]
    summary = bench.summarize(repeats, peak=None)
    assert (summary["step_s"], summary["step_min"], summary["step_max"]) == (0.2, 0.1, 0.3)
    assert (summary["tokens_per_s"], summary["tokens_min"], summary["tokens_max"]) == (20, 10, 30)
    assert summary["mfu"] is None and summary["repeats"] == 3


def result(arm, repeat=0, hashes=("h1", "h2", "h3"), method="full", **extra):
    return {"key": bench.result_name("1b", method, arm, repeat), "arm": arm, "repeat": repeat, "method": method,
            "size": "1b", "batch_hashes": list(hashes), **extra}  # fmt: skip


def test_the_hash_check_refuses_other_batches_and_leaves_packed_arms_out():
    results = [result("plain"), result("llmtune", hashes=("h1", "XX", "h3")), result("plain_flat", 1),
               result("llmtune_packed", hashes=("p1", "p2", "p3")), result("plain_liger_flat", hashes=())]  # fmt: skip
    verdicts = bench.check_rows(results, steps=3)
    assert verdicts["1b-full-plain-r0"] is None and verdicts["1b-full-plain_flat-r1"] is None
    assert "from step 2" in verdicts["1b-full-llmtune-r0"] and "refused" in verdicts["1b-full-llmtune-r0"]
    assert verdicts["1b-full-llmtune_packed-r0"] is None  # other batches by design: compared by tokens/s only
    assert "no batch hashes" in verdicts["1b-full-plain_liger_flat-r0"]
    # a run cut short (fewer steps) does not pass either
    assert bench.check_rows([result("plain"), result("llmtune", hashes=("h1", "h2"))], 3)["1b-full-llmtune-r0"]


def test_hashes_agree_with_llmtune_and_the_plain_script_in_every_layout():
    import hashlib

    import torch
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

    from llmtune.train.engine.trainer import row_tokens

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from tiny import load_tokenizer

    rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    expected = bench.row_hash(rows)

    def llmtune_hash(ids, mask, lengths):  # as LlmtuneTrainer.training_step feeds StepStats
        digest = hashlib.sha256()
        for row in row_tokens(ids, mask, lengths):
            digest.update(row.numpy().tobytes() + b"|")
        return digest.hexdigest()[:16]

    padded = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 12, 13, 0]])
    mask = (torch.arange(4) < torch.tensor([[4], [2], [3]])).long()
    assert llmtune_hash(padded, mask, None) == expected
    assert llmtune_hash(torch.tensor([sum(rows, [])]), None, [4, 2, 3]) == expected
    tokenizer = load_tokenizer()
    for inner in (DataCollatorForLanguageModeling(tokenizer, mlm=False), DataCollatorWithFlattening()):
        recording = bench.Recording(inner)
        recording([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows])
        assert recording.hashes == [expected] and recording.real == [9] and recording.lengths == [[4, 2, 3]]
    assert recording.padded == [9]  # flattened: no pad token computed


def test_goal_verdicts():
    assert bench.verdict(2.1, 2.0, 1.5) == "met"
    assert bench.verdict(1.6, 2.0, 1.5) == "missed (floor 1.5 met)"
    assert bench.verdict(1.2, 2.0, 1.5) == "missed (floor 1.5 missed too)"
    assert bench.verdict(1.2, 1.25) == "missed"
    assert bench.verdict(1.3, 1.25, spread=(1.1, 1.4)) == "met, within the spread of the repeats"
    assert bench.verdict(None, 2.0) == "not measured"


def arm_summary(tps, mfu=None, refused=None):
    return {"tokens_per_s": tps, "tokens_each": [tps * 0.9, tps, tps * 1.1], "mfu": mfu, "refused": refused}


def test_goal_lines_pick_the_fastest_plain_arm_and_skip_refused_ones():
    slices = {
        "1b full": {"plain": arm_summary(100), "plain_flat": arm_summary(150), "plain_liger_flat": arm_summary(140),
                    "llmtune": arm_summary(210), "llmtune_packed": arm_summary(400, mfu=0.47)},
        "1b lora": {"plain": arm_summary(100), "llmtune": arm_summary(120)},
        "1b qlora": {"plain": arm_summary(100), "llmtune": arm_summary(140, refused="other batches")},
    }  # fmt: skip
    goals = {g["goal"]: g for g in bench.goal_lines(slices)}
    assert goals["1b full: llmtune / plain padded"]["value"] == pytest.approx(2.1)
    assert goals["1b full: llmtune / plain padded"]["verdict"] == "met"
    best = goals["1b full: llmtune / best plain arm (plain_flat)"]
    assert best["value"] == pytest.approx(1.4) and best["verdict"] == "met"
    assert goals["1b full: MFU of llmtune packed"]["verdict"] == "missed (floor 0.45 met)"
    assert goals["1b lora: llmtune lora / plain PEFT"]["verdict"] == "missed"
    assert goals["1b qlora: llmtune qlora / plain PEFT"]["verdict"] == "not measured"


def test_without_cuda_one_line_and_nothing_written(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench.main(["--sizes", "1b", "--methods", "full", "--results", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]
    assert not (tmp_path / "bench").exists()


def write_results(folder: Path, arms: dict, repeats: int, steps: int = 6, config=None) -> None:
    """Synthetic results as run_benchmark writes them: each arm's step time, the same rows for unpacked arms."""
    folder.mkdir(parents=True, exist_ok=True)
    model = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip
    hashes = [f"h{i}" for i in range(steps)]
    for arm, seconds in arms.items():
        for repeat in range(repeats):
            packed = bench.ARMS[arm].packed
            r = {"key": bench.result_name("1b", "full", arm, repeat), "size": "1b", "method": "full", "arm": arm,
                 "repeat": repeat, "device": "Fake GPU", "config": config or CONFIG, "model_config": model,
                 "base_parameters": bench.llama_parameters(model), "trainable_parameters": 1, "wall_seconds": 40.0,
                 "step_seconds": [seconds * (1 + 0.1 * repeat)] * steps, "real_tokens": [64] * steps,
                 "padded_tokens": [128] * steps, "batch_hashes": [f"p{i}" for i in range(steps)] if packed else hashes,
                 "peak_bytes": 2**30}  # fmt: skip
            if bench.ARMS[arm].plain:
                r["row_lengths"] = [[32, 32]] * steps
            (folder / f"{r['key']}.json").write_text(json.dumps(r))
    (folder / "peaks.json").write_text(json.dumps([100.0, 120.0]))
    (folder / "lengths-1b-1024.json").write_text(json.dumps([32, 32, 64]))


CONFIG = {"steps": 6, "batch": 8, "seq": 1024, "rows": 2000, "model": "1b"}
REPORT = ["--report", "--sizes", "1b", "--methods", "full", "--steps", "6", "--warmup", "1", "--repeats", "2"]


def test_report_reads_the_results_folder(tmp_path, capsys):
    arms = {"plain": 0.4, "plain_flat": 0.3, "plain_liger_flat": 0.25, "llmtune": 0.2, "llmtune_packed": 0.1}
    write_results(tmp_path / "fake-gpu", arms, repeats=2)
    assert bench.main([*REPORT, "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bf16 matmul peak 120 TFLOP/s (best of 2)" in out
    assert "| llmtune (2) | 0.210 (0.200-0.220) |" in out
    assert "llmtune / plain padded: 2.00x" in out and "goal >= 2x: met" in out
    assert "llmtune / best plain arm (plain_liger_flat): 1.25x" in out
    assert "packed: other batches, compared by real tokens/s only; attention from the data's lengths" in out
    assert "same rows as the reference (hash); attention per row" in out
    assert "incomplete" not in out


def test_report_says_what_is_missing_and_ignores_other_configurations(tmp_path, capsys):
    write_results(tmp_path / "fake-gpu", {"plain": 0.4, "llmtune": 0.2}, repeats=1)
    write_results(tmp_path / "fake-gpu", {"plain_flat": 0.3}, repeats=1, config={**CONFIG, "steps": 99})
    assert bench.main([*REPORT, "--results", str(tmp_path)]) == bench.INCOMPLETE
    out = capsys.readouterr().out
    assert "8 of 10 runs missing" in out and "| plain_flat" not in out
    assert "rerun the benchmark to fill them in" in out


def args_for(tmp_path, **changes) -> SimpleNamespace:
    values = {"steps": 6, "batch": None, "seq": None, "rows": 50, "model": None, "repeats": 2, "warmup": 1,
              "models": tmp_path / "models", "deadline": None, "retry_failed": False, "cpu_rehearsal": True,
              "record": False, "device": None}  # fmt: skip
    return SimpleNamespace(**{**values, **changes})


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    """run_benchmark with its processes replaced: every run returns at once and is counted."""
    ran = []
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**LLAMA_1B, "vocab_size": 100}))

    def fake(spec, work, timeout):
        ran.append(spec["arm"])
        return {"step_seconds": [0.1] * 6, "real_tokens": [10] * 6, "padded_tokens": [20] * 6,
                "batch_hashes": ["h"] * 6, "trainable_parameters": 5, "peak_bytes": None}  # fmt: skip

    monkeypatch.setattr(bench, "run_plain", fake)
    monkeypatch.setattr(bench, "run_llmtune", fake)
    monkeypatch.setattr(bench, "model_folder", lambda size, models: model)
    monkeypatch.setattr(bench, "dataset_lengths", lambda model, data, seq: [10, 20])
    monkeypatch.setattr(bench, "missing_for", lambda arm, method: None)
    return ran


def test_a_rerun_skips_what_is_there_and_the_deadline_stops_it(tmp_path, fake_runs, capsys):
    folder = tmp_path / "bench" / "cpu-rehearsal"
    slices, arms = [("1b", "full")], {"full": ["plain", "llmtune"]}
    args = args_for(tmp_path, deadline=__import__("time").time() + 3600)
    # a deadline too close for one more 1b run (50 s by default): nothing starts, exit 3
    assert bench.run_benchmark(args_for(tmp_path, deadline=__import__("time").time() + 10), slices, arms, folder) == 3
    assert fake_runs == [] and "rerun to continue" in capsys.readouterr().out
    assert bench.run_benchmark(args, slices, arms, folder) == 0
    assert fake_runs == ["plain", "llmtune", "llmtune", "plain"]  # rotating order
    assert sorted(p.name for p in folder.glob("1b-*.json")) == [
        "1b-full-llmtune-r0.json",
        "1b-full-llmtune-r1.json",
        "1b-full-plain-r0.json",
        "1b-full-plain-r1.json",
    ]
    fake_runs.clear()
    assert bench.run_benchmark(args, slices, arms, folder) == 0 and fake_runs == []
    (folder / "1b-full-llmtune-r1.json").unlink()  # lost: only that one runs again
    assert bench.run_benchmark(args, slices, arms, folder) == 0 and fake_runs == ["llmtune"]
    fake_runs.clear()  # another configuration does not count as done
    assert bench.run_benchmark(args_for(tmp_path, steps=8), slices, arms, folder) == 0 and len(fake_runs) == 4


def test_a_missing_package_is_recorded_once_not_retried(tmp_path, fake_runs, monkeypatch):
    monkeypatch.setattr(
        bench, "missing_for", lambda arm, method: "liger-kernel not installed" if "liger" in arm else None
    )
    folder = tmp_path / "bench" / "cpu-rehearsal"
    args = args_for(tmp_path, repeats=1)
    assert bench.run_benchmark(args, [("1b", "full")], {"full": ["plain_liger_flat", "plain"]}, folder) == 0
    saved = json.loads((folder / "1b-full-plain_liger_flat-r0.json").read_text())
    assert saved["error"] == "not run: liger-kernel not installed" and fake_runs == ["plain"]
    fake_runs.clear()
    assert bench.run_benchmark(args, [("1b", "full")], {"full": ["plain_liger_flat", "plain"]}, folder) == 0
    assert fake_runs == []
