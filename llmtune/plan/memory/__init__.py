"""The memory model: how many bytes a recipe takes per GPU under each strategy, before anything is built.

Its floors, from the ground up (each imports only those below it):

    facts.py        the model's shape, read from its config (hidden size, layers, heads, vocabulary)
    compute.py      how the run computes: activation widths (precision), what trains, kernels that change memory
    states.py       parameters, gradients, optimizer states per parameter; LoRA's share; a k-bit base
    activations.py  what autograd saves per token and layer, the head, the fp32 logits, autocast's weight copies
    buffers.py      communication and optimizer buffers, the caching allocator's reserve, the CUDA context
    parallel.py     what tensor and context parallelism split;  preference.py  a preference run's reference model
    peak.py         every strategy's row: the terms partitioned as it partitions them, the peak, the total
    basis.py        whether a recorded GPU run covers a row (measured) or it is modelled
    fit.py          the estimate of a recipe on a cluster, the recommendation, the pre-launch fit check
    table.py        the table `llmtune estimate` prints, and the sizes people type

The estimate, the GPU calibration (benchmarks/gpu_memory.py) and the rehearsal's comparison read these same
functions. Pure arithmetic: no torch, nothing built.
"""
