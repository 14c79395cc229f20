"""GRPO's generation placement, tested by configuration (vLLM needs GPUs): what the plan says and computes for
in-process, colocated and server generation, what TRL's config receives, and the one-line refusals around
`llmtune vllm-serve` and a server that never answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.memory.facts import ModelFacts
from llmtune.recipe.loader import recipe_from_mapping

FACTS = ModelFacts(model_type="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                   intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)  # fmt: skip


def recipe(**trl):
    raw = {"base_model": "org/model", "rl": "grpo", "output_dir": "/runs/g", "micro_batch_size": 4, "bf16": True,
           "gradient_accumulation_steps": 2, "sequence_len": 1024, "adapter": "lora", "lora_target_linear": True,
           "trl": {"reward_funcs": ["rwd.r"], "num_generations": 8, "max_completion_length": 256, **trl},
           "datasets": [{"path": "d.jsonl", "type": "rwd.t"}]}  # fmt: skip
    return recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe


def test_in_process_generation_names_its_batch_and_kv_cache():
    from llmtune.plan import generation

    r = recipe()
    assert generation.generation_sequences(r, 2) == 8  # micro 4 x steps per generation (the accumulation, 2)
    kv = generation.kv_cache_bytes(r, FACTS, 2, mixed=True)
    assert kv == 2 * 16 * 8 * 64 * 2 * 1024 * 8  # keys+values x layers x kv heads x head size x bf16 x tokens x seqs
    [line] = generation.describe(r, "g.yaml", None, 80 * 2**30, False, FACTS, 2, True)
    assert "8 completions per prompt, up to 256 tokens, 8 sequences at once per rank; KV cache about 0.25 GB" in line


def test_colocated_vllm_takes_what_training_leaves_and_the_worker_passes_it_on():
    from llmtune.plan import generation
    from llmtune.train.rl.trainers import config_arguments

    r = recipe(use_vllm=True, vllm_mode="colocate")
    assert generation.colocate_share(r, 40 * 2**30, 80 * 2**30) == 0.4  # 1 - 40/80 - the 0.10 margin
    assert generation.colocate_share(recipe(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2),
                                     40 * 2**30, 80 * 2**30) == 0.2  # the recipe's own wins  # fmt: skip
    arguments = config_arguments(r, "cuda", vllm_share=0.4)
    assert arguments["use_vllm"] and arguments["vllm_mode"] == "colocate"
    assert arguments["vllm_gpu_memory_utilization"] == 0.4 and arguments["log_completions"] is False
    assert config_arguments(r, "cpu")["use_vllm"] is False  # the rehearsal generates in the training process


def test_server_mode_plans_the_server_command_and_the_wait():
    raw = {"vllm": {"port": 8011, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9}}
    r = recipe_from_mapping({**recipe(use_vllm=True, vllm_mode="server").model_dump(exclude_unset=True), **raw},
                            Path("r.yaml"), check_files=False).recipe  # fmt: skip
    plan = make_plan(r, make_cluster(2, device="cuda"))
    text = "\n".join(plan.kernels["generation"])
    assert "a vLLM server at 0.0.0.0:8011 on 2 GPU(s) of its own" in text and "waits up to 240 s" in text
    assert (
        "trl vllm-serve --model org/model --tensor-parallel-size 2" in text and "--gpu-memory-utilization 0.9" in text
    )
    from llmtune.train.rl.trainers import config_arguments

    assert config_arguments(r, "cuda")["vllm_server_port"] == 8011
    rehearsal = make_plan(r, make_cluster(2, device="cpu"))
    assert "the CPU rehearsal generates in-process" in rehearsal.kernels["generation"][0]


def test_vllm_serve_and_the_wait_are_one_line_when_they_cant_go_on(monkeypatch):
    from llmtune.launch import vllm_server
    from llmtune.launch.net import free_port

    with pytest.raises(UserError, match="generates in-process: llmtune vllm-serve is for"):
        vllm_server.serve(recipe(), "g.yaml")
    port = free_port()
    r = recipe(use_vllm=True, vllm_mode="server", vllm_server_port=port, vllm_server_timeout=2)
    monkeypatch.setattr(vllm_server.time, "sleep", lambda s: None)
    with pytest.raises(UserError, match=f"the vLLM server at 127.0.0.1:{port} did not answer within 2 s") as caught:
        vllm_server.wait_for(r, "g.yaml", lambda line: None)
    assert "llmtune vllm-serve g.yaml" in caught.value.hint


@pytest.mark.parametrize(("trl", "words"), [
    ({"reward_funcs": []}, "needs trl.reward_funcs"),
    ({"reward_weights": [1.0, 2.0]}, "trl.reward_weights has 2 weights for 1 reward function"),
    ({"num_generations": 1}, "needs at least 2"),
    ({"vllm_mode": "server"}, "without trl.use_vllm: true"),
    ({"multi_objective_aggregation": "mean"}, "is not one of sum_then_normalize, normalize_then_sum"),
])  # fmt: skip
def test_what_grpo_cant_honour_is_one_line_naming_the_key(trl, words):
    with pytest.raises(UserError, match=words):
        recipe(**trl)
    with pytest.raises(UserError, match="rl: gdpo normalises each reward before summing"):
        recipe_from_mapping({**recipe().model_dump(exclude_unset=True), "rl": "gdpo",
                             "trl": {"reward_funcs": ["a.b"], "multi_objective_aggregation": "sum_then_normalize"}},
                            Path("r.yaml"), check_files=False)  # fmt: skip


def test_a_generation_or_eval_batch_of_partial_prompt_groups_is_refused_at_plan_time():
    """TRL's GRPOConfig refuses these after the model loaded (with a two-process launch, on every rank): the plan,
    which knows the ranks, says it first with a micro-batch that works."""
    make_plan(recipe(), make_cluster(2))  # 4 x 2 ranks x 2 steps = 16: two groups of 8
    with pytest.raises(UserError, match=r"micro_batch_size 4 x 1 rank x 2 step\(s\) per generation = 8 completions"):
        make_plan(recipe(num_generations=16), make_cluster(1))  # 8 completions, groups of 16
    with pytest.raises(UserError, match="num_generations 3") as err:
        make_plan(recipe(num_generations=3), make_cluster(2))
    assert err.value.hint == "e.g. micro_batch_size 3, or a num_generations that divides 16"
    with pytest.raises(UserError, match="trl.generation_batch_size 6 is not a multiple of micro_batch_size 4 x 2"):
        make_plan(recipe(generation_batch_size=6), make_cluster(2))
    with pytest.raises(UserError, match="both set the generation batch"):
        make_plan(recipe(generation_batch_size=16, steps_per_generation=2), make_cluster(2))
    evaluated = recipe(num_generations=4).model_copy(update={"val_set_size": 0.1, "eval_batch_size": 1})
    with pytest.raises(UserError, match=r"eval batch \(eval_batch_size x 2 ranks = 2\) is not a multiple of the 4"):
        make_plan(evaluated, make_cluster(2))
    make_plan(evaluated.model_copy(update={"eval_strategy": "no"}), make_cluster(2))  # no eval, no eval batch


def test_a_reward_name_that_is_neither_a_function_nor_a_model_is_refused_when_read(tmp_path, monkeypatch):
    from llmtune.recipe.loader import load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rwd.py").write_text("def r(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "local_rm").mkdir()

    def read(*names):
        raw = {"base_model": "org/model", "rl": "grpo", "output_dir": str(tmp_path / "out"), "datasets": [
            {"path": "d.jsonl"}], "trl": {"reward_funcs": list(names), "num_generations": 2}}  # fmt: skip
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(raw))
        return load_recipe(path).recipe

    with pytest.raises(UserError) as caught:
        read("rwd.r", "brief")
    assert caught.value.one_line().startswith(
        "trl.reward_funcs[1]: 'brief' is neither module.function (a .py beside the recipe) nor a reward model folder"
    )
    # a function, a hub id (org/name) and a local folder all still read
    rewards = read("rwd.r", "org/reward-model", "local_rm").trl["reward_funcs"]
    assert rewards[:2] == ["rwd.r", "org/reward-model"] and rewards[2] == str(tmp_path / "local_rm")


def test_a_function_module_of_the_same_name_in_another_folder_is_that_folders(tmp_path):
    """Two recipes' rwd.py in one process (eval after train, the test suite): the first one imported was kept, and
    the second recipe's functions were 'not defined'."""
    from llmtune.recipe.user_code import resolve

    for name, value in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rwd.py").write_text(f"def f_{name}(**kwargs):\n    return {value}\n")
    assert resolve("rwd.f_a", tmp_path / "a", "k")() == 1
    assert resolve("rwd.f_b", tmp_path / "b", "k")() == 2
    assert resolve("rwd.f_a", tmp_path / "a", "k")() == 1


