"""What the Axolotl keys llmtune honours do in training: the loss watchdog, unfrozen_parameters, embeddings padded to
a multiple of 32, config overrides, re-initialised weights, end-of-turn tokens, deduplication, streaming bounds,
and Axolotl's named chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import load_tokenizer, make_tiny_model, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.recipe.model import FAMILY_CHAT_TEMPLATES
from llmtune.train.data.formats import IGNORE, FormatContext, format_for
from llmtune.train.data.prepare import eot_token_ids, stream_budget, tokenize_with_cache
from llmtune.train.data.templates import FAMILY_TEMPLATES, render, resolve_chat_template
from llmtune.train.engine.callbacks import LossWatchdog

SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


def recipe(tmp_path: Path | None = None, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


# --- the loss watchdog -----------------------------------------------------------------------------------------


class State:
    global_step = 7


class Control:
    should_training_stop = False


def test_loss_watchdog_stops_after_patience_strikes_in_a_row():
    watchdog, control = LossWatchdog(threshold=5.0, patience=3), Control()
    for loss in (6.0, 7.0, 4.0, 6.0, 6.0):  # a loss at or below the threshold clears the strikes
        watchdog.on_log(None, State(), control, logs={"loss": loss})
        assert not control.should_training_stop
    watchdog.on_log(None, State(), control, logs={"eval_loss": 9.0})  # only training losses count
    watchdog.on_log(None, State(), control, logs={"loss": 6.5})
    assert control.should_training_stop and watchdog.stopped_at == 7


def test_loss_watchdog_without_threshold_does_nothing():
    control = Control()
    for _ in range(5):
        LossWatchdog(None).on_log(None, State(), control, logs={"loss": 1e9})
    assert not control.should_training_stop


# --- model loading and which parameters train --------------------------------------------------------------------


def test_embeddings_padded_to_32_config_overrides_and_reinit(tiny, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.load import load_model

    r = recipe(base_model=str(tiny), resize_token_embeddings_to_32x=True, reinit_weights=True,
               model_config={"rope_theta": 1234.0}, cls_model_config="LlamaConfig")  # fmt: skip
    original = AutoModelForCausalLM.from_pretrained(str(tiny))
    torch.manual_seed(3)
    model = load_model(r, str(tiny), tok, "no", device="cpu")
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows % 32 == 0 and rows >= len(tok) > rows - 32
    assert model.config.rope_parameters["rope_theta"] == 1234.0  # where transformers 5 reads it (test_config_overrides)
    before, after = original.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(before, after)
    with pytest.raises(UserError, match="transformers has no NopeConfig"):
        load_model(recipe(base_model=str(tiny), cls_model_config="NopeConfig"), str(tiny), tok, "no", device="cpu")


def test_unfrozen_parameters_full_fine_tune_with_row_range(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.adapters import attach_adapter

    model = AutoModelForCausalLM.from_pretrained(str(tiny))
    attach_adapter(model, recipe(unfrozen_parameters=["^model.layers.1.mlp.*", "^model.embed_tokens.weight$[:10]"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"model.embed_tokens.weight", *(f"model.layers.1.mlp.{m}_proj.weight" for m in
                                                         ("gate", "up", "down"))}  # fmt: skip
    model(input_ids=torch.arange(40).view(2, 20), labels=torch.arange(40).view(2, 20)).loss.backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad[10:].abs().sum() == 0 and grad[:10].abs().sum() > 0


def test_unfrozen_parameters_choose_among_adapter_weights(tiny):
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.adapters import attach_adapter

    r = recipe(adapter="lora", lora_target_linear=True, unfrozen_parameters=["^model.layers.0.self_attn.*"])
    model = attach_adapter(AutoModelForCausalLM.from_pretrained(str(tiny)), r)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("layers.0.self_attn" in n and "lora_" in n for n in trainable)
    with pytest.raises(UserError, match="matches no adapter parameter"):
        attach_adapter(AutoModelForCausalLM.from_pretrained(str(tiny)), recipe(
            adapter="lora", lora_target_linear=True, unfrozen_parameters=["^model.language_model.*"]))  # fmt: skip


def test_loftq_and_target_parameters_reach_peft():
    from llmtune.train.model.adapters import lora_config

    config = lora_config(recipe(adapter="lora", peft={"loftq_config": {"loftq_bits": 4}},
                                lora_target_parameters=["mlp.experts.gate_up_proj"]))  # fmt: skip
    assert config.init_lora_weights == "loftq" and config.loftq_config["loftq_bits"] == 4
    assert config.target_parameters == ["mlp.experts.gate_up_proj"]


def test_saves_and_evals_per_epoch_count_in_a_run_max_steps_ends_within_its_first_epoch(tmp_path):
    """58 rows at micro-batch 2: an epoch is 29 steps. max_steps 6 with saves_per_epoch 2 saved and evaluated only
    at the end (every 14 steps); Axolotl's fraction of the total steps saves at 3 and 6."""
    from llmtune.train.engine.arguments import training_arguments

    plan = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "single", "micro_batch_size": 2,
            "data_parallel_size": 1, "gradient_accumulation_steps": 1}  # fmt: skip
    every = {"saves_per_epoch": 2, "evals_per_epoch": 2, "micro_batch_size": 2, "output_dir": str(tmp_path)}
    args = training_arguments(recipe(max_steps=6, **every), plan, 58, True)
    assert (args.save_steps, args.eval_steps, args.max_steps) == (3, 3, 6)
    args = training_arguments(recipe(**every), plan, 58, True)  # without max_steps: per epoch of the data
    assert (args.save_steps, args.eval_steps) == (14, 14)
    args = training_arguments(recipe(max_steps=100, **every), plan, 58, True)  # past an epoch: per epoch still
    assert (args.save_steps, args.eval_steps) == (14, 14)


