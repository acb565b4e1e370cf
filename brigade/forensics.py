"""Hang forensics: every rank says what it is doing; a watchdog reports when a run stops moving.

The runtime calls `doing("RECV_B mb3 from stage 2 (rank 5)", waiting=True, on=5)` before each
action; that costs a dict assignment. A `Watchdog` thread per rank notices when nothing changed
for `--hang-timeout` seconds, raises a flag in the job's c10d store, and then every rank posts its
last action and its Python stacks (faulthandler) there. The lowest rank that answered prints

    brigade: hang — no progress for 31 s (--hang-timeout 30)
      rank  node  place    last action                          for
         0  vm    dp0 pp0  RECV_B mb1 from stage 1 (rank 1)   31.0 s  waiting
         1  vm    dp0 pp1  step 5 begins                        31.2 s  <- stuck
    verdict: rank 1 made no progress outside any transfer or collective; rank 0 waits for it

writes the table and every stack to OUT/logs/hang-report.txt, and every rank exits with
EXIT_CODE, so the elastic agent restarts the run (or ends it when no restarts are left).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from brigade.errors import BrigadeError
from brigade.host.net import parse_endpoint

EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: the attempt hung; a restart may well succeed
WARMUP_EXTRA_S = 180  # added to --hang-timeout until the first step is done (connections, resume)

_actions: dict[str, tuple[str, float, bool, int | None]] = {}  # thread → (what, since, waiting, on)


def doing(what: str, waiting: bool = False, on: int | None = None) -> None:
    """Record this thread's current action; `waiting` for transfers and collectives, `on` a peer."""
    _actions[threading.current_thread().name] = (what, time.monotonic(), waiting, on)


def current() -> dict[str, tuple[str, float, bool, int | None]]:
    while True:
        try:
            return dict(_actions)
        except RuntimeError:  # a thread recorded its first action during the copy
            continue


class HangError(RuntimeError):
    """Raised (as a record for the elastic agent) when the watchdog ends a hung attempt."""


def _row(rank: int, node: str, place: str, now: float) -> dict:
    actions = current()
    if not actions:
        return {"rank": rank, "node": node, "place": place, "action": "starting", "age": 0.0,
                "waiting": False, "on": None}
    if len(actions) == 1:
        (what, since, waiting, on), = actions.values()
        return {"rank": rank, "node": node, "place": place, "action": what, "age": now - since,
                "waiting": waiting, "on": on}
    # Stage threads of a local pipeline: show each; the rank waits only if all of them do.
    label = "; ".join(f"{thread}: {a[0]}" for thread, a in sorted(actions.items()))
    return {"rank": rank, "node": node, "place": place, "action": label,
            "age": now - max(a[1] for a in actions.values()),
            "waiting": all(a[2] for a in actions.values()), "on": None}


