"""The reward functions and the dataset transform recipes/grpo.yaml names (grpo_rewards.<function>), as Axolotl's
GRPO recipes name theirs: a Python file beside the recipe."""


def _text(completion) -> str:
    """A completion's text: TRL passes chat completions as [{"role": "assistant", "content": ...}]."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def says_the_word(completions, answer, **kwargs) -> list[float]:
    """1 when the reply contains the word it was asked to say, else 0."""
    return [1.0 if word.lower() in _text(c).lower() else 0.0 for c, word in zip(completions, answer, strict=True)]


def brief(completions, **kwargs) -> list[float]:
    """Up to 0.5 for a short reply: 0.5 at one word, 0 from 20 words on."""
    return [max(0.0, 0.5 * (1 - (len(_text(c).split()) - 1) / 19)) for c in completions]


def say_the_word(cfg, *args, **kwargs):
    """Each row {"word": ...} as a chat prompt asking for it, with the word kept for says_the_word."""

    def transform_fn(example, tokenizer=None):
        return {
            "prompt": [{"role": "user", "content": f"Say the word {example['word']}, and nothing else."}],
            "answer": example["word"],
        }

    return transform_fn, {"remove_columns": ["word"]}
