"""Parts of a message trained and masked as Axolotl's chat_template does: content parts with train/weight flags (text
under text, content or value), message_field_training_detail ranges, split_thinking; reasoning rendered by the qwen3
template and said when a template drops it."""

from __future__ import annotations

import pytest
from tiny import load_tokenizer, pieces

from llmtune.recipe.data import DatasetSpec
from llmtune.train.data.formats import FormatContext, RowError, format_for
from llmtune.train.data.templates import ALL_TEMPLATES

THINK = "Let me think step by step..."
ANSWER = " The answer is 4."
QUESTION = {"role": "user", "content": "What is 2+2?"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def run(tok, row, template=None, **spec):
    spec = DatasetSpec(path="x", type="chat_template", **spec)
    template = template or tok.chat_template
    [(ids, labels)] = format_for(spec)(row, FormatContext(tok, spec, False, 512, template))
    return ids, labels


def test_content_parts_train_where_their_flags_say_and_read_text_content_or_value(tok):
    """A part with train: false (or weight: 0) is masked; one without a flag trains; the text may be under text,
    content or value. Before, the flags were dropped (the masked part trained) and text under content or value
    was read as empty (every row 'without trained tokens')."""
    for key in ("text", "content", "value"):
        answer = [{"type": "text", key: THINK, "train": False}, {"type": "text", key: ANSWER, "train": True}]
        row = {"messages": [{"role": "user", "content": [{"type": "text", key: QUESTION["content"]}]},
                            {"role": "assistant", "content": answer}]}  # fmt: skip
        ids, labels = run(tok, row)
        assert pieces(tok, ids, labels) == [f"{ANSWER}<|im_end|>"], key
        assert "What is 2+2?" in tok.decode(ids) and THINK in tok.decode(ids)
    weighted = [{"type": "text", "text": THINK, "weight": 0}, {"type": "text", "text": ANSWER}]
    ids, labels = run(tok, {"messages": [QUESTION, {"role": "assistant", "content": weighted}]})
    assert pieces(tok, ids, labels) == [f"{ANSWER}<|im_end|>"]
    # no flag on any part: the message trains whole, as a plain string would
    plain = [{"type": "text", "text": THINK}, {"type": "text", "text": ANSWER}]
    ids, labels = run(tok, {"messages": [QUESTION, {"role": "assistant", "content": plain}]})
    assert pieces(tok, ids, labels) == [f"{THINK}{ANSWER}<|im_end|>"]


def test_a_training_detail_trains_its_ranges_whatever_the_role_and_masks_a_straddling_token(tok):
    """message_field_training_detail: {begin_offset, end_offset (inclusive), train} over the content. A message with
    one trains where it says, a user's too (Axolotl's should_train); a token across a trained and a masked range is
    masked."""
    content = THINK + ANSWER
    detail = [{"begin_offset": 0, "end_offset": len(THINK) - 1, "train": False},
              {"begin_offset": len(THINK), "end_offset": len(content) - 1, "train": True}]  # fmt: skip
    row = {"messages": [QUESTION, {"role": "assistant", "content": content, "detail": detail}]}
    ids, labels = run(tok, row, message_field_training_detail="detail")
    assert pieces(tok, ids, labels) == [f"{ANSWER}<|im_end|>"]
    # a user turn with a detail trains its trained range, and its end-of-turn token (a trained turn, as in Axolotl)
    user = {"role": "user", "content": "Solve: 2+2", "detail": [{"begin_offset": 7, "end_offset": 9, "train": True}]}
    ids, labels = run(tok, {"messages": [user, {"role": "assistant", "content": "4"}]},
                      message_field_training_detail="detail", roles_to_train=[])  # fmt: skip
    assert pieces(tok, ids, labels)[0].strip() == "2+2<|im_end|>"
    # the boundary inside a word: the token holding both sides trains on neither
    text = "The capital"
    split = [{"begin_offset": 0, "end_offset": 5, "train": True}, {"begin_offset": 6, "end_offset": 10,
             "train": False}]  # fmt: skip
    assert tok.tokenize(" capital") == ["Ġcapital"]  # one token across the boundary (after " c")
    ids, labels = run(tok, {"messages": [QUESTION, {"role": "assistant", "content": text, "d": split}]},
                      message_field_training_detail="d", train_on_eos="none")  # fmt: skip
    assert pieces(tok, ids, labels) == ["The"]
    with pytest.raises(RowError, match=r"messages\[1\]\.detail\[0\] must have begin_offset, end_offset and train"):
        run(tok, {"messages": [QUESTION, {"role": "assistant", "content": "4", "detail": [{"begin_offset": 0}]}]},
            message_field_training_detail="detail")  # fmt: skip


def test_split_thinking_moves_the_block_to_reasoning_which_qwen3_renders_and_trains(tok):
    """split_thinking takes <think>...</think> out of the content; chat_template qwen3 writes it back as Qwen3 does
    (after the last question only) and it trains with the answer. Before, qwen3 was ChatML and the reasoning of a
    reasoning_content field was dropped without a word."""
    qwen3 = ALL_TEMPLATES["qwen3"]
    row = {"messages": [QUESTION, {"role": "assistant", "content": "<think>two and two</think>\n\n4"}]}
    ids, labels = run(tok, row, template=qwen3, split_thinking=True)
    assert pieces(tok, ids, labels) == ["<think>\ntwo and two\n</think>\n\n4<|im_end|>"]
    earlier = {"role": "assistant", "content": "3", "reasoning_content": "one and two"}
    row = {"messages": [{"role": "user", "content": "1+2?"}, earlier, QUESTION,
                        {"role": "assistant", "content": "4", "reasoning_content": "two and two"}]}  # fmt: skip
    ids, labels = run(tok, row, template=qwen3)
    assert "one and two" not in tok.decode(ids)  # Qwen3 leaves out an earlier answer's reasoning
    assert pieces(tok, ids, labels) == ["3<|im_end|>", "<think>\ntwo and two\n</think>\n\n4<|im_end|>"]
    # reasoning as parts: its masked part stays out, the answer trains whole
    parts = [{"type": "text", "text": "draft", "train": False}, {"type": "text", "text": " two and two"}]
    row = {"messages": [QUESTION, {"role": "assistant", "content": "4", "reasoning_content": parts}]}
    ids, labels = run(tok, row, template=qwen3)
    assert [run.strip() for run in pieces(tok, ids, labels)] == ["two and two", "4<|im_end|>"]


def test_reasoning_a_template_does_not_render_is_said_once(tok, capsys):
    from llmtune.train.data.parts import _WARNED_THINKING

    _WARNED_THINKING.clear()
    row = {"messages": [QUESTION, {"role": "assistant", "content": "4", "reasoning_content": "two and two"}]}
    for _ in range(2):
        ids, labels = run(tok, row, template=ALL_TEMPLATES["chatml"])
        assert pieces(tok, ids, labels) == ["4<|im_end|>"]
    said = [line for line in capsys.readouterr().err.splitlines() if "does not render" in line]
    assert len(said) == 1 and "rows carry reasoning ('reasoning_content')" in said[0], said
    run(tok, row, template=ALL_TEMPLATES["qwen3"])
    assert "does not render" not in capsys.readouterr().err


def test_alpaca_takes_the_input_prompt_for_any_input_text_as_axolotl(tok):
    spec = DatasetSpec(path="x", type="alpaca")
    context = FormatContext(tok, spec, False, 512)
    [(ids, _)] = format_for(spec)({"instruction": "Name a colour", "input": " ", "output": "Red"}, context)
    assert "### Input:" in tok.decode(ids)
    [(ids, _)] = format_for(spec)({"instruction": "Name a colour", "input": "", "output": "Red"}, context)
    assert "### Input:" not in tok.decode(ids)