def stacks() -> str:
    """Every thread's Python stack, as faulthandler prints them, minus the watchdog's own."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        blocks = f.read().split("\n\n")
    return "\n\n".join(b for b in blocks if not b.startswith("Current thread")).strip()


def verdict(rows: list[dict], world: int) -> tuple[list[int], str]:
    """(the ranks holding up the run, one sentence saying why) from every rank's last action."""
    seen = {r["rank"] for r in rows}
    silent = [r for r in range(world) if r not in seen]
    working = [r["rank"] for r in rows if not r["waiting"]]
    if silent:
        return silent, (f"rank{'s' if len(silent) > 1 else ''} {_ranks(silent)} did not answer: the "
                        "process is gone or stuck in native code holding Python's lock; its log is "
                        "in OUT/logs")
    if working:
        others = [r["rank"] for r in rows if r["waiting"]]
        tail = (f"; ranks {_ranks(others)} wait for it" if len(others) > 1
                else f"; rank {others[0]} waits for it" if others else "")
        return working, (f"rank{'s' if len(working) > 1 else ''} {_ranks(working)} made no progress "
                         f"outside any transfer or collective{tail}")
    waits = {r["rank"]: r["on"] for r in rows if r["on"] is not None}
    for start in waits:
        seen_chain, rank = [start], waits[start]
        while rank in waits and rank not in seen_chain:
            seen_chain.append(rank)
            rank = waits[rank]
        if rank == start and len(seen_chain) > 1:
            chain = " → ".join(str(r) for r in [*seen_chain, start])
            return seen_chain, (f"deadlock: ranks {chain} each wait for the next; the schedule "
                                "does not pair their sends and receives")
    return [], ("every rank waits on communication: a peer lost its connection, or ranks called "
                "different collectives; compare their last actions")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def render(rows: list[dict], world: int, timeout_s: float) -> tuple[str, list[int]]:
    """The table and the verdict, as printed when a hang is reported."""
    culprits, why = verdict(rows, world)
    width = max([len(r["action"]) for r in rows] + [11])
    lines = [f"brigade: hang — no progress for {max(r['age'] for r in rows):.0f} s "
             f"(--hang-timeout {timeout_s:g})",
             f"  rank  {'node':<12} {'place':<10} {'last action':<{width}}  {'for':>7}"]
    by_rank = {r["rank"]: r for r in rows}
    for rank in range(world):
        r = by_rank.get(rank)
        if r is None:
            lines.append(f"  {rank:>4}  {'?':<12} {'?':<10} {'(no answer)':<{width}}  {'':>7}  <- stuck")
            continue
        mark = "<- stuck" if rank in culprits else ("waiting" if r["waiting"] else "")
        lines.append(f"  {rank:>4}  {r['node'][:12]:<12} {r['place']:<10} {r['action']:<{width}}  "
                     f"{r['age']:>5.1f} s  {mark}".rstrip())
    lines.append(f"verdict: {why}")
    return "\n".join(lines), culprits


class Watchdog:
    """One per rank: reports a hang through the job's store, then ends this process.

    Args:
        store: a c10d Store every rank of this attempt shares (keys are prefixed per attempt).
        timeout_s: seconds without a new action, once `arm()` was called (after warm-up).
        warmup_s: the same limit before that (first connections, first step, resuming).
        out: the run folder; the report goes to OUT/logs/hang-report.txt.
        place: where this rank sits, e.g. "dp1 pp0", for the table.
    """

    def __init__(self, store, rank: int, world: int, timeout_s: float, warmup_s: float,
                 out: str | Path | None = None, place: str = "", poll_s: float = 0.5,
                 exit: Callable[[int], None] = os._exit):
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s, self.warmup_s, self.poll_s = timeout_s, warmup_s, poll_s
        self.out = Path(out) if out else None
        self.place = place
        self.node = socket.gethostname()
        self.armed = False
        self.paused = False
        self.report_wait_s = 10.0  # how long to wait for every rank's report before printing
        self._exit = exit
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="brigade-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        _running.add(self)
        return self

    def arm(self) -> None:
        self.armed = True

    def pause(self) -> None:
        """Stop judging (outside training, a rank may legitimately wait long for another)."""
        self.paused = True

    def resume(self) -> None:
        self._started = time.monotonic()  # time spent paused does not count
        self.paused = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=20)
        _running.discard(self)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                latest = max([t for _, t, _, _ in current().values()] + [self._started])
                limit = self.timeout_s if self.armed else self.warmup_s
                hung = int(self.store.add("hang", 0)) > 0
                if not hung and not self.paused and time.monotonic() - latest > limit:
                    self.store.add("hang", 1)
                    hung = True
            except (RuntimeError, OSError):  # the store is gone: the run is ending anyway
                return
            if hung and not self._stop.is_set():
                try:
                    self._report()
                except (RuntimeError, OSError):
                    pass  # the store went away mid-report: this rank still must not hang on
                self._exit(EXIT_CODE)
                return

    def _report(self) -> None:
        row = _row(self.rank, self.node, self.place, time.monotonic())
        self.store.set(f"report/{self.rank}", json.dumps({**row, "stack": stacks()}))
        keys = [f"report/{r}" for r in range(self.world)]
        deadline = time.monotonic() + self.report_wait_s
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.1)
        answered = [r for r in range(self.world) if self.store.check([keys[r]])]
        reports = [json.loads(self.store.get(keys[r])) for r in answered]
        table, culprits = render(reports, self.world, self.timeout_s)
        if self.rank == min(answered):
            print(table + "\n" + _main_stacks(reports, culprits), flush=True)
            self._write(table, reports)
            self.store.set("printed", "1")
        else:
            end = time.monotonic() + 5
            while time.monotonic() < end and not self.store.check(["printed"]):
                time.sleep(0.1)
        why = table.splitlines()[-1].removeprefix("verdict: ")
        _record_for_agent(HangError(f"the run hung: {why} (report: OUT/logs/hang-report.txt)"))

    def _write(self, table: str, reports: list[dict]) -> None:
        if self.out is None:
            return
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        text = [f"{stamp}\n{table}\n"]
        for r in reports:
            text.append(f"\n=== rank {r['rank']} ({r['node']}, {r['place']}): {r['action']}\n{r['stack']}\n")
        try:
            logs = self.out / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            (logs / "hang-report.txt").write_text("".join(text), encoding="utf-8")
        except OSError:
            pass  # the table is on the terminal already


