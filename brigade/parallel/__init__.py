"""What wraps a stage's blocks from outside, and the one assembler that applies it.

    assemble.py   blocks, cut and world → this process's wrapped stages, in one order (`ORDER`)
    float8.py     float8 matmuls in the body's linear layers, through torchao
    tensor.py     tensor parallel: each block's tp_plan over the world's "tp" mesh
    recompute.py  activation recompute, full or selective, per block
    experts.py    expert parallel: a mixture's experts split over an expert group, tokens by all-to-all
    compiled.py   each block's forward compiled on its own (torch.compile)
    shard.py      FSDP2 (and HSDP) over the world's shard mesh
    replicate.py  DDP over the data-parallel group, its buckets told to the hang watchdog
    held.py       the bytes a step holds for backward (what recompute saves is counted there)

Models know nothing of parallelism; the pipeline runtime only interprets plans. A stage's module
is wrapped where it is built, by `assemble`, for training, the check, the bench and the tuner alike.
"""
