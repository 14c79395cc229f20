"""chat and infer on a run trained on Axolotl's older prompt formats: prompted with the text training wrote, or told."""

from __future__ import annotations

import io
import json

import pytest
from tiny import load_tokenizer, make_tiny_model

from llmtune.post import generate
from llmtune.post.generate import Loaded, prompt_text, trained_prompt, trained_prompt_format, untrained_prompt_note
from llmtune.recipe.data import DatasetSpec
from llmtune.train.data.formats import IGNORE, FormatContext, format_for


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def run_with(tmp_path, *datasets: dict, **recipe) -> object:
    run = tmp_path / "run"
    (run / "llmtune").mkdir(parents=True, exist_ok=True)
    plan = {"recipe": {"datasets": [{"path": "x.jsonl", "conversation": None, **d} for d in datasets], **recipe}}
    (run / "llmtune" / "plan.json").write_text(json.dumps(plan))
    return run


def trained(tok, spec: dict, row: dict) -> tuple[list[int], list[int]]:
    """(ids, labels) of one row as training tokenizes it."""
    spec = DatasetSpec(path="x", **spec)
    [(ids, labels)] = format_for(spec)(row, FormatContext(tok, spec, False, 512, None))
    return ids, labels


def masked_prompt(ids, labels) -> list[int]:
    return ids[: labels.index(next(label for label in labels if label != IGNORE))]


ALPACA_ROW = {"instruction": "Repeat stone", "input": "twice", "output": "stone stone"}
INSTRUCT = [  # (dataset entry, training row, the prompt as infer gets it: (row, prompt))
    ({"type": "alpaca"}, ALPACA_ROW, (ALPACA_ROW, "Repeat stone")),
    ({"type": "alpaca:chat"}, ALPACA_ROW, (ALPACA_ROW, "Repeat stone")),
    ({"type": "alpaca_chat"}, {**ALPACA_ROW, "input": ""}, ({}, "Repeat stone")),
    ({"type": "alpaca_chat", "conversation": "chatml"}, {**ALPACA_ROW, "input": ""}, ({}, "Repeat stone")),
    ({"type": "alpaca:phi"}, ALPACA_ROW, (ALPACA_ROW, "Repeat stone")),
    ({"type": "oasst"}, {"INSTRUCTION": "Repeat stone", "RESPONSE": "stone"}, ({}, "Repeat stone")),
    ({"type": "gpteacher"}, {"instruction": "Repeat it", "input": "", "response": "it"}, ({}, "Repeat it")),
    ({"type": "alpaca_chat.load_qa"}, {"question": "Sky colour?", "answer": "blue"}, ({}, "Sky colour?")),
    ({"type": "explainchoice"}, {"question": "Pick", "choices": ["a"], "solution": "a"}, ({}, "Pick")),
]


@pytest.mark.parametrize(
    "spec,row,asked", INSTRUCT, ids=[s["type"] + str(s.get("conversation") or "") for s, *_ in INSTRUCT]
)
def test_chat_prompts_an_instruct_run_with_the_tokens_training_masked(tmp_path, tok, spec, row, asked):
    # a run trained on oasst, alpaca:chat, alpaca_chat... was prompted with the chat template (ChatML), silently
    fmt = trained_prompt_format(run_with(tmp_path, spec))
    assert fmt is not None
    if spec["type"] == "explainchoice":  # its input is the choices: an instruction alone has none
        row = {**row, "choices": []}
    ids, labels = trained(tok, spec, row)
    text = prompt_text(Loaded(None, tok, "run", fmt), *asked, raw=False)
    assert tok(text, add_special_tokens=False)["input_ids"] == masked_prompt(ids, labels)


SHAREGPT = ["vicuna_v1.1", "chatml", "llama-2", "llama3", "mistral", "zephyr", "alpaca", "gemma", "dolly_v2"]


@pytest.mark.parametrize("conversation", SHAREGPT)
def test_chat_writes_a_sharegpt_conversation_as_training_wrote_it_up_to_the_answer(tmp_path, tok, conversation):
    spec = {"type": "sharegpt", "conversation": conversation}
    fmt = trained_prompt_format(run_with(tmp_path, spec))
    assert fmt == f"sharegpt:{conversation}"
    turns = [("human", "Name a colour"), ("gpt", "red"), ("human", "Another one"), ("gpt", "blue")]
    ids, labels = trained(tok, spec, {"conversations": [{"from": f, "value": v} for f, v in turns]})
    history = [{"role": "user" if f == "human" else "assistant", "content": v} for f, v in turns[:3]]
    prompt = trained_prompt(tok, fmt, history)
    full = tok.decode(ids)
    last = max(i for i, label in enumerate(labels) if label != IGNORE and labels[i - 1] == IGNORE)
    masked = tok.decode(ids[:last])  # everything before the last answer: the turns and its role prefix
    # the prompt is the masked text, plus the whitespace the role prefix ends with (FastChat's generation prompt)
    assert prompt.startswith(masked) and not prompt[len(masked) :].strip(), (prompt, masked)
    assert full.startswith(prompt) and full[len(prompt) :].lstrip().startswith("blue")


