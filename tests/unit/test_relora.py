"""ReLoRA (relora: true) and its jagged learning-rate schedule: the recipe keys in both of Axolotl's spellings, the
schedule's multiplier, a restart (merge, fresh adapter, pruned optimizer state), the replay on resume, the stacked
adapter saved at the end, and the strategies and optimizers a plan refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from recipe_loading import load, refusal
from tiny import make_tiny_model

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe import load_recipe
from llmtune.train.objectives.schedule import jagged_restart_scale, make_scheduler, own_schedule

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "axolotl_recipes"
RELORA = {"adapter": "lora", "relora": True, "jagged_restart_steps": 10, "jagged_restart_warmup_steps": 3,
          "jagged_restart_anneal_steps": 2}  # fmt: skip


# --- the recipe keys ---------------------------------------------------------------------------------------------


def test_both_axolotl_spellings_load_as_the_same_relora():
    old = load_recipe(CORPUS / "relora-v04-archived.yml", check_files=False)  # v0.3-v0.11: relora_steps
    new = load_recipe(CORPUS / "relora-lora.yml", check_files=False)  # v0.12 on: relora + jagged_restart_*
    for loaded in (old, new):
        recipe = loaded.recipe
        assert (recipe.relora, recipe.jagged_restart_steps, recipe.jagged_restart_warmup_steps) == (True, 150, 10)
        assert recipe.jagged_restart_anneal_steps == 1  # v0.4 had no anneal key; v0.12's `false` means Axolotl's 1
        assert any(n.startswith("relora_cpu_offload: accepted, has no effect") for n in loaded.notes), loaded.notes
    assert any(n.startswith("relora_warmup_steps: read as jagged_restart_warmup_steps") for n in old.notes)
    assert new.recipe.relora_prune_ratio == 0.9
    # the recipe written to plan.json reads back the same (the worker validates it again)
    for loaded in (old, new):
        dumped = loaded.recipe.model_dump(mode="json")
        assert type(loaded.recipe).model_validate(dumped).model_dump(mode="json") == dumped


def test_a_jagged_schedule_alone_is_not_relora():
    recipe = load(jagged_restart_steps=50).recipe
    assert recipe.jagged_restart_steps == 50 and not recipe.relora
    assert own_schedule(recipe) and not own_schedule(load().recipe)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"relora": True, "adapter": "lora"}, "relora: true needs jagged_restart_steps"),
        ({"relora_steps": 100}, "relora: true needs adapter: lora"),
        ({"relora_steps": 100, "adapter": "lora", "load_in_8bit": True}, "relora with load_in_8bit is not supported"),
        ({"relora_steps": 100, "adapter": "lora", "peft_use_dora": True}, "relora with peft_use_dora is not supported"),
        ({"relora_steps": 100, "jagged_restart_steps": 50, "adapter": "lora"},
         "relora_steps (100) and jagged_restart_steps (50) disagree"),
        ({"relora_steps": 5, "adapter": "lora"}, "jagged_restart_warmup_steps (10, the default) + "
         "jagged_restart_anneal_steps (1, the default) don't fit in one cycle of jagged_restart_steps (5)"),
        ({**RELORA, "jagged_restart_warmup_steps": 9}, "jagged_restart_warmup_steps (9) + jagged_restart_anneal_steps "
         "(2) don't fit"),
        ({**RELORA, "jagged_restart_steps": 0}, "jagged_restart_steps: Input should be greater than 0"),
        ({**RELORA, "jagged_restart_warmup_steps": -1}, "jagged_restart_warmup_steps: Input should be greater than 0"),
        ({**RELORA, "relora_prune_ratio": 0}, "relora_prune_ratio: Input should be greater than 0"),
        ({**RELORA, "relora_prune_ratio": 1.5}, "relora_prune_ratio: Input should be less than or equal to 1"),
        ({**RELORA, "relora_prune_method": "sparsest"}, "relora_prune_method: Input should be 'magnitude'"),
        ({"adapter": "lora", "relora_prune_ratio": 0.5}, "relora_prune_ratio prunes the optimizer at ReLoRA restarts; "
         "set relora: true"),
    ],
)  # fmt: skip
def test_recipe_mistakes_are_one_line_naming_the_key(changes, message):
    line = refusal(**changes)
    assert message in line and "\n" not in line, line


def test_prune_ratio_one_and_the_reset_method_are_accepted():
    recipe = load(**RELORA, relora_prune_ratio=1, relora_prune_method="reset").recipe
    assert recipe.relora_prune_ratio == 1 and recipe.relora_prune_method == "reset"


# --- the schedule ----------------------------------------------------------------------------------------------


def test_the_jagged_multiplier_at_known_steps():
    scale = {step: jagged_restart_scale(step, every=10, warmup=3, anneal=2, floor=0.001) for step in range(31)}
    assert [scale[s] for s in range(9)] == [1.0] * 9  # the first cycle runs as the schedule says, up to its anneal
    assert scale[9] == pytest.approx(0.5 * 0.999 + 0.001)  # anneal: (10 - 9) / 2 of the way above the floor
    assert scale[10] == scale[20] == scale[30] == pytest.approx(0.001)  # the restart step runs at the floor
    assert scale[11] == pytest.approx(0.999 / 3 + 0.001) and scale[12] == pytest.approx(2 * 0.999 / 3 + 0.001)
    assert [scale[s] for s in range(13, 19)] == [1.0] * 6 and scale[19] == scale[9]


def test_the_scheduler_multiplies_the_recipe_s_schedule_by_the_jagged_one():
    import torch

    recipe = load(**RELORA, lr_scheduler="linear", learning_rate=0.1).recipe
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = make_scheduler(recipe, optimizer, warmup=0, total=40)
    rates = []
    for _ in range(31):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    for step in (0, 9, 10, 11, 15, 20, 30):
        linear = (40 - step) / 40  # transformers' linear decay without warm-up
        assert rates[step] == pytest.approx(0.1 * linear * jagged_restart_scale(step, every=10, warmup=3, anneal=2,
                                                                                 floor=0.001))  # fmt: skip
    assert rates[10] < 1e-3 * 0.1 and rates[15] == pytest.approx(0.1 * 25 / 40)
    # cosine_min_lr_ratio is Axolotl's floor for the restarts too
    floored = load(**RELORA, lr_scheduler="cosine", cosine_min_lr_ratio=0.1).recipe
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(floored, optimizer, warmup=0, total=1000)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / 1000))  # transformers' cosine_with_min_lr at step 10
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cosine * 0.1)  # the restart step: floor 0.1, not 0.001


# --- a restart -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("relora") / "tiny", layers=2, hidden=32, heads=4, kv_heads=2,
                           intermediate=64)  # fmt: skip


def lora_model(path, seed: int = 0):
    """The tiny model with LoRA on every linear layer, B drawn at random (as if trained) so the deltas aren't 0."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model


