"""Pipeline parallelism's own training loop (the HF Trainer has none): the model cut into stages (stages.py),
the loop over torch.distributed.pipelining's schedules (loop.py), and a rank's run around it (run.py). May import
every sub-room below engine/ (checkpoint/, objectives/, model/, runtime/, data/)."""
