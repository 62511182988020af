"""The instrumented trainer: a small transformer LM with activation checkpointing, deliberate
leaks, and the watchdog attached, to show the whole loop end to end on any machine.

    model.py     the transformer (activation checkpointing per block)
    data.py      batches as a pure function of position (exact resume)
    leaks.py     --inject-leak: tensors, graph, global, recompile
    probe.py     saved-activation bytes with and without checkpointing
    loop.py      the training loop: steps, checkpoints, reinit, restart, SIGTERM
    progress.py  tqdm on a terminal, structured log lines otherwise
    multi.py     several devices through torch_xla.launch
    speed.py     steps/s with and without the watchdog (a benchmark)
    cli.py       `hbm-watchdog train`

Nothing here imports torch at package import: the CLI stays fast to start.
"""