def relora_for(model, tmp_path, **changes):
    from llmtune.train.objectives.relora import ReLoRA

    return ReLoRA(model, load(**{**RELORA, **changes}).recipe, tmp_path)


def logits(model):
    import torch

    ids = torch.arange(3, 19).reshape(2, 8)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def base_weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_a_restart_merges_the_delta_and_starts_a_fresh_adapter(tiny, tmp_path):
    import torch

    from llmtune.train.objectives.relora import factors

    model = lora_model(tiny)
    relora = relora_for(model, tmp_path)
    before, weights = logits(model), base_weights(model)
    old = {name: [p.detach().clone() for p in factors(layer, "default")] for name, layer in relora.layers.items()}
    assert len(relora.layers) == 14  # q k v o gate up down, two layers
    relora.restart(10, optimizer=None)
    # the same function right after the restart, from other weights
    assert (logits(model) - before).abs().max().item() < 1e-5
    changed = [n for n, w in base_weights(model).items() if not torch.equal(w, weights[n])]
    assert len(changed) == 14 and all(n.endswith("base_layer.weight") for n in changed)
    for name, layer in relora.layers.items():
        a, b = factors(layer, "default")
        assert torch.count_nonzero(b) == 0  # B zero: the fresh adapter adds nothing yet
        assert not torch.equal(a, old[name][0]) and a.abs().sum() > 0  # A drawn afresh
    total = sum((layer.scaling["default"] * old[n][1] @ old[n][0]).pow(2).sum() for n, layer in relora.layers.items())
    assert relora.restarts == [{"step": 10, "delta_norm": pytest.approx(total.sqrt().item(), rel=1e-5)}]
    assert (tmp_path / "relora" / "restart-00000010.safetensors").exists()


