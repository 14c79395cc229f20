"""What llmtune adds to the Trainer's loss and optimization: losses (EAFT, layer sampling), Muon, schedules,
ReLoRA's restarts. Imports nothing else in train/."""
