"""chat_template_kwargs (Axolotl's; e.g. Qwen3's enable_thinking): every rendering of the recipe's tokenizer gets
them: training rows, the prompts of inference and eval, GRPO's prompts (TRL renders those: its config gets them).
It was refused."""

from __future__ import annotations

import json
from pathlib import Path

from tiny import TOKENIZER_DIR, write_jsonl

from llmtune.recipe.loader import recipe_from_mapping

# a template that writes its variables where Qwen3's writes enable_thinking: into the text a row trains on too
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")  # fmt: skip


def test_a_training_row_and_an_inference_prompt_render_with_the_recipe_s_kwargs(run_cli, write_recipe, tmp_path):
    from llmtune.post.generate import render
    from llmtune.train.model.load import load_tokenizer

    rows = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "2+2?"},
                                                               {"role": "assistant", "content": "4"}]}])  # fmt: skip
    keys = {"base_model": str(TOKENIZER_DIR), "datasets": [{"path": str(rows), "type": "chat_template"}],
            "chat_template": "jinja", "chat_template_jinja": TEMPLATE.replace("{% endfor %}", "{% endfor %}{{ tag }}"),
            "chat_template_kwargs": {"tag": "TAGGED", "enable_thinking": False},
            "dataset_prepared_path": str(tmp_path / "prep")}  # fmt: skip
    done = run_cli("preprocess", write_recipe(keys), "--debug")
    assert done.code == 0, done.err
    shown = [json.loads(line.split(maxsplit=2)[2]) for line in done.out.splitlines() if line.startswith(("  +", "  -"))]
    assert "".join(shown).endswith("<|im_end|>\nTAGGED"), shown  # the row's rendering got the variable
    recipe = recipe_from_mapping(keys, Path("r.yml"), check_files=False).recipe
    tokenizer = load_tokenizer(recipe, str(TOKENIZER_DIR))
    prompt = render(tokenizer, [{"role": "user", "content": "2+2?"}], raw=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), prompt
    # a tokenizer loaded for a recipe without them renders as before
    plain = load_tokenizer(recipe.model_copy(update={"chat_template_kwargs": None}), str(TOKENIZER_DIR))
    assert render(plain, [{"role": "user", "content": "2+2?"}], raw=False).endswith("<|im_start|>assistant\n")


def test_grpo_s_config_gets_them_unless_trl_says_its_own(tmp_path):
    from llmtune.train.rl.trainers import online_arguments

    (tmp_path / "rwd.py").write_text("def fn(completions, **kw):\n    return [0.0 for _ in completions]\n")
    base = {"base_model": "org/m", "output_dir": str(tmp_path / "o"), "rl": "grpo",
            "datasets": [{"path": str(tmp_path / "rows.jsonl")}], "chat_template_kwargs": {"enable_thinking": False},
            "trl": {"num_generations": 2, "reward_funcs": ["rwd.fn"]}}  # fmt: skip
    recipe = recipe_from_mapping(base, tmp_path / "r.yml", check_files=False).recipe
    assert online_arguments(recipe, "cpu")["chat_template_kwargs"] == {"enable_thinking": False}
    own = {**base, "trl": {**base["trl"], "chat_template_kwargs": {"enable_thinking": True}}}
    recipe = recipe_from_mapping(own, tmp_path / "r.yml", check_files=False).recipe
    assert online_arguments(recipe, "cpu")["chat_template_kwargs"] == {"enable_thinking": True}


def test_a_name_llmtune_passes_itself_is_refused_as_a_template_variable():
    import pytest

    from llmtune.errors import UserError

    keys = {"base_model": "org/m", "output_dir": "/x", "datasets": [{"path": "o/d", "type": "alpaca"}]}
    with pytest.raises(UserError, match="chat_template_kwargs: .*add_generation_prompt: set by llmtune"):
        recipe_from_mapping({**keys, "chat_template_kwargs": {"add_generation_prompt": True}}, Path("r.yml"),
                            check_files=False)  # fmt: skip