def test_a_system_message_takes_the_formats_system_slot(tmp_path, tok):
    fmt = trained_prompt_format(run_with(tmp_path, {"type": "alpaca_w_system.load_instruct"}))
    row = {**ALPACA_ROW, "input": "", "system": "Answer in French."}
    ids, labels = trained(tok, {"type": "alpaca_w_system.load_instruct"}, row)
    system = [{"role": "system", "content": "Answer in French."}]
    text = trained_prompt(tok, fmt, [*system, {"role": "user", "content": "Repeat stone"}])
    assert tok(text, add_special_tokens=False)["input_ids"] == masked_prompt(ids, labels)
    shared = trained_prompt(tok, "sharegpt:vicuna_v1.1", [*system, {"role": "user", "content": "hi"}])
    assert shared.startswith("Answer in French. USER: hi")


@pytest.mark.parametrize(
    "datasets,said",
    [
        ([{"type": "alpaca"}, {"type": "chat_template"}], "trained on alpaca, chat_template data"),
        ([{"type": "completion"}], "trained on completion data"),
        ([{"type": "alpaca"}, {"type": "oasst"}], "trained on alpaca, oasst data"),
        ([{"type": "orcamini"}], "trained on orcamini data"),
        (
            [{"type": {"field_instruction": "q", "format": "{instruction}"}}],
            "trained on user-defined (type: {...}) data",
        ),
    ],
)
def test_a_run_whose_prompts_chat_cant_write_is_told_so(tmp_path, datasets, said):
    run = run_with(tmp_path, *datasets)
    assert trained_prompt_format(run) is None
    note = untrained_prompt_note(run, "run")
    assert said in note and "the tokenizer's chat template (--raw sends them as plain text)" in note


def test_a_chat_template_run_is_prompted_with_its_template_without_a_note(tmp_path):
    run = run_with(tmp_path, {"type": "chat_template"})
    assert trained_prompt_format(run) is None and untrained_prompt_note(run, "run") is None
    # sharegpt with the recipe's default_system_message swapped in: not written here, so said
    run = run_with(tmp_path, {"type": "sharegpt", "conversation": "chatml"}, chat_template="chatml",
                   default_system_message="Be brief.")  # fmt: skip
    assert trained_prompt_format(run) is None and "sharegpt" in untrained_prompt_note(run, "run")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("model")
    make_tiny_model(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def chat_once(monkeypatch, loaded, system, raw=False) -> tuple[str, list[str]]:
    """One message through chat: (what it printed, the prompts the model was given)."""
    seen = []
    real = loaded.tokenizer.__class__.__call__
    monkeypatch.setattr(generate, "load_for_generation", lambda *a, **k: loaded)
    monkeypatch.setattr(loaded.tokenizer.__class__, "__call__",
                        lambda self, text, **k: (seen.append(text), real(self, text, **k))[1])  # fmt: skip
    out = io.StringIO()
    generate.chat("run", generate.Sampling(2), system, raw, io.StringIO("Repeat stone\n/exit\n"), out)
    return out.getvalue(), [s for s in seen if isinstance(s, str) and "Repeat stone" in s]


def test_chat_on_an_alpaca_run_puts_system_in_its_slot(monkeypatch, tok, tiny_model):
    printed, prompts = chat_once(monkeypatch, Loaded(tiny_model, tok, "run", "alpaca"), "Answer in French.")
    assert prompts == ["Answer in French.\n\n### Instruction:\nRepeat stone\n\n### Response:\n"]
    assert "--system as its system prompt" in printed


def test_a_system_message_chat_cant_use_is_said_not_dropped(monkeypatch, capsys, tok, tiny_model):
    # --system with --raw (or a gemma conversation, which has no system message) was dropped silently
    _, prompts = chat_once(monkeypatch, Loaded(tiny_model, tok, "run", None), "Answer in French.", raw=True)
    assert prompts == ["Repeat stone"]
    assert "note: --system is not used: messages go in as plain text" in capsys.readouterr().err
    _, prompts = chat_once(monkeypatch, Loaded(tiny_model, tok, "run", "sharegpt:gemma"), "Answer in French.")
    assert prompts == ["<bos><start_of_turn>user\nRepeat stone<end_of_turn>\n<start_of_turn>model\n"]
    assert "note: --system is not used: the sharegpt:gemma prompt has no system message" in capsys.readouterr().err
