"""`brigade plan`: predict every layout of a model on a target cluster, ranked.

    devices   DeviceSpec: the built-in table (H100, H200, A100) and "cpu", this machine, probed
    cluster   nodes × devices per node, from flags or a TOML file
    comm      ring collectives and point-to-point from the links
    costs     per-block costs measured here (bench.predict's), scaled to the target
    space     the layouts: dp = replicate × shard, pp, V per registered schedule, m, recompute
    memory    each rank's memory by kind
    predict   one layout's step: simulate() over the real plan, the reduction, the optimizer
    report    the table; run: the command's body; command: its flags; config: PlanConfig
"""
