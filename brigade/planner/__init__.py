"""The planner: the one predictor of a layout's step time and memory, for `brigade plan` (every
layout of a model on a target cluster, ranked) and for the tuner (`brigade tune`'s sweep and its
memory limit). It measures through `brigade.measure` and imports nothing of bench/ or results/.

    devices   DeviceSpec: the built-in table (H100, H200, A100) and "cpu", this machine, probed
    cluster   nodes × devices per node, from flags or a TOML file
    comm      ring collectives and point-to-point from the links
    costs     per-block costs measured here (`measure.stages.block_costs`), interpolated between
              micro-batch sizes; scaling: as the target runs them
    optimizer what AdamW's step costs here: seconds per byte, the bytes it allocates
    sample    a batch's first rows whatever its shape, each block bound to its side inputs
    formula   the same costs from the model's shapes, for a model too large to run here
    tensor    what tensor parallel does to each block: the share a split divides, its all-reduces, degrees
    mixture   a mixture of experts: its experts' weights, parameters in all and active, the grouped
              matmuls' FLOPs; expert_parallel: what --ep adds (all-to-alls, the experts' reduction)
    attention what context parallel needs of a model's attention (its SDPA calls, observed on the
              meta device) and the cp degrees it takes; context: what --cp adds (all-to-alls or
              the ring's unhidden transfers, the method, --cp's refusals)
    space     the layouts: dp = replicate × shard, pp, cp, tp, V per registered schedule, m,
              recompute, ep; and the tuner's sweep
    memory    each rank's memory by kind
    predict   one layout's step: simulate() over the real plan, the reduction, the optimizer
    reduction after the pipeline: the gradient reduction (over dp × cp, or shard × cp), FSDP2's own
              work, the optimizer step, the trainer's small collectives
    sweep     the tuner's predictions: each configuration of its sweep on this host's costs
    budget    the tuner's memory limit: each configuration's predicted peak, which fit
    report    the table; run: the command's body; command: its flags; config: PlanConfig
"""
