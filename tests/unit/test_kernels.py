"""The GPU fast path: Axolotl's kernel keys, what they map to, and that CPU rehearsal runs them as no-ops.

liger-kernel and flash-attn need a GPU, so both are stood in for: a fake liger_kernel module records how its
entry point is called, and reference flash kernels (sdpa per example) run inside transformers' real flash
attention path, so the test sees exactly what transformers hands the kernel.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.kernels import CCE_PLUGIN, LIGER_PLUGIN, compile_arguments
from llmtune.recipe.loader import recipe_from_mapping

LIGER_RECIPE = {
    "plugins": [LIGER_PLUGIN],
    "liger_rope": True,
    "liger_rms_norm": True,
    "liger_glu_activation": True,
    "liger_layer_norm": True,
    "liger_fused_linear_cross_entropy": True,
}


def load(**changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False)


def recipe(**changes):
    return load(**changes).recipe


# --- the schema ---------------------------------------------------------------------------------------------------


def test_axolotl_spelling_is_accepted_and_used():
    loaded = load(**LIGER_RECIPE, flash_attention=True, torch_compile=True, torch_compile_mode="max-autotune")
    r = loaded.recipe
    assert r.plugins == [LIGER_PLUGIN]
    assert (r.liger_rope, r.liger_rms_norm, r.liger_glu_activation, r.liger_fused_linear_cross_entropy) == (True,) * 4
    assert r.attn_implementation == "flash_attention_2" and r.torch_compile is True
    # no longer in the "Axolotl-only, no effect" list
    assert not [n for n in loaded.notes if "has no effect in llmtune" in n]


def test_cut_cross_entropy_plugin_turns_it_on_as_in_axolotl():
    from llmtune.recipe.kernels import cut_cross_entropy_on, liger_requested

    assert cut_cross_entropy_on(recipe(plugins=[CCE_PLUGIN]))
    assert not cut_cross_entropy_on(recipe(plugins=[CCE_PLUGIN], cut_cross_entropy=False))
    assert liger_requested(recipe(plugins=[CCE_PLUGIN]))["fused_linear_cross_entropy"] is True
    assert liger_requested(recipe())["fused_linear_cross_entropy"] is False


def test_liger_swiglu_is_the_older_name_of_glu_activation():
    assert recipe(liger_swiglu=True).liger_glu_activation is True


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_unknown_plugin_is_one_line_exit_2(run_cli, write_recipe, command):
    path = write_recipe({"plugins": [LIGER_PLUGIN, "axolotl.integrations.spectrum.SpectrumPlugin"]})
    result = run_cli(command, path)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert (
        "plugin 'axolotl.integrations.spectrum.SpectrumPlugin' is not supported; llmtune has no plugin system"
        in lines[0]
    )


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"liger_cross_entropy": True, "liger_fused_linear_cross_entropy": True}, ["choose one"]),
        ({"plugins": [CCE_PLUGIN], "liger_cross_entropy": True}, ["cut_cross_entropy", "liger_cross_entropy"]),
        ({"torch_compile_mode": "fastest"}, ["torch_compile_mode"]),
    ],
)
def test_combinations_that_cannot_run_are_refused(changes, words):
    with pytest.raises(UserError) as err:
        make_plan(load(**changes).recipe, make_cluster(num_processes=2, device="cuda"), config_dir="/tmp/x")
    line = err.value.one_line()
    assert "\n" not in line and all(w in line for w in words), line


# --- Liger: which entry point, with which arguments -----------------------------------------------------------------


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel with liger's real entry-point signatures (most kernels default to on); records each call."""
    calls = []

    def llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None):
        calls.append(("llama", model, dict(rope=rope, cross_entropy=cross_entropy, rms_norm=rms_norm, swiglu=swiglu,
                                           fused_linear_cross_entropy=fused_linear_cross_entropy)))  # fmt: skip

    def gemma(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, model=None):
        calls.append(("gemma", model, dict(rope=rope, cross_entropy=cross_entropy, rms_norm=rms_norm, geglu=geglu,
                                           fused_linear_cross_entropy=fused_linear_cross_entropy)))  # fmt: skip

    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": llama, "gemma": gemma}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    return calls


def fake_model(model_type):
    return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type))


def test_only_the_asked_kernels_are_on_everything_else_explicitly_off(fake_liger):
    from llmtune.train.model.kernels import apply_liger, kernels_for

    kernels = kernels_for(recipe(liger_rms_norm=True, liger_glu_activation=True), "bf16", device="cuda")
    model, lines = fake_model("llama"), []
    assert apply_liger(model, kernels.liger, lines.append) == ["rms_norm", "swiglu"]
    assert fake_liger == [("llama", model, {"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False,
                                            "rms_norm": True, "swiglu": True})]  # fmt: skip


