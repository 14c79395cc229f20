"""Write the quickstart demo's dataset (deterministic): data/quickstart/{train,eval}.jsonl.

The task is one SmolLM2-135M-Instruct gets wrong out of the box — reverse a short list of words —
so the effect of a few minutes of LoRA on CPU is visible as exact-match accuracy.
Rows are chat messages, trained with the model's own chat template (type: chat_template).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud tiger lamp garden violin pepper rocket candle mirror forest button pencil ocean "
    "silver window carpet dragon honey planet bridge orange turtle wallet castle banana jacket pillow"
).split()
OUT = Path(__file__).resolve().parent.parent / "data" / "quickstart"


def example(rng: random.Random) -> dict:
    words = rng.sample(WORDS, rng.randint(3, 5))
    return {
        "messages": [
            {"role": "user", "content": f"Reverse the order of these words: {' '.join(words)}"},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    }


def main(train_size: int = 400, eval_size: int = 30) -> None:
    evaluation = [example(random.Random(f"eval-{i}")) for i in range(eval_size)]
    held_out = {row["messages"][0]["content"] for row in evaluation}
    rng = random.Random(42)
    train = []
    while len(train) < train_size:
        row = example(rng)
        if row["messages"][0]["content"] not in held_out:
            train.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evaluation)):
        with (OUT / f"{name}.jsonl").open("w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(train)} train and {len(evaluation)} eval rows to {OUT}")


if __name__ == "__main__":
    main()
