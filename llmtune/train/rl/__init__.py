"""Preference training and online RL (`rl:`) on TRL's trainers, with llmtune's Trainer in front of them, and GRPO's
reward functions from the recipe's files, checked at every call. Imports engine/ and what is below it."""
