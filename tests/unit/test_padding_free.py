"""Padding-free batches (llmtune/recipe/batches.py, train/model/varlen.py, FlatCollator): on the CPU, the exact per-row
path gives each row the logits it has alone, the loss and gradients of padded batches, and no row attends to
another (packed examples included); sliding windows and grouped-query heads keep their maths. torch's varlen kernel
itself runs on CUDA only: tests/gpu/test_varlen_gpu.py checks it against this path."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import tiny_llama_config

from llmtune.errors import UserError
from llmtune.recipe.batches import PADDED, PADDING_FREE, VARLEN_ATTENTION, resolve_batches
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.data.collate import REAL_TOKENS, ROW_LENGTHS, Collator, FlatCollator
from llmtune.train.data.formats import IGNORE
from llmtune.train.data.packing import pack_examples


def recipe(**keys):
    mapping = {"base_model": "m", "datasets": [{"path": "x", "type": "alpaca"}], **keys}
    return recipe_from_mapping(mapping, Path("r.yaml"), check_files=False).recipe


def rows_of(lengths: list[int], vocab: int = 100, seed: int = 0) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": ([IGNORE, IGNORE] + ids[2:])[:n]})
    return rows


def tiny(attention: str = "sdpa", sliding_window: int | None = None, seed: int = 0):
    import torch
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from llmtune.train.model import varlen

    torch.manual_seed(seed)
    if sliding_window:
        model = MistralForCausalLM(MistralConfig(vocab_size=100, num_hidden_layers=2, hidden_size=32,
                                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                                 sliding_window=sliding_window))  # fmt: skip
    else:
        model = LlamaForCausalLM(tiny_llama_config(100, hidden=32, intermediate=64, max_position_embeddings=64))
    model.config.use_cache = False
    varlen.register()
    model.set_attn_implementation(attention)
    return model


def flat(rows, **kwargs) -> dict:
    batch = FlatCollator(0, **kwargs)(rows)
    batch.pop(REAL_TOKENS), batch.pop(ROW_LENGTHS)
    return batch


def test_the_flat_batch_is_the_rows_concatenated_with_their_boundaries():
    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    batch = FlatCollator(0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, 9]]  # no row's first token is predicted
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and "attention_mask" not in batch
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and str(batch["cu_seq_lens_q"].dtype) == "torch.int32"
    assert batch["max_length_q"] == 3 and isinstance(batch["max_length_q"], int)  # host values: no device sync
    assert batch[REAL_TOKENS] == 5 and batch[ROW_LENGTHS] == [3, 2]
    fixed = FlatCollator(0, sequence_len=4)(rows)  # pad_to_sequence_len: rows x sequence_len tokens
    assert fixed["input_ids"].shape == (1, 8) and fixed["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert fixed["labels"][0, 5:].tolist() == [IGNORE] * 3 and fixed[REAL_TOKENS] == 5


def test_each_row_gets_the_logits_it_has_alone_and_the_padded_loss_and_gradients():
    import torch

    rows = rows_of([9, 4, 13, 1, 7])
    reference, model = tiny("sdpa"), tiny(VARLEN_ATTENTION)
    padded = Collator(0)(rows)
    padded.pop(REAL_TOKENS)
    batch = flat(rows)
    out = model(**batch)
    want = reference(**padded)
    assert out.loss.item() == pytest.approx(want.loss.item(), abs=1e-5)
    start = 0
    with torch.no_grad():
        for row in rows:
            n = len(row["input_ids"])
            alone = reference(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            assert torch.allclose(out.logits[0, start : start + n], alone, atol=1e-5, rtol=0)
            start += n
    out.loss.backward()
    want.loss.backward()
    for (name, got), mine in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got.grad, mine.grad, atol=1e-5, rtol=0), name


def test_rows_never_attend_to_each_other_even_packed():
    """Change every token of the other rows: a row's logits don't move (an exact-isolation check)."""
    import torch

    model = tiny(VARLEN_ATTENTION)
    examples = rows_of([5, 3, 6, 4, 2])
    packed, _ = pack_examples(examples, capacity=11, seed=0)
    packed = [packed[i] for i in range(len(packed))]
    batch = flat(packed)
    with torch.no_grad():
        logits = model(**batch).logits[0]
        bounds = batch["cu_seq_lens_q"].tolist()
        assert len(bounds) - 1 == len(examples)  # each packed example is a segment of its own
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            other = batch["input_ids"].clone()
            other[0, :start] = (other[0, :start] + 7) % 100
            other[0, end:] = (other[0, end:] + 11) % 100
            moved = model(**{**batch, "input_ids": other}).logits[0]
            assert torch.equal(moved[start:end], logits[start:end]), f"segment {start}:{end} saw its neighbours"
            if start:  # a control that can fail: the same change without boundaries leaks into the segment
                leaky = model(input_ids=other, position_ids=torch.arange(other.shape[1])[None]).logits[0]
                assert not torch.allclose(leaky[start:end], logits[start:end], atol=1e-3)


def test_sliding_window_and_pad_segment_keep_the_maths():
    import torch

    reference, model = tiny("sdpa", sliding_window=4), tiny(VARLEN_ATTENTION, sliding_window=4)
    rows = rows_of([9, 6])
    batch = flat(rows, sequence_len=10)
    with torch.no_grad():
        got = model(**batch).logits[0]
        start = 0
        for row in rows:
            n = len(row["input_ids"])
            alone = reference(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            assert torch.allclose(got[start : start + n], alone, atol=1e-5)
            start += n


def test_ulysses_batches_find_each_example_and_padding_from_position_ids():
    """Context parallelism under DeepSpeed: padded rows (packed or not) with position_ids and no mask, as DeepSpeed's
    Ulysses hands them to the attention after its all-to-all. Each example gets the logits it has alone, whatever
    the other examples and rows hold."""
    import torch

    from llmtune.train.data.collate import WHOLE_BATCH
    from llmtune.train.model.varlen import boundaries

    reference, model = tiny("sdpa"), tiny(VARLEN_ATTENTION)
    examples = rows_of([5, 3, 6, 4, 2, 7])
    packed, _ = pack_examples(examples[:5], capacity=11, seed=0)
    rows = [packed[i] for i in range(len(packed))] + [examples[5]]  # packed rows, and a row of one example
    batch = Collator(0, multiple_of=4, mask=False, positions=True)(rows)
    whole, _ = batch.pop(WHOLE_BATCH), batch.pop(REAL_TOKENS)
    width = batch["input_ids"].shape[1]
    assert whole[1] == width and width % 4 == 0 and "attention_mask" not in batch
    assert batch["position_ids"][-1].tolist() == [*range(7), *range(width - 7)]  # padding: an example of its own
    edges, longest = boundaries(batch["position_ids"])
    assert edges[0] == 0 and edges[-1] == batch["input_ids"].numel() and longest == max(width - 7, 7, *[
        len(r["input_ids"]) for r in examples[:5]])  # fmt: skip
    with torch.no_grad():
        logits = model(**batch).logits
        for index, row in enumerate(rows):
            positions = batch["position_ids"][index].tolist()
            starts = [i for i, p in enumerate(positions) if p == 0] + [width]
            for start, end in zip(starts[:-1], starts[1:], strict=True):
                if end > len(row["input_ids"]) >= start:
                    end = len(row["input_ids"])  # the padding segment after the row's last example
                if end <= start:
                    continue
                alone = reference(input_ids=batch["input_ids"][index : index + 1, start:end]).logits[0]
                assert torch.allclose(logits[index, start:end], alone, atol=1e-5), (index, start, end)
        # the control that can fail: the same batch read as whole rows (no boundaries) leaks across examples
        leaky = model(input_ids=batch["input_ids"]).logits
        assert not torch.allclose(leaky[0], logits[0], atol=1e-3)
    # the loss and gradients are the padded, masked batch's
    masked = Collator(0)(rows)
    masked.pop(REAL_TOKENS)
    got, want = model(**batch), reference(**masked)
    assert got.loss.item() == pytest.approx(want.loss.item(), abs=1e-5)


def test_the_plan_decides_padding_free_and_its_kernel():
    r = recipe()
    gpu = resolve_batches(r, "cuda", "bf16", None, flash_installed=False)
    assert (gpu.layout, gpu.kernel, gpu.attention) == (PADDING_FREE, "torch_varlen", VARLEN_ATTENTION)
    flash = resolve_batches(recipe(flash_attention=True), "cuda", "bf16", None, flash_installed=True)
    assert (flash.kernel, flash.attention) == ("flash_attn", "flash_attention_2")
    cpu = resolve_batches(r, "cpu", "no", None, flash_installed=False)
    assert cpu.kernel == "sdpa_per_row" and "CUDA only" in cpu.reason
    fp32 = resolve_batches(r, "cuda", "no", None, flash_installed=False)
    assert fp32.kernel == "sdpa_per_row" and "bf16 or fp16" in fp32.reason
    for keys, why in (({"batch_flattening": False}, "batch_flattening: false"),
                      ({"rl": "dpo", "datasets": [{"path": "x", "type": "chatml.intel"}]}, "TRL"),
                      ({"neftune_noise_alpha": 5}, "neftune"), ({"attn_implementation": "eager"}, "eager")):  # fmt: skip
        padded = resolve_batches(recipe(**keys), "cuda", "bf16", None, flash_installed=False)
        assert padded.layout == PADDED and why in padded.reason, keys
    assert resolve_batches(r, "cuda", "bf16", "pipeline", False).layout == PADDED
    assert resolve_batches(r, "cuda", "bf16", None, False, mesh={"context_parallel": 2}).layout == PADDED
    with pytest.raises(UserError, match="batch_flattening: true can't run here: neftune"):
        resolve_batches(recipe(batch_flattening=True, neftune_noise_alpha=5), "cuda", "bf16", None, False)
    assert recipe(batch_flattening="auto").batch_flattening == "auto"


def test_models_whose_attention_cant_read_flat_batches_are_named():
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from llmtune.train.model import varlen

    assert varlen.unsupported(tiny()) is None
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=100, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=64, head_dim=16))  # fmt: skip
    assert "soft-caps" in varlen.unsupported(gemma)
    assert varlen.apply(gemma, VARLEN_ATTENTION) is False and gemma.config._attn_implementation != VARLEN_ATTENTION

    class MambaMixer(torch.nn.Module):
        pass

    hybrid = tiny()
    hybrid.model.layers[0].mixer = MambaMixer()
    assert "mixes tokens outside attention" in varlen.unsupported(hybrid)
    # found by running two packed rows against one alone per family: MiniMax's lightning (linear) attention mixed
    # them (0.055 in the logits), and transformers' Nemotron layer drops the row boundaries before its attention
    # (0.78): both now take padded batches
    linear = tiny()
    linear.config.model_type = "minimax"
    assert "minimax mixes tokens outside attention" in varlen.unsupported(linear)
    from transformers import NemotronConfig, NemotronForCausalLM

    nemotron = NemotronForCausalLM(NemotronConfig(vocab_size=100, num_hidden_layers=1, hidden_size=32,
                                                  num_attention_heads=2, num_key_value_heads=1,
                                                  intermediate_size=64))  # fmt: skip
    assert "NemotronDecoderLayer doesn't pass the batch's row boundaries on to its attention" in varlen.unsupported(
        nemotron
    )


def test_torch_compile_traces_the_padding_free_path():
    """torch.compile (aot_eager here: inductor needs a compiler toolchain per shape; the GPU tier runs inductor) over
    flat batches of changing lengths gives the eager loss and gradients."""
    import torch

    model = tiny(VARLEN_ATTENTION)
    compiled = torch.compile(model, backend="aot_eager")
    for lengths in ([5, 3, 7], [4, 9], [6, 6, 2, 3]):
        batch = flat(rows_of(lengths, seed=len(lengths)))
        eager = model(**batch).loss
        (eager_grad,) = torch.autograd.grad(eager, model.model.embed_tokens.weight)
        traced = compiled(**batch).loss
        (traced_grad,) = torch.autograd.grad(traced, model.model.embed_tokens.weight)
        assert traced.item() == pytest.approx(eager.item(), abs=1e-6)
        assert torch.allclose(traced_grad, eager_grad, atol=1e-6)


def test_the_gpu_plan_says_batches_kernel_fused_adamw_and_prefetching():
    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.render import summary_lines

    def plan(device, **keys):
        return make_plan(recipe(output_dir="/runs/x", bf16=True, **keys), make_cluster(2, device=device))

    gpu = plan("cuda")
    assert gpu.kernels["batches"]["kernel"] == "torch_varlen" and gpu.kernels["optimizer"] == "adamw_torch_fused"
    assert gpu.kernels["loader"] == {"dataloader_num_workers": 2, "dataloader_pin_memory": True,
                                     "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 2}  # fmt: skip
    lines = dict(summary_lines(gpu, recipe(bf16=True)))
    assert "torch's varlen_attn" in lines["batches"] and "non_blocking" in lines["data loading"]
    assert any("adamw_torch_fused for the recipe's adamw_torch" in note for note in gpu.notes)
    # DeepSpeed's own CPU Adam (optimizer offload), another optimizer, FSDP offload: nothing swapped
    assert plan("cuda", deepspeed="zero3_offload").kernels["optimizer"] is None
    assert plan("cuda", optimizer="adamw_8bit").kernels["optimizer"] is None
    assert plan("cuda", fsdp_version=2, fsdp_config={"offload_params": True}).kernels["optimizer"] is None
    assert plan("cuda", dataloader_num_workers=0).kernels["loader"]["dataloader_num_workers"] == 0
    rehearsal = plan("cpu")
    assert rehearsal.kernels["optimizer"] is None and rehearsal.kernels["loader"]["dataloader_num_workers"] == 0
    assert rehearsal.kernels["batches"]["kernel"] == "sdpa_per_row"
    with pytest.raises(UserError, match="dataloader_prefetch_factor needs data-loading workers"):
        plan("cpu", dataloader_prefetch_factor=4)


def test_eval_loss_of_flat_batches_is_the_padded_one_with_a_partial_last_batch(tmp_path):
    """A flat batch is one sequence to the Trainer, which weighs each eval batch's loss by the loader's batch size
    either way: the same eval_loss, a partial last batch included."""
    from transformers import TrainingArguments

    from llmtune.train.engine.trainer import LlmtuneTrainer, Rows

    rows = rows_of([9, 4, 13, 6, 7])  # batches of 2: the last holds one row
    results = {}
    for name, model, collator in (("padded", tiny("sdpa"), Collator(0)), ("flat", tiny(VARLEN_ATTENTION), FlatCollator(0))):
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_eval_batch_size=2, use_cpu=True,
                                 report_to="none", remove_unused_columns=False)  # fmt: skip
        trainer = LlmtuneTrainer(model=model, args=args, eval_dataset=Rows(rows), data_collator=collator)
        results[name] = trainer.evaluate()["eval_loss"]
    assert results["flat"] == pytest.approx(results["padded"], abs=1e-5)


def test_packed_rows_on_the_padded_path_are_refused_where_the_models_mask_ignores_position_ids():
    """Packed rows without the padding-free path rely on transformers' mask factories reading the position_ids
    restarts. OPT (like BLOOM, MPT, BioGPT, XGLM) builds its mask without them: the second example sees the first
    (measured here, as the control), so llmtune refuses that combination; Llama keeps them apart."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from llmtune.train.model.kernels import batch_layout
    from llmtune.train.model.varlen import packing_leaks

    opt = OPTForCausalLM(OPTConfig(vocab_size=100, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                   ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64)).eval()  # fmt: skip
    llama = tiny("sdpa")
    two = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # two examples packed: 3 tokens, then 4
    for model, leaks in ((opt, True), (llama, False)):
        with torch.no_grad():
            packed = model(input_ids=two, position_ids=positions).logits[0, 3:]
            alone = model(input_ids=two[:, 3:], position_ids=positions[:, 3:]).logits[0]
        assert (not torch.allclose(packed, alone, atol=1e-4)) is leaks, type(model).__name__
        assert bool(packing_leaks(model)) is leaks
    keys = {"sample_packing": True, "batch_flattening": False}
    plan = {"precision": "no", "cluster": {"device": "cpu"}}
    with pytest.raises(UserError, match="OPTForCausalLM's modelling code builds its attention mask without") as caught:
        batch_layout(recipe(**keys), plan, opt, lambda _: None)
    assert caught.value.hint.startswith("remove batch_flattening: false")
    said = []
    assert batch_layout(recipe(**keys), plan, llama, said.append).layout == PADDED
    assert said[0].startswith("batches: packed rows, padded to the batch, position_ids restarting at each example")
