"""Starting a run's processes and joining them into one process group.

    agent.py       workers under torch's elastic agent: restarts, signals, results back (`launch`)
    rendezvous.py  where the processes meet: c10d rendezvous, the loopback store, `LaunchSpec`
    env.py         what torchrun or Slurm told a process (no torch import)
    groups.py      a worker joins the process group on its device (`init`, `info`, `destroy`)

This package's `__init__` imports nothing, so `launcher.env` stays free of torch.
"""
