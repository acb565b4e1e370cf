"""Point-to-point transport between gloo processes: shapes and values delivered under both posting
policies (shapes discovered, then predicted; structures that grow), and a shape that changes
without its inputs refused."""


import pytest
import torch

from brigade.pipeline.plans.action import RECV_F, Action

SHAPES = [(4, 3), (4, 3), (5, 2), (5, 2)]  # per step: discover, predict, discover, predict


def _message(step: int, a, m: int):
    """What `a` (a send) carries in `step`: uneven last micro-batch, F fp32, B fp64; micro-batch 0
    a plain tensor, the others structures (int64 ids, values, None) that grow in steps 2 and 3."""
    rows, cols = SHAPES[step]
    shape = (rows - (a.microbatch == m - 1), cols)
    value = 100 * step + 10 * a.stage + a.microbatch
    t = torch.full(shape, float(value), dtype=torch.float32 if a.op == "SEND_F" else torch.float64)
    if a.microbatch == 0:
        return t
    if a.op == "SEND_B":
        return (t, None)
    msg = {"h": t, "ids": torch.arange(shape[0]) + value, "rows": rows}
    if step >= 2:
        msg["extra"] = [t * 2, True]
    return msg


def _same(got, want) -> bool:
    from brigade.pipeline.stages.structure import flatten

    (gt, gs), (wt, ws) = flatten(got), flatten(want)
    return gs == ws and len(gt) == len(wt) and all(
        g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(gt, wt))


def _exchange(rank: int, world: int, port: int, policy: str, out) -> None:
    """`world` gloo processes run each schedule's comms for 4 steps through P2PTransport."""
    import torch.distributed as dist

    from brigade.pipeline.plans.schedule import build
    from brigade.pipeline.plans.validate import validate
    from brigade.pipeline.transport.p2p import P2PTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    wrong, modes, m = [], [], 3
    for name in ("gpipe", "1f1b", "zb"):
        plan = validate(build(name, world, m))
        t = P2PTransport(list(range(world)), torch.device("cpu"), policy=policy, plans=[plan])
        for step in range(len(SHAPES)):
            inputs = [torch.zeros(SHAPES[step][0] - (i == m - 1), SHAPES[step][1]) for i in range(m)]
            t.begin_step(plan[rank], inputs if rank == 0 else None)
            modes.append(t.mode)
            for a in plan[rank]:
                if a.op.startswith("SEND"):
                    t.send(a, _message(step, a, m))
                elif a.op.startswith("RECV"):
                    peer = a.stage + (-1 if a.op == RECV_F else 1)
                    want = _message(step, Action(peer, "SEND_" + a.op[-1], a.microbatch), m)
                    got = t.recv(a)
                    if not _same(got, want):
                        wrong.append(f"{name} step {step} {a}: {got}")
            t.flush()
    out.put((rank, wrong, modes))
    dist.destroy_process_group()


def _spawn(target, world: int, *args, clean_exit: bool = True) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {r: rest for r, *rest in (out.get(timeout=150) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0 or not clean_exit
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["grouped", "eager"])
def test_p2p_policies_deliver_shapes_and_values_on_gloo(policy):
    """Shapes change between steps and micro-batches; grouped runs both of its modes."""
    results = _spawn(_exchange, 3, policy)
    for rank, (wrong, modes) in results.items():
        assert wrong == [], f"rank {rank}: {wrong}"
        if policy == "grouped":
            assert modes == ["discovery", "predicted"] * 6, f"rank {rank}: {modes}"


def _changes_shape_alone(rank: int, world: int, port: int, out) -> None:
    """Rank 0 sends a new shape although its inputs did not change (predicted step)."""
    from datetime import timedelta

    import torch.distributed as dist

    from brigade.pipeline.plans.schedule import forward_only
    from brigade.pipeline.plans.validate import validate
    from brigade.pipeline.transport.p2p import P2PTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=10))
    plan = validate(forward_only(2, 1))
    t = P2PTransport([0, 1], torch.device("cpu"), policy="grouped", plans=[plan])
    error = ""
    try:
        for rows in (2, 3):
            t.begin_step(plan[rank], [torch.zeros(2)] if rank == 0 else None)
            if rank == 0:
                t.send(Action(0, "SEND_F", 0), torch.zeros(rows))
            else:
                t.recv(Action(1, "RECV_F", 0))
            t.flush()
    except Exception as exc:  # rank 1 times out waiting; rank 0's message is the one checked
        error = str(exc)
    out.put((rank, error))


@pytest.mark.timeout(120)
def test_a_shape_that_changes_without_its_inputs_is_refused():
    results = _spawn(_changes_shape_alone, 2, clean_exit=False)  # gloo aborts a timed-out group
    assert "shapes depend on values here; use shapes='dynamic'" in results[0][0]