def test_every_rank_draws_the_same_fresh_adapter_and_training_randomness_is_untouched(tiny, tmp_path):
    import torch

    from llmtune.train.objectives.relora import factors

    first, second = lora_model(tiny), lora_model(tiny)
    torch.manual_seed(123)  # the two "ranks" are at different points of their own random streams
    relora_for(first, tmp_path / "a").restart(10, optimizer=None)
    after_first = torch.rand(1)
    torch.manual_seed(7)
    relora_for(second, tmp_path / "b").restart(10, optimizer=None)
    for name, layer in relora_for(first, tmp_path / "c").layers.items():
        other = dict(second.named_modules())[name]
        assert torch.equal(factors(layer, "default")[0], factors(other, "default")[0])
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after_first)  # the restart drew from a forked generator


@pytest.mark.parametrize(
    ("method", "ratio"), [("magnitude", 0.9), ("magnitude", 0.5), ("random", 0.7), ("reset", None)]
)
def test_the_optimizer_state_of_the_adapter_is_pruned_to_the_ratio(tiny, tmp_path, method, ratio):
    import torch

    from llmtune.train.objectives.relora import factors

    model = lora_model(tiny)
    model.base_model.model.lm_head.weight.requires_grad_(True)  # a trained parameter that isn't the adapter's
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    head = {k: v.clone() for k, v in optimizer.state[model.base_model.model.lm_head.weight].items()}
    kept = {(id(p), k): v.clone() for p in params for k, v in optimizer.state[p].items() if k != "step"}
    relora = relora_for(model, tmp_path, relora_prune_method=method, **({"relora_prune_ratio": ratio} if ratio else {}))
    relora.restart(10, optimizer)
    expected, zeros, values = ratio or 0.999, 0, 0
    for layer in relora.layers.values():
        for param in factors(layer, "default"):
            state = optimizer.state[param]
            for key in ("exp_avg", "exp_avg_sq"):
                zeros, values = zeros + int((state[key] == 0).sum()), values + state[key].numel()
                if method == "magnitude":  # exactly the smallest values: the ratio, to one value, in every tensor
                    assert abs((state[key] == 0).float().mean().item() - expected) <= 1 / state[key].numel(), key
                    smallest_kept = state[key][state[key] != 0].abs().min()
                    before = kept[(id(param), key)].flatten()
                    threshold = before.abs().kthvalue(round(expected * before.numel())).values
                    assert smallest_kept > threshold  # what survives is what was largest
            assert state["step"].item() == 1  # the step count stays: Adam's bias correction is not restarted
    assert zeros / values == pytest.approx(expected, abs=0.02)  # random: the ratio, over all the adapter's values
    for key, value in optimizer.state[model.base_model.model.lm_head.weight].items():
        assert torch.equal(value, head[key])  # only the adapter's state is pruned


def test_a_resumed_run_replays_the_restarts_onto_the_base_weights(tiny, tmp_path):
    import torch

    from llmtune.train.objectives.relora import factors

    first = lora_model(tiny)
    relora = relora_for(first, tmp_path)
    relora.restart(10, optimizer=None)
    with torch.no_grad():  # cycle 2 trains, then restarts at 20, then trains on: the state checkpoint-25 would save
        for name, param in first.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    relora.restart(20, optimizer=None)
    with torch.no_grad():
        for name, param in first.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    checkpoint = {n: p.detach().clone() for n, p in first.named_parameters() if "lora_" in n}

    resumed = lora_model(tiny, seed=1)  # the base model as loaded, with the checkpoint's adapter
    resumed.load_state_dict(checkpoint, strict=False)
    again = relora_for(resumed, tmp_path)
    again.replay(25)
    assert again.restarts == relora.restarts
    for name, weight in base_weights(first).items():
        assert torch.allclose(dict(resumed.named_parameters())[name], weight, atol=1e-6), name
    for name, layer in again.layers.items():  # the checkpoint's adapter, untouched by the replay
        a, b = factors(layer, "default")
        assert torch.equal(b, checkpoint[f"{name}.lora_B.default.weight"])
    (tmp_path / "relora" / "restart-00000020.safetensors").unlink()
    with pytest.raises(UserError, match="resuming after the restart at step 20, but its merged adapter"):
        relora_for(lora_model(tiny), tmp_path).replay(25)


