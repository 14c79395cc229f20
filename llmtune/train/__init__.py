"""The train room: the worker every rank runs (model, adapters, data, Trainer, saving)."""
