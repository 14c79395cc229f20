"""The baseline: the most straightforward HF Trainer script a user would write for the same job.

Alpaca rows -> "prompt + response" text, tokenized with truncation, padded per batch by
DataCollatorForLanguageModeling, plain Trainer with its default optimizer (fused AdamW), same batch, learning
rate and steps. (The benchmark gives llmtune the same optimizer: its default is Axolotl's adamw_torch.)
Writes {"step_seconds": [...], "real_tokens": [...]} so the benchmark can compare step by step.

    python benchmarks/plain_trainer.py MODEL DATA.jsonl OUT.json --steps 12 --batch 4 --seq 256 [--lora]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,  # fmt: skip
    TrainingArguments,
)


class Timer(TrainerCallback):
    """Each step from the end of the one before (fetching and collating its batch included), as llmtune times it."""

    def __init__(self):
        self.seconds, self.last_end = [], 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = time.perf_counter()

    first_step_end = None

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last_end)
        self.last_end = now
        self.first_step_end = self.first_step_end or time.time()


class CountingCollator(DataCollatorForLanguageModeling):
    real: list[int] = []
    padded: list[int] = []
    hashes: list[str] = []  # of each batch's rows (their real tokens), compared with llmtune's step by step

    def __call__(self, features, return_tensors=None):
        batch = super().__call__(features, return_tensors)
        self.real.append(int(batch["attention_mask"].sum()))
        self.padded.append(int(batch["input_ids"].numel()))
        digest = hashlib.sha256()  # row by row, as llmtune hashes them: the same rows in any layout hash alike
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            digest.update(ids[mask.bool()].numpy().tobytes() + b"|")
        self.hashes.append(digest.hexdigest()[:16])
        return batch


# the Stanford Alpaca prompt, as everyone writes it
PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
          "\n\n### Instruction:\n{instruction}\n\n### Response:\n")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in open(args.data)]
    texts = [PROMPT.format(instruction=r["instruction"]) + r["output"] + tokenizer.eos_token for r in rows]
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=args.seq), batched=True, remove_columns=["text"]
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    timer = Timer()
    collator = CountingCollator(tokenizer, mlm=False)
    training = TrainingArguments(
        output_dir=args.out + ".run", per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, save_strategy="no", report_to=[], logging_steps=1, use_cpu=True, seed=42,
        dataloader_num_workers=0,
    )  # fmt: skip
    Trainer(model=model, args=training, train_dataset=dataset, data_collator=collator, callbacks=[timer]).train()
    with open(args.out, "w") as handle:
        json.dump({"step_seconds": timer.seconds, "real_tokens": collator.real[: len(timer.seconds)],
                   "padded_tokens": collator.padded[: len(timer.seconds)],
                   "batch_hashes": collator.hashes[: len(timer.seconds)],
                   "first_step_end_unix": timer.first_step_end}, handle)  # fmt: skip


if __name__ == "__main__":
    main()
