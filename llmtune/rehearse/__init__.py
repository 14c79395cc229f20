"""`llmtune rehearse RECIPE`: the recipe's real plan, world size, tokenizer and data on a shrunken model of the
same architecture, on CPU processes over gloo, in minutes; then a report of what the GPUs will see.

- model.py: the real config (never the weights), shrunk (plan/shrink.py), with random weights, cached;
  the real tokenizer, or a stand-in only when asked for.
- data.py: the recipe's datasets read, tokenized and packed at the real sequence length (a sample of rows),
  and the sample the rehearsal trains on.
- flow.py: a copy of the recipe pointing at both, planned and launched as `llmtune train` does: stopped after
  its first step (a checkpoint), resumed, saved, merged.
- report.py: the arithmetic at full scale and the measured memory beside the estimate.
"""

from llmtune.rehearse.flow import RehearsalOptions, rehearse_recipe

__all__ = ["RehearsalOptions", "rehearse_recipe"]