def test_the_saved_adapter_stacks_every_cycle_and_reloads_to_the_trained_model(tiny, tmp_path):
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny)
    relora = relora_for(model, tmp_path)
    for step in (10, 20):
        relora.restart(step, optimizer=None)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05)
    trained = logits(model)
    out = tmp_path / "out"
    model.save_pretrained(str(out))  # what trainer.save_model writes: the last cycle's adapter
    relora.save_adapter(out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (12, 24)  # rank 4 x 3 cycles; alpha / r stays 2
    assert relora.report()["saved_rank"] == 12
    base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(out))
    assert (logits(reloaded) - trained).abs().max().item() < 1e-5
    # and the last cycle alone (what the Trainer saved) would not be the trained model
    last = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32), str(out))
    with torch.no_grad():
        for name, param in last.named_parameters():
            if "lora_A" in name:
                param[:8] = 0  # the two earlier cycles' rows
    assert (logits(last) - trained).abs().max().item() > 1e-3


def test_rslora_keeps_its_scaling_when_stacked(tiny, tmp_path):
    import json

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    relora = relora_for(model, tmp_path)
    relora.restart(10, optimizer=None)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    trained, out = logits(model), tmp_path / "out"
    model.save_pretrained(str(out))
    relora.save_adapter(out)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32), str(out))
    assert (logits(reloaded) - trained).abs().max().item() < 1e-5


def qlora_model(path, seed: int = 0):
    """The tiny model loaded in 4 bits (NF4, double quantization, fp32 storage as llmtune loads it), LoRA on every
    linear layer with B drawn at random."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(seed)
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, quantization_config=quantized,
                                                device_map={"": "cpu"})  # fmt: skip
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _draw_b(model)
    return model


def _draw_b(model, std: float = 0.05) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)


def test_a_4bit_base_is_requantized_from_its_loaded_weights_and_every_delta_without_compounding(tiny, tmp_path):
    """Axolotl's ReLoRA example trains on a 4-bit base. A restart requantizes dequantize(loaded) + delta1 + ... +
    deltaK, never the previous restart's requantized weight again; a resumed run replays it exactly."""
    import torch
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from llmtune.train.objectives.relora import is_4bit

    def weight(layer):
        w = layer.get_base_layer().weight
        return dequantize_4bit(w.data, w.quant_state).float()

    def requantized(values, like):
        state = like.get_base_layer().weight.quant_state
        packed, new = quantize_4bit(values.to(state.dtype), blocksize=state.blocksize, compress_statistics=True,
                                    quant_type=state.quant_type, quant_storage=torch.float32)  # fmt: skip
        return dequantize_4bit(packed, new).float()

    model = qlora_model(tiny)
    relora = relora_for(model, tmp_path, adapter="qlora", load_in_4bit=True)
    assert len(relora.layers) == 14 and all(is_4bit(layer) for layer in relora.layers.values())
    loaded = {name: weight(layer) for name, layer in relora.layers.items()}
    deltas = {name: [] for name in relora.layers}
    for step in (10, 20):
        for name, layer in relora.layers.items():
            deltas[name].append(layer.get_delta_weight("default").float().detach().clone())  # peft's own delta
        relora.restart(step, optimizer=None)
        _draw_b(model)
    wrong, right, compounded = 0.0, 0.0, 0.0
    for name, layer in relora.layers.items():
        exact = loaded[name] + deltas[name][0] + deltas[name][1]
        once = requantized(exact, layer)
        # one rounding, from the loaded weight (to the last bits of the block scales: the deltas are summed here one
        # by one, there as one stacked product)
        assert torch.allclose(weight(layer), once, rtol=0, atol=1e-6), name
        twice = requantized(requantized(loaded[name] + deltas[name][0], layer) + deltas[name][1], layer)
        wrong += (twice != once).float().mean().item() / len(relora.layers)
        right += (once - exact).abs().sum().item()
        compounded += (twice - exact).abs().sum().item()
    assert wrong > 0.01 and right < compounded  # requantizing the requantized weight would differ, and drift further
    assert torch.count_nonzero(relora.layers[next(iter(relora.layers))].lora_B["default"].weight) > 0
    # a resumed run: the base as loaded, the checkpoint's adapter; the replay gives the same 4-bit weights
    checkpoint = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    resumed = qlora_model(tiny, seed=1)
    resumed.load_state_dict(checkpoint, strict=False)
    again = relora_for(resumed, tmp_path, adapter="qlora", load_in_4bit=True)
    again.replay(25)
    for name, layer in again.layers.items():
        assert torch.equal(weight(layer), weight(relora.layers[name])), name
    assert again.restarts == relora.restarts


