"""The train room: what every rank runs, from the plan it is given to the files it saves.

Its sub-rooms, from the ground up (a sub-room imports only those below it, never one above):

    rehearsal.py  the CPU rehearsal bridge: what the libraries need to run a GPU plan on CPU processes
    data/         raw rows -> tokenized examples (labels masked) -> padded, packed or padding-free batches
    runtime/      the process in its job: distributed state, collectives, ranks' reports, logs, watchdog, probes
    model/        loading (hub, folder, GGUF), quantization, adapters, kernels, linearized experts, weight files
    objectives/   losses, optimizers and schedules llmtune adds to the Trainer's
    checkpoint/   the checkpoint manager and its formats (Trainer, DCP sync and async, pipeline stages), resume
    engine/       the HF Trainer as llmtune runs it: its arguments, its subclass, its callbacks
    rl/           preference and online RL on TRL's trainers, with the recipe's reward functions
    pipeline.py   pipeline parallelism's own training loop (the HF Trainer has none)
    worker.py     one rank's run, top to bottom: it calls the rooms above in order (python -m llmtune.train)
"""