def test_a_reward_module_in_the_working_directory_resolves_as_under_axolotl(tmp_path, monkeypatch):
    """Axolotl's GRPO examples keep rwd.py in the directory `axolotl train examples/...yaml` runs from, not beside
    the recipe: the recipe's folder first, then the working directory, then the Python path; missing, one line names
    both places."""
    from llmtune.recipe.user_code import resolve

    (tmp_path / "examples").mkdir()
    (tmp_path / "rwd.py").write_text("def format_reward(**kwargs):\n    return 'cwd'\n")
    monkeypatch.chdir(tmp_path)
    assert resolve("rwd.format_reward", tmp_path / "examples", "trl.reward_funcs[0]")() == "cwd"
    (tmp_path / "examples" / "rwd.py").write_text("def format_reward(**kwargs):\n    return 'beside'\n")
    assert resolve("rwd.format_reward", tmp_path / "examples", "trl.reward_funcs[0]")() == "beside"
    with pytest.raises(UserError) as caught:
        resolve("rewards_missing.f", tmp_path / "examples", "trl.reward_funcs[1]")
    assert str(tmp_path / "examples" / "rewards_missing.py") in caught.value.message
    assert str(tmp_path / "rewards_missing.py") in caught.value.message
    assert caught.value.hint == "put rewards_missing.py beside the recipe or in the working directory"


def test_a_kl_term_on_an_adapter_from_lora_model_dir_plans_the_frozen_copy_the_run_keeps():
    """GRPO with beta > 0 on an adapter: the base with the adapter off is the reference, unless the adapter came from
    lora_model_dir, where the run keeps a frozen copy of it (the plan had said 'none' and left the copy out)."""
    from llmtune.plan.memory.preference import no_reference, reference_bytes

    plain = recipe(beta=0.04)
    assert no_reference(plain) == "none: the base model with the adapter disabled is the reference"
    onward = plain.model_copy(update={"lora_model_dir": "/runs/sft"})
    assert no_reference(onward) is None and reference_bytes(onward, FACTS, True, trainable=1000) == 4000