def _main_stacks(reports: list[dict], culprits: list[int], frames: int = 8) -> str:
    """Each rank's main-thread stack, innermost frames first (all threads: hang-report.txt)."""
    parts = ["Python stacks, innermost call first:"]
    for r in reports:
        block = r["stack"].split("\n\n")[-1].splitlines()  # faulthandler lists the main thread last
        mark = " <- stuck" if r["rank"] in culprits else ""
        parts.append(f"--- rank {r['rank']} stack{mark}\n" + "\n".join(block[1:frames + 1]))
    return "\n".join(parts) + "\n(every thread of every rank: OUT/logs/hang-report.txt)"


def _record_for_agent(exc: BaseException) -> None:
    """Leave `exc` in torchelastic's error file, so the launcher's one-line error names the hang."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            raise exc
        except HangError as raised:
            ErrorHandler().record_exception(raised)
    except Exception:
        pass


_running: set[Watchdog] = set()


@atexit.register
def stop_all() -> None:
    """Stop every watchdog of this process; brigade calls it before leaving the process group.

    Also at exit: a daemon thread caught inside the store's C++ code while the interpreter shuts
    down is ended by pthread_exit, which aborts the process (SIGABRT).
    """
    for dog in list(_running):
        dog.stop()


def group_timeout(hang_timeout_s: float) -> float:
    """The process group's own timeout: a last resort, after the watchdog had its chance."""
    return hang_timeout_s + WARMUP_EXTRA_S + 60


def start(timeout_s: float, out: str | Path | None, place: str) -> Watchdog | None:
    """This rank's watchdog, on a store connection of its own; None alone or when disabled."""
    import torch.distributed as dist

    if not timeout_s or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    nonce = [os.urandom(6).hex() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(nonce, src=0)  # keys of an earlier attempt stay in a shared store
    # The agent's rendezvous store outlives the workers (brigade's launcher names it); under a
    # plain torchrun or srun, the group's own store.
    where = os.environ.get("BRIGADE_AGENT_STORE") or \
        f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    try:
        host, port = parse_endpoint(where)
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10),
                              wait_for_workers=False)
    except (BrigadeError, RuntimeError):
        return None  # initialised some other way (init_method=...): no forensics, the group timeout holds
    return Watchdog(dist.PrefixStore(f"brigade-watchdog/{nonce[0]}", store), dist.get_rank(),
                    dist.get_world_size(), timeout_s, timeout_s + WARMUP_EXTRA_S, out, place).start()
