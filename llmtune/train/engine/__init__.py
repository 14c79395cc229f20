"""The HF Trainer as llmtune runs it: TrainingArguments from the recipe and plan, llmtune's Trainer subclass (real
tokens, first-batch checks, the checkpoint manager's hooks, non-finite stops) and its callbacks. May import every
sub-room below it: checkpoint/, objectives/, model/, runtime/, data/."""