def test_glu_maps_to_geglu_for_gemma_and_missing_kernels_are_said(fake_liger):
    from llmtune.train.model.kernels import apply_liger, kernels_for

    kernels = kernels_for(recipe(**LIGER_RECIPE), "bf16", device="cuda")
    lines = []
    apply_liger(fake_model("gemma"), kernels.liger, lines.append)
    assert fake_liger[0][2] == {"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True,
                                "rms_norm": True, "geglu": True}  # fmt: skip
    assert any("gemma has no Liger layer_norm kernel" in line for line in lines)


def test_cut_cross_entropy_runs_as_fused_linear_cross_entropy(fake_liger):
    from llmtune.train.model.kernels import apply_liger, kernels_for

    apply_liger(fake_model("llama"), kernels_for(recipe(plugins=[CCE_PLUGIN]), "bf16", device="cuda").liger, print)
    assert fake_liger[0][2] == {"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": True,
                                "rms_norm": False, "swiglu": False}  # fmt: skip


def test_a_model_type_liger_lacks_trains_without_it_and_says_so(fake_liger):
    from llmtune.train.model.kernels import apply_liger, kernels_for

    lines = []
    assert (
        apply_liger(fake_model("gpt2"), kernels_for(recipe(**LIGER_RECIPE), "bf16", "cuda").liger, lines.append) == []
    )
    assert fake_liger == [] and "model type 'gpt2'" in lines[0]


def test_liger_not_installed_is_one_line_with_the_install_hint(monkeypatch):
    from llmtune.train.model.kernels import apply_liger

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if not installed
    with pytest.raises(UserError) as err:
        apply_liger(fake_model("llama"), {"rms_norm": True, "rope": False}, print)
    line = err.value.one_line()
    assert "liger-kernel" in line and "pip install 'llmtune[kernels]'" in line and "\n" not in line


def tiny_model_dir(tmp_path):
    from tiny import make_tiny_model  # tests/fixtures is on sys.path (conftest)

    return make_tiny_model(tmp_path / "tiny", layers=1)


def test_load_model_applies_liger_to_the_loaded_instance_on_gpus_only(fake_liger, tmp_path):
    from tiny import load_tokenizer

    from llmtune.train.model.load import load_model

    path = str(tiny_model_dir(tmp_path))
    r = recipe(base_model=path, liger_rms_norm=True, flash_attention=True)
    model = load_model(r, path, load_tokenizer(), "no", device="cpu")
    assert fake_liger == []  # rehearsal: nothing imported or patched
    assert model.config._attn_implementation == "sdpa"  # flash_attention falls back where it can't run
    model = load_model(r, path, load_tokenizer(), "bf16", device="cuda")
    assert [(kind, type(m).__name__, kw["rms_norm"], kw["rope"]) for kind, m, kw in fake_liger] == [
        ("llama", "LlamaForCausalLM", True, False)
    ]
    assert fake_liger[0][1] is model


# --- CPU rehearsal: no effect, said once ----------------------------------------------------------------------------


def test_rehearsal_says_once_that_the_kernels_are_off(run_cli, write_recipe):
    path = write_recipe({**LIGER_RECIPE, "flash_attention": True, "torch_compile": True})
    result = run_cli("plan", path, "--device", "cpu", "--json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    notes = [n for n in plan["notes"] if "liger_rms_norm" in n]
    assert notes == ["liger_rope, liger_rms_norm, liger_glu_activation, liger_layer_norm, "
                     "liger_fused_linear_cross_entropy: no effect in CPU rehearsal (Triton kernels need a GPU)"]  # fmt: skip
    assert sum("torch_compile: no effect in CPU rehearsal" in n for n in plan["notes"]) == 1
    assert sum("flash_attention: no effect in CPU rehearsal" in n for n in plan["notes"]) == 1
    assert plan["kernels"]["liger"] == [] and plan["kernels"]["compile"] == {}
    assert plan["kernels"]["attention"] == "sdpa"
    assert run_cli("validate", path, "--device", "cpu").code == 0


def test_plan_shows_the_gpu_kernels(run_cli, write_recipe, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    path = write_recipe({**LIGER_RECIPE, "torch_compile": True, "bf16": True})
    gpu = run_cli("plan", path, "--device", "cuda", "--num-processes", "1")
    assert gpu.code == 0, gpu.err
    line = next(x for x in gpu.out.splitlines() if x.startswith("kernels"))
    assert "liger rope, rms_norm, swiglu/geglu, layer_norm, fused linear cross-entropy" in line
    assert "torch.compile inductor" in line
    cpu = run_cli("plan", path, "--device", "cpu")
    line = next(x for x in cpu.out.splitlines() if x.startswith("kernels"))
    assert "off in CPU rehearsal" in line and "liger_rms_norm" in line


def test_flash_attention_where_installed_with_bf16(monkeypatch):
    from llmtune.recipe.kernels import resolve_kernels

    r = recipe(flash_attention=True)
    assert resolve_kernels(r, "cuda", "bf16", "ddp", True).attention == "flash_attention_2"
    assert resolve_kernels(r, "cuda", "bf16", "ddp", False).attention == "sdpa"  # not installed
    assert resolve_kernels(r, "cuda", "no", "ddp", True).attention == "sdpa"  # fp32: flash can't
    assert resolve_kernels(r, "cuda", "bf16", "pipeline", True).attention == "sdpa"  # stages pass a 4D mask
    assert resolve_kernels(r, "cpu", "no", "single", True).attention == "sdpa"


# --- torch.compile --------------------------------------------------------------------------------------------------


def test_compile_arguments_are_trainingarguments_keys(tmp_path):
    from transformers import TrainingArguments

    r = recipe(torch_compile=True, torch_compile_mode="max-autotune")
    assert compile_arguments(r, "cpu") == {}
    assert compile_arguments(recipe(), "cuda") == {}
    assert compile_arguments(recipe(torch_compile=True, pipeline_parallel_size=2), "cuda") == {}
    extra = compile_arguments(r, "cuda")
    assert extra == {"torch_compile": True, "torch_compile_backend": "inductor", "torch_compile_mode": "max-autotune"}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **extra)
    assert (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode) == (
        True,
        "inductor",
        "max-autotune",
    )
    assert (
        compile_arguments(recipe(torch_compile="auto", torch_compile_backend="aot_eager"), "cuda")[
            "torch_compile_backend"
        ]
        == "aot_eager"
    )


# --- flash attention over packed rows -------------------------------------------------------------------------------


def test_packed_boundaries():
    import torch

    from llmtune.train.model.kernels import packed_boundaries

    cu, longest = packed_boundaries(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]))
    assert cu.tolist() == [0, 3, 5, 6, 10, 12] and cu.dtype == torch.int32 and longest == 4


