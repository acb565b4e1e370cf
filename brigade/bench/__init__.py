"""The bench and tune commands (`brigade bench`, `brigade tune`). They time through
`brigade.measure` and predict through `brigade.planner`; the scripts that write results/ sit
above them, in `brigade.results`, and nothing here imports those (tests/test_imports.py).

    command      the two commands' flags; run: their bodies (a config, the workers, what is printed)
    cases        brigade bench's configurations (its rows) and the cut each runs on
    experiments  the worker that builds those rows and times them together in interleaved rounds
    peers        torch.distributed.pipelining's schedules on the same stages
    copies       every row's copy of the blocks, compiled under --compile (copied, then compiled)
    figures      the per-round figures and their intervals; plot: bench.json's plots and table
    tune         brigade tune: predict the sweep, time the best, keep the fastest
    choose       how the tuner ranks configurations within rounds
"""
