"""The scripts that write results/ (each `python -m brigade.results.NAME`; all of them at once:
`python -m brigade.results`, which is scripts/results.sh), each findable from its name. They sit
on top of the house: they may import the commands, the planner and the measuring primitives,
and nothing imports them but each other and their tests.

    regenerate       every job of results/, run and written, then the table (`__main__`)
    table            docs/results.md's table, from the JSON files alone (rows: one row's shape;
                     memory_rows: the memory and planner-accuracy rows)
    script           what every script shares: its JSON and plot side by side, errors in one line
    overhead         brigade train's whole loop against a raw torch DDP loop
    speed            one schedule against torch.distributed.pipelining's on the same stages
    cut_bound        the least lower bound over every cut of the blocks, against the balanced one
    footprint        memory per rank under every data-parallel layout and recompute mode
    plan_accuracy    brigade plan's predictions against brigade train's measured runs
    tune_robustness  how far brigade tune's choice lands from the sweep's best, over several runs
    gpu              step time and MFU on a GPU (scripts/gpu-check.sh)
    gpu_compare      brigade against torchtitan on one GPU (scripts/gpu-compare.sh; its model in
                     gpu_compare_model, torchtitan's side in titan)
    levers           compile, float8 and fused AdamW off and on, and what each learns
    data_scale       brigade tokenize's rate and training's start and memory on corpora up to
                     1 GB (its row: data_rows)
"""