@pytest.mark.parametrize("method", ["magnitude", "random"])
def test_an_8bit_optimizer_s_state_is_pruned_dequantized(tiny, tmp_path, method):
    """bitsandbytes' 8-bit AdamW (Axolotl's ReLoRA example uses adamw_bnb_8bit) holds each moment as blockwise uint8
    values with their absmax: pruned dequantized, quantized back; zeros stay zero, the largest values survive."""
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.functional import dequantize_blockwise

    from llmtune.train.objectives.relora import factors

    model = lora_model(tiny)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-3, min_8bit_size=1)  # the tiny adapter's tensors in 8 bits too
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()

    def moment(state, n):
        values, absmax, code = state[f"state{n}"], state[f"absmax{n}"], state[f"qmap{n}"]
        return dequantize_blockwise(values, absmax=absmax, code=code, blocksize=256).float()

    layer = next(iter(relora_for(model, tmp_path / "x").layers.values()))
    a = factors(layer, "default")[0]
    assert optimizer.state[a]["state1"].dtype == torch.uint8
    before = moment(optimizer.state[a], 1).clone()
    relora = relora_for(model, tmp_path, relora_prune_method=method, relora_prune_ratio=0.75)
    relora.restart(10, optimizer)
    zeros, values = 0, 0
    for layer in relora.layers.values():
        for param in factors(layer, "default"):
            for n in (1, 2):
                after = moment(optimizer.state[param], n)
                zeros, values = zeros + int((after == 0).sum()), values + after.numel()
                if method == "magnitude":  # the ratio in every tensor, to the values tied at the threshold
                    assert (after == 0).float().mean().item() >= 0.75 - 1 / after.numel()
    assert zeros / values == pytest.approx(0.75, abs=0.03)
    after = moment(optimizer.state[a], 1)
    if method == "magnitude":  # what survives is what was largest, near its value
        largest = before.abs() > before.abs().flatten().kthvalue(round(0.75 * before.numel())).values
        assert (after[largest] != 0).all() and torch.allclose(after[largest], before[largest], rtol=0.1, atol=1e-4)


# --- the plan --------------------------------------------------------------------------------------------------


def plan_for(processes: int = 2, **changes):
    return make_plan(load(**{**RELORA, **changes}).recipe, make_cluster(processes, device="cuda"), config_dir="/tmp/x")


def test_ddp_plans_with_a_note_and_sharded_strategies_are_refused():
    plan = plan_for(2)
    assert plan.strategy == "ddp"
    assert any(n.startswith("ReLoRA: every 10 steps the LoRA is merged") and "90.0% of its optimizer state" in n
               for n in plan.notes)  # fmt: skip
    assert plan_for(1).strategy == "single"
    for changes, what in (({"deepspeed": {"zero_optimization": {"stage": 2}}}, "DeepSpeed"),
                          ({"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}, "FSDP2")):  # fmt: skip
        with pytest.raises(UserError, match=f"relora under {what} is not supported"):
            plan_for(2, **changes)


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw_torch_4bit", "adamw_torch_8bit", "ademamix_8bit"])
def test_optimizers_whose_state_can_t_be_pruned_value_by_value_are_refused(optimizer):
    with pytest.raises(UserError, match=f"relora with optimizer: {optimizer} is not supported"):
        plan_for(1, optimizer=optimizer)
    for accepted in ("paged_adamw_32bit", "adamw_bnb_8bit", "paged_adamw_8bit"):  # bitsandbytes' blockwise state
        assert plan_for(1, optimizer=accepted).strategy == "single"


def test_merging_a_relora_run_without_its_final_save_is_refused(tmp_path):
    """A checkpoint's adapter is the last cycle only: merging it would drop every earlier cycle without a word."""
    from llmtune.post.consolidate import find_weights

    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir()
    (checkpoint / "llmtune-complete.json").write_text('{"step": 6}')
    (checkpoint / "adapter_config.json").write_text("{}")
    assert find_weights(tmp_path).folder == checkpoint  # a plain LoRA run merges its newest checkpoint
    (tmp_path / "relora").mkdir()
    with pytest.raises(UserError, match="ReLoRA run that stopped before its final save: checkpoint-6's adapter is its "
                                        "last cycle only"):  # fmt: skip
        find_weights(tmp_path)
