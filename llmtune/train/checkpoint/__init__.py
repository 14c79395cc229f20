"""Checkpoints: one manager (manager.py) that every strategy saves, publishes, loads and resumes through, and the
formats behind it: the Trainer's own files (DDP, FSDP, ZeRO), torch's distributed checkpoint for tensor parallel and
async checkpoints (dcp.py, asynchronous.py), the pipeline's per-stage files (stages.py); the folders and their
marker (folders.py), the per-machine manifest, resharding (universal.py for ZeRO, fsdp1.py), and the run's final
files (final.py). May import runtime/."""
