"""`llmtune doctor`: the real cluster checked before it costs a GPU-hour.

The launcher starts a short job exactly as `llmtune train` would (same plan, same launcher, same rendezvous), but
every rank runs `python -m llmtune.doctor` instead of training: it reports what it sees (stack, devices, storage,
network, clock) and measures the collectives (correctness, bus bandwidth at three sizes, each rank's ring link).
Rank 0 writes the reports to <output_dir>/llmtune/doctor/doctor.json; the launcher judges them (checks.py, pure)
and prints a table per machine and a verdict.

- rank.py: what runs in each rank (imports torch)
- checks.py: reports -> problems, each naming the machine or rank and what to do (torch-free)
- report.py: the table, the verdict, --json
"""