def test_curriculum_sampling_and_neftune_reach_training_arguments(tmp_path):
    from llmtune.train.engine.arguments import training_arguments

    plan = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "single", "micro_batch_size": 1,
            "data_parallel_size": 1, "gradient_accumulation_steps": 1}  # fmt: skip
    args = training_arguments(recipe(output_dir=str(tmp_path), curriculum_sampling=True, neftune_noise_alpha=5.0),
                              plan, 8, False)  # fmt: skip
    assert args.train_sampling_strategy == "sequential" and args.neftune_noise_alpha == 5.0
    # optim_args as Axolotl passes it: a mapping or transformers' 'key=value,...', read by the optimizers that take any
    for given in ({"beta3": 0.9999, "alpha": 8, "t_alpha": 100}, "beta3=0.9999,alpha=8,t_alpha=100"):
        args = training_arguments(recipe(output_dir=str(tmp_path), optimizer="ademamix", optim_args=given), plan, 8,
                                  False)  # fmt: skip
        assert args.optim_args == "beta3=0.9999,alpha=8,t_alpha=100"
    from transformers import Trainer
    from transformers.trainer_optimizer import _parse_optim_args

    assert _parse_optim_args(args.optim_args) == {"beta3": "0.9999", "alpha": "8", "t_alpha": "100"}
    assert Trainer.get_optimizer_cls_and_kwargs(args)[1]["alpha"] == 8.0  # AdEMAMix takes it
    with pytest.raises(UserError, match="optim_args with optimizer: muon is not supported"):
        recipe(optimizer="muon", optim_args="eps=1e-8")


# --- end-of-turn tokens and chat data ----------------------------------------------------------------------------


def chat(tok, template: str, eot: list[str] | None = None, messages=None, **spec):
    from llmtune.recipe.data import DatasetSpec

    r = recipe(eot_tokens=eot)
    dataset = DatasetSpec(path="x", type="chat_template", **spec)
    ctx = FormatContext(tok, dataset, False, 256, template, eot_token_ids(r, tok))
    [(ids, labels)] = format_for(dataset)({"messages": messages or CHAT}, ctx)
    return ids, labels


def trained(tok, ids, labels) -> str:
    return tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])


@pytest.fixture(scope="module")
def gemma_tok():
    tokenizer = load_tokenizer()
    tokenizer.add_tokens(["<start_of_turn>", "<end_of_turn>"])
    return tokenizer


def test_eot_tokens_end_turns_and_follow_train_on_eot(gemma_tok):
    template = FAMILY_TEMPLATES["gemma3"]
    ids, labels = chat(gemma_tok, template, eot=["<end_of_turn>"])
    assert trained(gemma_tok, ids, labels) == "Hello!<end_of_turn>4<end_of_turn>"
    ids, labels = chat(gemma_tok, template, eot=["<end_of_turn>"], train_on_eot="none")
    assert trained(gemma_tok, ids, labels) == "Hello!4"
    ids, labels = chat(gemma_tok, template, eot=["<end_of_turn>"], train_on_eot="last")
    assert trained(gemma_tok, ids, labels) == "Hello!4<end_of_turn>"
    # without eot_tokens the added (non-special) token isn't recognised as the end of a turn
    assert trained(gemma_tok, *chat(gemma_tok, template)) == "Hello!4"


