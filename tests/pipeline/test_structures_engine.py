"""The engine carries structures and side inputs (#15): every schedule, both runtimes.

Loss, every gradient and the parameters after one SGD step within 1e-5 of one device, for
    dict   blocks pass dicts and tuples, a skip connection crosses stage boundaries, the int64
           token ids pass through every stage (no gradient) and a float value rides along;
    seq    the same model, steps of different sequence length (discovery, then predicted);
    llama  examples/llama.py with its positions side input, head untied from the embedding
           (shared weights are not carried by the engine yet).
The process runtime starts 2 gloo processes once and runs every case inside, under both
posting policies (eager, and grouped as NCCL would run it).
"""

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.pipeline.plans.schedule import SCHEDULES, placement
from brigade.pipeline.stages.side_inputs import StageModule

VOCAB, WIDTH, TOL = 11, 8, 1e-5
COMBOS = [(name, v) for name, s in SCHEDULES.items()
          for v in dict.fromkeys([s.resolve_virtual(0)] + ([1] if s.virtual is None else []))]
M = 3  # micro-batches; batches of 7 rows: uneven micro-batches (3, 2, 2)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)

    def forward(self, x):  # {"ids": (B, T) int64} -> {"h", "skip", "ids", "scale"}
        h = self.tok(x["ids"])
        return {"h": h, "skip": h * 2, "ids": x["ids"], "scale": 0.5}


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):  # dict -> (h, {"skip", "ids"}, scale): the skip passes through
        return torch.tanh(self.lin(x["h"])), {"skip": x["skip"], "ids": x["ids"]}, x["scale"]


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):  # tuple -> {"h", "ids"}: the skip from block 0 joins here
        h, rest, scale = x
        return {"h": self.lin(h) + scale * rest["skip"], "ids": rest["ids"]}


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)
        self.bias = nn.Embedding(VOCAB, VOCAB)  # the ids, four stages on

    def forward(self, x):  # {"h", "ids"} -> (B, T, V)
        return self.out(x["h"]) + self.bias(x["ids"])


def dict_model():
    torch.manual_seed(0)
    return [Embed(), Mix(), Join(), Head()]


def token_loss(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets)


def dict_batch(n, t, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (n, t + 1), generator=g)
    return {"ids": ids[:, :-1]}, ids[:, 1:]


