"""What a training run tells its user, whichever launcher started its processes.

Under brigade's own launcher the parent process (in the user's shell) writes `config.toml`,
prints the start line, and after the workers end writes `loss.png` and `sample.txt` and prints
the done line; the agent keeps every worker's stderr under `OUT/logs/`. Under torchrun, srun, or
a `brigade.launch` of your own there is no such parent: global rank 0 does the parent's part and
every rank keeps its own stderr (`keep_stderr`), so the run folder and the console are the same:

    OUT/config.toml  metrics.jsonl  snapshots/  loss.png  sample.txt
    OUT/logs/<run id>/attempt_<restart>/<rank>/stderr.log
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from brigade.config import RunConfig, to_toml
from brigade.fsutil import write_atomic


def start(cfg: RunConfig, processes: int | str) -> None:
    """Write `OUT/config.toml` (which `brigade train --config` reads back) and print the start line."""
    p, out = cfg.parallel, Path(cfg.train.out)
    write_atomic(out / "config.toml", to_toml(cfg))
    print(f"brigade: training {cfg.model.model} on {processes} processes (dp={p.dp} × pp={p.pp}"
          + (f" × cp={p.cp} ({p.cp_method})" if p.cp > 1 else "")
          + (f" × tp={p.tp}" if p.tp > 1 else "")
          + (f", experts over ep={p.ep} of dp" if p.ep > 1 else "")
          + (f" × {p.local_stages} local stages" if p.local_stages > 1 else "")
          + f", {p.schedule}, AdamW {cfg.optim.adamw}), results in {out}/", flush=True)


def finish(cfg: RunConfig, summary: dict) -> None:
    """After the workers: `loss.png`, `sample.txt` (GPT runs) and the done line, from one rank's
    `summary` (every rank ends at the same step and loss). A run stopped by a signal says so and
    how to resume instead; its plot is written all the same."""
    from brigade.train.plot import plot_run
    from brigade.train.sample import sample_from_run

    out = Path(cfg.train.out)
    plot_run(out)
    if summary.get("preempted"):
        print(f"brigade: stopped at step {summary['step']}; newest snapshot: "
              f"{summary['snapshot'] or 'none, it starts from the beginning'}. "
              "Run the same command to resume.", flush=True)
        return
    if (cfg.model.model == "gpt" or cfg.model.model.startswith("hf:")) and cfg.train.sample_tokens:
        text = sample_from_run(out, prompt="\n", tokens=cfg.train.sample_tokens, seed=cfg.train.seed)
        write_atomic(out / "sample.txt", text)
        print("\n--- sample ---\n" + text + "\n--------------", flush=True)
    val = summary.get("val_loss")
    names = ("metrics.jsonl", "loss.png", "experts.png", "config.toml", "snapshots/", "sample.txt", "logs/")
    print(f"brigade: done at step {summary['step']}"
          + (f", validation loss {val:.4f}" if val is not None else "")
          + f". In {out}/: " + ", ".join(n for n in names if (out / n).exists()), flush=True)


def stderr_log(out: str | Path, rank: int, env=os.environ) -> Path:
    """Where rank `rank` keeps its stderr, in the layout torch's agent uses under brigade's own
    launcher: the launcher's run id (torchrun's, or the Slurm job), then the restart count."""
    run_id = env.get("TORCHELASTIC_RUN_ID") or (f"slurm-{env['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in env
                                                else "launcher")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or "0"
    return Path(out) / "logs" / run_id / f"attempt_{attempt}" / str(rank) / "stderr.log"


def keep_stderr(path: Path) -> subprocess.Popen | None:
    """From now until this process ends, everything written to its stderr (file descriptor 2:
    Python's tracebacks and warnings, and torch's, gloo's and faulthandler's C-level messages)
    also goes to `path`.

    A `tee` process does the copying, not a thread of ours: a thread would need the GIL, and a
    process that hangs in C with the GIL held must still get its stack dump out. `tee` runs in
    a session of its own, so a Ctrl-C or a scheduler's signal to the job's process group does
    not end it while this process still writes its last lines. Where `tee` cannot be started,
    stderr is left as it is (None).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    read, write = os.pipe()
    try:
        tee = subprocess.Popen(["tee", "-a", str(path)], stdin=read, stdout=sys.__stderr__.fileno(),
                               stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        os.close(read)
        os.close(write)
        return None
    os.close(read)
    os.dup2(write, 2)  # our stderr is now the pipe's writing end; tee ends at its EOF, when we exit
    os.close(write)
    return tee