def test_eos_follows_train_on_eos_beside_eot_tokens(tok):
    template = FAMILY_TEMPLATES["mistral_v3_tekken"]  # turns end in eos_token (<|im_end|> for the fixture)
    ids, labels = chat(tok, template, eot=["[/INST]"] if len(tok.encode("[/INST]")) == 1 else None)
    assert trained(tok, ids, labels) == "Hello!<|im_end|>4<|im_end|>"
    ids, labels = chat(tok, template, eot=["<|im_end|>"], train_on_eos="none")
    assert trained(tok, ids, labels) == "Hello!4"


def test_an_eot_token_must_be_one_token(tok):
    with pytest.raises(UserError, match="eot_tokens: '<end_of_turn>' is 11 tokens to this tokenizer") as caught:
        eot_token_ids(recipe(eot_tokens=["<end_of_turn>"]), tok)
    assert "add it under tokens" in caught.value.hint


def test_reasoning_trains_with_its_answer_and_per_message_training_flags(tok):
    template = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m.get('reasoning') %}" \
               "{{ '<think>' + m['reasoning'] + '</think>' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}" \
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"  # fmt: skip
    messages = [CHAT[0], {**CHAT[1], "thought": "greet back", "train": False}, CHAT[2], {**CHAT[3], "thought": "sum"}]
    ids, labels = chat(tok, template, messages=messages, field_thinking="thought", template_thinking_key="reasoning",
                       message_field_training="train")  # fmt: skip
    assert trained(tok, ids, labels) == "<think>sum</think>4<|im_end|>"


# --- data preparation --------------------------------------------------------------------------------------------


def test_exact_duplicates_and_short_examples_are_dropped(tmp_path, tok):
    rows = [{"text": "one two three four five"}] * 3 + [{"text": "six seven eight nine ten eleven"}, {"text": "hi"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    r = recipe(datasets=[{"path": str(data), "type": "completion"}], dataset_prepared_path="",
               dataset_exact_deduplication=True, min_sample_len=4)  # fmt: skip
    groups, stats = tokenize_with_cache(r, tok)
    assert len(groups["train"]) == 2 and stats["dropped_duplicates"] == 2 and stats["dropped_too_short"] == 1


def test_streaming_reads_only_what_max_steps_needs(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = recipe(streaming=True, max_steps=10, micro_batch_size=2, gradient_accumulation_steps=3)
    assert stream_budget(r) == int(10 * 2 * 3 * 2 * 1.1) + 1
    packed = recipe(streaming=True, max_steps=10, sample_packing=True, sequence_len=100)
    assert stream_budget(packed) == (int(10 * 2 * 1.1) + 1) * 100
    assert stream_budget(recipe()) is None


def test_skip_drops_the_first_rows(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} of the file"} for i in range(5)])
    r = recipe(datasets=[{"path": str(data), "type": "completion", "skip": 3}], dataset_prepared_path="")
    groups, _ = tokenize_with_cache(r, tok)
    assert len(groups["train"]) == 2


# --- Axolotl's named chat templates ------------------------------------------------------------------------------


def test_family_templates_match_the_recipe_schema():
    assert set(FAMILY_TEMPLATES) == set(FAMILY_CHAT_TEMPLATES)


@pytest.mark.parametrize("conversation", ["with_system", "without_system"])
@pytest.mark.parametrize("name", sorted(FAMILY_TEMPLATES))
def test_family_templates_are_prefix_stable(tok, name, conversation):
    messages = [SYSTEM, *CHAT] if conversation == "with_system" else CHAT
    template = FAMILY_TEMPLATES[name]
    for i in range(1, len(messages)):
        longer = render(template, messages[: i + 1], tok)
        assert longer.startswith(render(template, messages[:i], tok)), (name, i)
        if messages[i]["role"] == "assistant":
            assert longer.startswith(render(template, messages[:i], tok, add_generation_prompt=True)), (name, i)
    text = render(template, messages, tok)
    positions = [text.index(m["content"]) for m in messages]
    assert positions == sorted(positions)


def test_family_templates_exact_formats(tok):
    bos, eos = tok.bos_token, tok.eos_token
    two = [SYSTEM, *CHAT[:2]]
    assert render(FAMILY_TEMPLATES["mistral_v7_tekken"], two, tok) == (
        f"{bos}[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello!{eos}"
    )
    assert render(FAMILY_TEMPLATES["cohere"], two, tok) == (
        f"{bos}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
        "<|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>"
    )
    assert render(FAMILY_TEMPLATES["llama4"], two, tok) == (
        f"{bos}<|header_start|>system<|header_end|>\n\nBe brief.<|eot|><|header_start|>user<|header_end|>\n\nHi<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\nHello!<|eot|>"
    )
    assert render(FAMILY_TEMPLATES["deepseek_v3"], two, tok) == (
        f"{bos}Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
    )
    assert (
        render(FAMILY_TEMPLATES["exaone"], CHAT[:2], tok)
        == "[|system|][|endofturn|]\n[|user|]Hi\n[|assistant|]Hello![|endofturn|]\n"
    )
    assert render(FAMILY_TEMPLATES["gemma4"], two, tok) == (
        f"{bos}<|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n"
    )
    assert render(FAMILY_TEMPLATES["mistral_v1"], two, tok) == f"{bos} [INST] Be brief.\n\nHi [/INST] Hello!{eos}"
    with pytest.raises(UserError, match="mistral_v1: only user, assistant roles"):
        render(FAMILY_TEMPLATES["mistral_v1"], [*CHAT[:1], {"role": "tool", "content": "x"}], tok)


def test_fallback_template_prefers_the_tokenizers_own(tok):
    assert resolve_chat_template("tokenizer_default_fallback_llama3", None, tok) == tok.chat_template

    class NoTemplate:
        chat_template = None

    assert resolve_chat_template("tokenizer_default_fallback_llama4", None, NoTemplate()) == FAMILY_TEMPLATES["llama4"]


# --- value forms of Axolotl's earlier releases ------------------------------------------------------------------

FORMS = [
    ({"gradient_checkpointing": "unsloth"}, {"gradient_checkpointing": True}),
    ({"gradient_checkpointing": "offload"}, {"gradient_checkpointing": True}),
    (
        {"logging_steps": 0.05, "save_steps": 0.25, "eval_steps": 0.1},
        {"logging_steps": 0.05, "save_steps": 0.25, "eval_steps": 0.1},
    ),  # fmt: skip
    ({"logging_steps": 10.0, "save_steps": 100.0}, {"logging_steps": 10, "save_steps": 100}),
    (
        {"wandb_project": "p", "wandb_watch": False, "wandb_log_model": False},
        {"wandb_watch": "false", "wandb_log_model": "false"},
    ),  # fmt: skip
    ({"save_strategy": False, "eval_strategy": False}, {"save_strategy": "no", "eval_strategy": "no"}),
    ({"deepspeed": False, "fsdp": False}, {"deepspeed": None, "fsdp": None}),
    ({"bf16": "full"}, {"bf16": True}),
    ({"max_packed_sequence_len": 1024}, {"sample_packing": True, "sequence_len": 1024}),
    ({"max_packed_sequence_len": 4096, "sequence_len": 2048}, {"sample_packing": True, "sequence_len": 2048}),
    ({"xformers_attention": True}, {"attn_implementation": "sdpa"}),
    ({"xformers_attention": False}, {"attn_implementation": None}),
    (
        {"rope_scaling": {"type": "linear", "factor": 2.0}, "model_config": {"max_position_embeddings": 8192}},
        {
            "overrides_of_model_config": {
                "max_position_embeddings": 8192,
                "rope_scaling": {"type": "linear", "factor": 2.0},
            }
        },
    ),
    ({"eval_table_size": 5, "eval_table_max_new_tokens": 128}, {}),
    ({"fsdp": "full_shard auto_wrap"}, {"fsdp": ["full_shard", "auto_wrap"]}),
    ({"fsdp": ["full_shard", "auto_wrap"]}, {"fsdp": ["full_shard", "auto_wrap"]}),
    ({"flash_attention": True}, {"attn_implementation": "flash_attention_2"}),
    ({"sdp_attention": True}, {"attn_implementation": "sdpa"}),
    ({"load_in_4bit": True, "adapter": "qlora"}, {"load_in_4bit": True, "adapter": "qlora"}),
]


@pytest.mark.parametrize(("written", "resolved"), FORMS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_older_value_forms_resolve_as_axolotl_meant(written, resolved):
    r = recipe(**written)
    assert {key: getattr(r, key) for key in resolved} == resolved


def test_older_value_forms_are_said_once():
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/r"}
    written = {"gradient_checkpointing": "unsloth", "max_packed_sequence_len": 1024, "xformers_attention": True,
               "bf16": "full"}  # fmt: skip
    notes = recipe_from_mapping({**base, **written}, Path("r.yaml"), check_files=False).notes
    for said in ("gradient_checkpointing: unsloth: read as gradient_checkpointing: true with activation_offloading: "
                 "true", "max_packed_sequence_len: 1024: read as sample_packing: true at sequence_len: "
                 "1024 (a key of Axolotl since v0.3.0, deprecated since v0.5.0", "xformers_attention: true: read as "
                 "attn_implementation: sdpa", "bf16: full"):  # fmt: skip
        assert sum(note.startswith(said) for note in notes) == 1, (said, notes)


@pytest.mark.parametrize(
    ("written", "named"),
    [
        ({"logging_steps": 2.5}, "logging_steps: 2.5 is neither a whole number"),
        ({"max_packed_sequence_len": "long"}, "max_packed_sequence_len: 'long' must be a whole number"),
        ({"xformers_attention": True, "flash_attention": True}, "xformers_attention: true and flash_attention: true"),
        ({"xformers_attention": True, "attn_implementation": "eager"}, "attn_implementation: eager ask for"),
        ({"rope_scaling": "linear"}, "rope_scaling: 'linear' must be a mapping"),
    ],
)
def test_older_value_forms_that_cannot_be_honoured_are_refused_by_name(written, named):
    with pytest.raises(UserError, match=named):
        recipe(**written)


def test_older_value_forms_plan_and_reach_training_arguments(tmp_path):
    from llmtune.plan import make_cluster, make_plan
    from llmtune.train.engine.arguments import training_arguments

    plan = make_plan(recipe(fsdp="full_shard auto_wrap", fsdp_config={"fsdp_transformer_layer_cls_to_wrap": "X"}),
                     make_cluster(2, device="cuda"))  # fmt: skip
    assert plan.strategy == "fsdp1"
    plan = make_plan(
        recipe(xformers_attention=True, load_in_4bit=True, adapter="qlora"), make_cluster(1, device="cuda")
    )
    assert plan.kernels["attention"] == "sdpa"
    cpu = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "single", "micro_batch_size": 1,
           "data_parallel_size": 1, "gradient_accumulation_steps": 1}  # fmt: skip
    r = recipe(output_dir=str(tmp_path), logging_steps=0.05, save_steps=0.25, gradient_checkpointing="unsloth")
    args = training_arguments(r, cpu, 8, False)
    assert (args.logging_steps, args.save_steps) == (0.05, 0.25)
    checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    assert checkpointing is True


@pytest.mark.parametrize("family", ["phimoe", "falcon_h1"])
def test_lora_target_linear_leaves_out_what_peft_selects_and_cant_adapt(family):
    """Found by training tiny models of every family transformers has: peft's all-linear wraps Phi-MoE's router (an
    nn.Linear returning a tuple: the forward failed) and Falcon-H1's out_proj (which peft itself then refuses)."""
    import torch
    import transformers

    from llmtune.train.model.adapters import attach_adapter

    tokens = len(load_tokenizer())
    if family == "phimoe":
        config = transformers.PhimoeConfig(vocab_size=tokens, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
        left_out = ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    else:
        config = transformers.FalconH1Config(vocab_size=tokens, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                             mamba_d_state=16, head_dim=16)  # fmt: skip
        left_out = ["conv1d", "out_proj"]
    model = attach_adapter(transformers.AutoModelForCausalLM.from_config(config),
                           recipe(adapter="lora", lora_target_linear=True))  # fmt: skip
    assert sorted(model.peft_config["default"].exclude_modules) == left_out
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    model(input_ids=ids, labels=ids).loss.backward()  # trains: the forward and backward run
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_fsdp_wraps_a_text_model_whose_family_lists_a_vision_block():
    """Qwen3.5's text model lists its vision block in _no_split_modules; accelerate's wrap policy refused the class it
    can't find ("Could not find the transformer layer class Qwen3_5VisionBlock") on every rank."""
    import transformers
    from accelerate.utils import FullyShardedDataParallelPlugin

    from llmtune.train.model.load import keep_present_layer_classes

    config = transformers.Qwen3_5TextConfig(vocab_size=len(load_tokenizer()), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    policy = lambda: FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")  # noqa: E731
    with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5VisionBlock"):
        policy().set_auto_wrap_policy(model)
    keep_present_layer_classes(model)
    assert set(model._no_split_modules) == {"Qwen3_5DecoderLayer"}
    policy().set_auto_wrap_policy(model)  # wraps each decoder layer