def _llama():
    path = Path(__file__).parents[2] / "examples" / "llama.py"
    spec = importlib.util.spec_from_file_location("brigade_example_llama", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_model():
    torch.manual_seed(0)
    blocks = _llama().model(vocab_size=32, block_size=12, n_layer=2, n_embd=16, n_head=4, n_kv_head=2)
    head = blocks[-1]
    head.out.weight = nn.Parameter(head.out.weight.detach().clone())  # untied (see the docstring)
    return blocks


def llama_batch(n, seed):
    return _llama().batch(n, torch.Generator().manual_seed(seed), vocab_size=32, block_size=12)


def cases():
    """name -> (model factory, loss, batches)."""
    llama = _llama()
    return {
        "dict": (dict_model, token_loss, [dict_batch(7, 5, 1)]),
        "seq": (dict_model, token_loss, [dict_batch(7, 6, 2), dict_batch(7, 3, 3), dict_batch(7, 3, 4)]),
        "llama": (llama_model, llama.loss, [llama_batch(7, 5)]),
    }


def stage_modules(blocks, n_stages):
    per = len(blocks) // n_stages
    return [StageModule(blocks[s * per:(s + 1) * per], range(s * per, (s + 1) * per), stage=s)
            for s in range(n_stages)]


def reference_step(blocks, loss_fn, inputs, targets):
    """One device: the whole model as one StageModule, loss, backward; returns the loss."""
    whole = StageModule(blocks)
    main, side = (inputs["tokens"], {"positions": inputs["positions"]}) \
        if "positions" in inputs else (inputs, {})
    loss = loss_fn(whole(main, side), targets)
    loss.backward()
    return loss.item()


def _diff(a, b):
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def compare(model, loss_fn, batches, pipe_step, held):
    """Steps the pipeline and one device over `batches`, each followed by SGD(0.1).

    held: the block indices whose parameters this process holds (pipeline side).
    Returns (loss diff, grad diff, param diff), the largest over the steps.
    """
    blocks = model()
    ref = copy.deepcopy(blocks)
    mine = [p for i in held for p in blocks[i].parameters()]
    theirs = [p for i in held for p in ref[i].parameters()]
    # The reference updates every block: the other process updates the blocks it holds.
    opt, ref_opt = torch.optim.SGD(mine, lr=0.1), torch.optim.SGD([p for b in ref for p in b.parameters()],
                                                                   lr=0.1)
    worst = [0.0, 0.0, 0.0]
    step = pipe_step(blocks)
    for inputs, targets in batches:
        loss = step(inputs, targets)
        ref_loss = reference_step(ref, loss_fn, inputs, targets)
        assert all(p.grad is not None for p in mine), "every parameter gets a gradient"
        grads = _diff([p.grad for p in mine], [p.grad for p in theirs])
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        new = [abs(loss - ref_loss), grads, _diff(mine, theirs)]
        worst = [max(w, n) for w, n in zip(worst, new)]
    return worst


def local_step(schedule, v, loss_fn):
    def make(blocks):
        v_, ranks = placement(schedule, 2, v)
        pipe = LocalPipeline(stage_modules(blocks, len(ranks)), ["cpu", "cpu"], schedule, M, loss_fn,
                             virtual=v_)
        return lambda x, y: float(pipe.step(x, y))
    return make


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,v", COMBOS)
@pytest.mark.parametrize("case", ["dict", "seq", "llama"])
def test_local_runtime_carries_structures(case, schedule, v):
    model, loss_fn, batches = cases()[case]
    worst = compare(model, loss_fn, batches, local_step(schedule, v, loss_fn), range(4))
    assert max(worst) <= TOL, worst


def process_case(rank, schedule, v, model, loss_fn, batches):
    """One case on this process: (modes of the steps, worst differences)."""
    v_, ranks = placement(schedule, 2, v)
    mine = [s for s, r in enumerate(ranks) if r == rank]
    per = 4 // len(ranks)
    modes: list[str] = []

    def make(blocks):
        stages = stage_modules(blocks, len(ranks))
        pipe = Pipeline({s: stages[s] for s in mine}, schedule, M, loss_fn, virtual=v_)

        def step(x, y):
            loss = float(pipe.step(x, y))
            modes.append(pipe.runner.transport.mode)
            return loss
        return step

    worst = compare(model, loss_fn, batches, make, [s * per + k for s in mine for k in range(per)])
    return modes, worst


def process_worker():
    """Every case, schedule and V under both posting policies, in one start of 2 processes."""
    info = groups.init(threads=1)
    out = []
    for policy in ("eager", "grouped"):
        os.environ["BRIGADE_P2P_POLICY"] = policy  # read when each Pipeline is built
        for case, (model, loss_fn, batches) in cases().items():
            for schedule, v in COMBOS:
                out.append((policy, case, schedule, v,
                            *process_case(info.rank, schedule, v, model, loss_fn, batches)))
    groups.destroy()
    return out


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def process_results():
    return agent.launch(process_worker, 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", ["eager", "grouped"])
@pytest.mark.parametrize("case", ["dict", "seq", "llama"])
def test_process_runtime_carries_structures(process_results, case, policy):
    for rank, rows in process_results.items():
        mine = [r for r in rows if r[:2] == (policy, case)]
        assert [(r[2], r[3]) for r in mine] == COMBOS, rank
        for *what, modes, worst in mine:
            assert max(worst) <= TOL, (rank, what, worst)
            if policy == "grouped" and case == "seq":  # a new length is discovered, a repeat predicted
                assert modes == ["discovery", "discovery", "predicted"], (rank, what, modes)


# --- bad input: one line naming the block and the stage, raised as BrigadeError ---


class Returns(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.lin, self.make = nn.Linear(WIDTH, WIDTH), make

    def forward(self, x):
        return self.make(self.lin(x))


class TakesDict(nn.Module):
    def forward(self, x):
        return x["h"] + x["skip"]


class Masked(nn.Module):
    side_inputs = ("mask",)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, *, mask):
        return self.lin(x) * mask[:, None]


def _local(blocks, n_stages=2):
    return LocalPipeline(stage_modules(blocks, n_stages), ["cpu", "cpu"], "1f1b", 2, F.mse_loss)


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text and isinstance(exc.value, BrigadeError)
    return text


@pytest.mark.parametrize("make,what", [(lambda h: object(), "object"),
                                       (lambda h: (t for t in [h]), "generator")])
def test_a_block_output_that_cannot_be_sent_is_named(make, what):
    blocks = [nn.Linear(WIDTH, WIDTH), nn.Identity(), Returns(make), nn.Identity()]
    with _local(blocks) as pipe, pytest.raises(BrigadeError) as exc:
        pipe.step(torch.randn(4, WIDTH), torch.randn(4, WIDTH))
    text = _one_line(exc)
    assert text.startswith("stage 1: block 2 (Returns)'s output is a ") and what in text, text


def test_a_structure_the_next_stage_does_not_take_is_named():
    blocks = [nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), TakesDict(), nn.Identity()]
    with _local(blocks) as pipe, pytest.raises(BrigadeError) as exc:
        pipe.step(torch.randn(4, WIDTH), torch.randn(4, WIDTH))
    text = _one_line(exc)
    assert text.startswith("stage 1: block 2 (TakesDict) failed on block 1's output (previous stage), "
                           "Tensor(2, 8) float32"), text


def _side_blocks():
    return [nn.Linear(WIDTH, WIDTH), nn.Identity(), Masked(), nn.Identity()]


@pytest.mark.parametrize("inputs,expected", [
    ({"x": torch.randn(4, WIDTH)},
     "stage 1: block 2 (Masked) declares side input 'mask' but the batch has only ['x']"),
    ({"x": torch.randn(4, WIDTH), "mask": torch.ones(4), "extra": torch.ones(4)},
     "the batch's inputs ['x', 'extra'] are declared by no block"),
    ({"x": torch.randn(4, WIDTH), "mask": torch.ones(3)},
     "stage 1: block 2 (Masked)'s side input 'mask' has 3 rows along dim 0 but the batch has 4"),
    ({"x": (torch.randn(4, WIDTH), torch.randn(5, WIDTH)), "mask": torch.ones(4)},
     "stage 0: block 0 (Linear)'s input[1] has 5 rows along dim 0 but the batch has 4"),
])
def test_bad_side_and_batch_inputs_are_named(inputs, expected):
    with _local(_side_blocks()) as pipe, pytest.raises(BrigadeError) as exc:
        pipe.step(inputs, torch.randn(4, WIDTH))
    assert _one_line(exc).startswith(expected)


def test_side_inputs_reach_the_stage_that_declares_them():
    """The mask changes the result, so a pipeline that dropped or misrouted it would differ."""
    blocks = _side_blocks()
    ref = copy.deepcopy(blocks)
    x, y, mask = torch.randn(4, WIDTH), torch.randn(4, WIDTH), torch.tensor([1.0, 0.0, 1.0, 0.5])
    with _local(blocks) as pipe:
        loss = float(pipe.step({"x": x, "mask": mask}, y))
        out = pipe.forward({"x": x, "mask": mask})
    want = StageModule(ref)(x, {"mask": mask})
    assert abs(loss - F.mse_loss(want, y).item()) <= TOL
    assert torch.allclose(out, want, atol=TOL)