@pytest.fixture
def reference_flash(monkeypatch):
    """transformers' own flash_attention_2 path, with the two flash-attn kernels replaced by sdpa per example."""
    import torch
    import transformers.modeling_flash_attention_utils as fa

    calls = []

    def attend(q, k, v, scale):  # causal; (length, heads, dim); k/v may have fewer heads (GQA)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
        )
        return out.transpose(0, 1)

    def flash_fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True):
        calls.append("dense")
        return torch.stack([attend(q[i], k[i], v[i], softmax_scale) for i in range(q.shape[0])])

    def flash_varlen_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                        softmax_scale=None, causal=True):  # fmt: skip
        calls.append("varlen")
        bounds = cu_seqlens_q.tolist()
        return torch.cat(
            [attend(q[s:e], k[s:e], v[s:e], softmax_scale) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
        )

    monkeypatch.setattr(fa, "_lazy_imports", lambda *args, **kwargs: (flash_fn, flash_varlen_fn, None, None, None))
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    return calls


def test_flash_attention_keeps_packed_examples_apart_with_several_rows(reference_flash):
    import torch
    from tiny import tiny_llama_config
    from transformers import LlamaForCausalLM

    from llmtune.train.model.kernels import keep_packed_rows_apart

    torch.manual_seed(0)
    config = tiny_llama_config(100, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64,
                               max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    a, b, c, d = (torch.randint(0, 100, (n,)) for n in (5, 3, 4, 4))
    with torch.no_grad():
        alone = {name: model(input_ids=x[None]).logits[0] for name, x in zip("abcd", (a, b, c, d), strict=True)}
    model.config._attn_implementation = "flash_attention_2"
    batch = {"input_ids": torch.stack([torch.cat([a, b]), torch.cat([c, d])]),
             "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]])}  # fmt: skip
    with torch.no_grad():
        leaky = model(**batch).logits
        assert reference_flash[-1] == "dense"  # transformers alone: plain causal over each row of 2 rows
        assert (leaky[0, 5:] - alone["b"]).abs().max() > 1e-2  # the second example saw the first
        keep_packed_rows_apart(model)
        packed = model(**batch).logits
    assert reference_flash[-1] == "varlen"
    for got, want in ((packed[0, :5], alone["a"]), (packed[0, 5:], alone["b"]), (packed[1, :4], alone["c"]),
                      (packed[1, 4:], alone["d"])):  # fmt: skip
        assert torch.allclose(got, want, atol=1e-5)


def test_a_model_without_sdpa_takes_its_own_attention_where_sdpa_stood_in_for_flash(tmp_path, capsys):
    """Gemma 2 soft-caps its attention logits and has no sdpa path: flash_attention: true on a machine without
    flash-attn (or in the CPU rehearsal) loads it with its own default instead of failing; a recipe that asks for
    sdpa itself is still told."""
    from tiny import load_tokenizer
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from llmtune.train.model.load import load_model

    tokenizer = load_tokenizer()
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    path = str(tmp_path / "gemma2")
    model = load_model(recipe(base_model=path, flash_attention=True), path, tokenizer, "no", device="cpu")
    assert model.config._attn_implementation == "eager"
    assert "Gemma2ForCausalLM has no sdpa path, so its own default attention stands in" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"yet\. \(the recipe asks for attn_implementation sdpa\)"):  # no cut URL
        load_model(recipe(base_model=path, sdp_attention=True), path, tokenizer, "no", device="cpu")
