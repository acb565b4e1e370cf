"""A catalogue of mistakes a user can make, and brigade's answer to each.

Every case: one line that names the value and how to fix it, a non-zero exit (2 for usage
errors), no traceback, and nothing written half-way. Cases refused before any worker starts run
`brigade.cli.main` in this process (the `cli` fixture, tests/conftest.py); those in END_TO_END,
and the cases that need a real run or a process without root's powers, run the real command.
"""

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brigade import config
from brigade.cli import build_parser, main
from brigade.errors import BrigadeError
from tests.e2e.helpers import TINY, brigade, inspect

pytestmark = pytest.mark.timeout(120)


def make(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


FACTORIES = {
    "missing.py": None,
    "nofactory.py": "def other():\n    pass\n",
    "raises.py": "def make():\n    raise ValueError('bad width')\n",
    "notmodule.py": "def make():\n    return 42\n",
    "mismatch.py": "import torch.nn as nn\ndef make():\n    return [nn.Linear(10, 7), nn.Linear(10, 5)]\n",
    "recompute9.py": "import torch.nn as nn\nrecompute = {9: 'full'}\n"
                     "def make():\n    return [nn.Linear(4, 4)]\n",
    "recomputehalf.py": "import torch.nn as nn\nrecompute = {0: 'half'}\n"
                        "def make():\n    return [nn.Linear(4, 4)]\n",
}

# (case id, arguments after `brigade`, text the error must contain, exit code)
CASES = [
    # configuration
    ("unknown flag", ["train", "--frobnicate"], "unrecognized arguments: --frobnicate", 2),
    ("wrong type", ["train", "--max-steps", "ten"], "invalid int value: 'ten'", 2),
    ("zero size", ["train", "--batch-size", "0"], "--batch-size 0: must be ≥ 1", 2),
    ("negative size", ["train", "--n-layer", "-2"], "--n-layer -2: must be ≥ 1", 2),
    ("negative lr", ["train", "--lr", "-1"], "--lr -1.0: must be ≥ 0", 2),
    ("unknown lr schedule", ["train", "--lr-schedule", "step"],
     "--lr-schedule 'step': expected one of cosine, wsd, linear, constant", 2),
    ("mixture with a missing corpus", ["train", "--data", "README.md:0.7,{tmp}/none.txt:0.3"],
     "--data README.md:0.7,{tmp}/none.txt:0.3: corpus '{tmp}/none.txt' (weight 0.3) not found", 2),
    ("mixture of zero weights", ["train", "--data", "README.md:0,README.md:0"],
     "--data README.md:0,README.md:0: the weights sum to 0: give at least one corpus a weight above 0", 2),
    ("held-out text missing", ["train", "--val-data", "{tmp}/none.txt"],
     "--val-data '{tmp}/none.txt' not found: give a UTF-8 text file", 2),
    ("held-out text for made-up batches", ["train", "--model", "mlp", "--val-data", "README.md"],
     "--val-data 'README.md': mlp trains on made-up batches, not text: give it --data FILE to hold text "
     "out from", 2),
    ("unknown tracker", ["train", "--log", "wandb,neptune"],
     "--log wandb,neptune: 'neptune' is not a tracker: expected tensorboard, wandb, mlflow, comma-separated "
     "(--log wandb,mlflow)", 2),
    ("negative decay steps", ["train", "--decay-steps", "-1"], "--decay-steps -1: must be ≥ 0", 2),
    ("decay fraction 0", ["train", "--lr-schedule", "wsd", "--decay-fraction", "0"],
     "--decay-fraction 0.0: must be above 0 and at most 1", 2),
    ("dp x pp != world", ["train", "--nproc", "2", "--dp", "2", "--pp", "2"],
     "the world size must equal dp × pp", 2),
    ("tp does not divide the world", ["train", "--nproc", "3", "--tp", "2"],
     "--tp 2 does not divide the world size 3 (--nproc 3 × --nnodes 1): make the world a multiple of "
     "--tp", 2),
    ("dp x pp x tp != world", ["train", "--nproc", "4", "--dp", "1", "--pp", "2", "--tp", "1"],
     "the world size must equal dp × pp", 2),
    ("dp x pp x tp != world, tp 2", ["train", "--nproc", "4", "--dp", "2", "--pp", "2", "--tp", "2"],
     "--dp 2 × --pp 2 × --tp 2 = 8 but the world size is 4 (--nproc 4 × --nnodes 1): the world size "
     "must equal dp × pp × tp", 2),
    ("world not divisible by pp x tp", ["train", "--nproc", "6", "--pp", "2", "--tp", "2"],
     "world size 6 (--nproc 6 × --nnodes 1) is not divisible by --pp 2 × --tp 2 = 4", 2),
    ("tp heads", ["train", "--nproc", "3", "--tp", "3"],
     "block 1 (Block) of gpt: attn.qkv splits into 4 heads (or groups), which --tp 3 does not divide", 2),
    ("tp without a plan", ["train", "--nproc", "2", "--tp", "2", "--model", "mlp"],
     "block 0 (Sequential) of mlp has no tensor-parallel plan, so --tp 2 cannot split it", 2),
    ("tp with local stages", ["train", "--nproc", "2", "--tp", "2", "--local-stages", "2"],
     "--tp 2 with --local-stages 2: tensor parallel splits each block over processes", 2),
    ("tp elastic", ["train", "--nnodes", "1:2", "--tp", "2", "--max-restarts", "1"],
     "--tp 2 with an elastic --nnodes 1:2: not supported yet", 2),
    ("tp zero", ["train", "--tp", "0"], "--tp 0: must be ≥ 1", 2),
    ("top-k over the experts", ["train", "--experts", "4", "--top-k", "5"],
     "--top-k 5 with --experts 4: each token goes to from 1 to 4 experts; give a --top-k in that range", 2),
    ("experts on another model", ["train", "--experts", "4", "--model", "mlp"],
     "--experts 4 with --model mlp: --experts builds the built-in gpt's mixture of experts", 2),
    ("check: top-k over the experts", ["check", "--experts", "2", "--top-k", "3"],
     "--top-k 3 with --experts 2", 2),
    ("ep not dividing the experts", ["train", "--nproc", "3", "--experts", "4", "--ep", "3"],
     "--ep 3 does not divide --experts 4: give --ep a divisor of 4", 2),
    ("ep not dividing dp", ["train", "--nproc", "4", "--pp", "2", "--experts", "4", "--ep", "4"],
     "--ep 4 does not divide the data-parallel width dp 2 (--nproc 4 × --nnodes 1): give --ep a divisor "
     "of 2", 2),
    ("ep without experts", ["train", "--nproc", "2", "--ep", "2"],
     "--ep 2 but the gpt has no experts to split: give --experts", 2),
    ("ep with local stages", ["train", "--local-stages", "2", "--experts", "4", "--ep", "2"],
     "--ep 2 with --local-stages 2: expert parallel splits experts over processes", 2),
    ("ep zero", ["train", "--experts", "4", "--ep", "0"], "--ep 0: must be ≥ 1", 2),
    ("cp zero", ["train", "--cp", "0"], "--cp 0: must be ≥ 1", 2),
    ("cp not splitting the sequence", ["train", "--nproc", "2", "--cp", "2", "--block-size", "31"],
     "--block-size 31 does not split into --cp 2 = 2 equal parts: use a sequence length that 2 divides, "
     "like 32", 2),
    ("cp not splitting the heads", ["train", "--nproc", "4", "--cp", "4", "--n-head", "2", "--n-embd", "32"],
     "the gpt (--n-head) has 2 attention heads, which --cp 4 = 4 does not divide", 2),
    ("cp ring on a cpu", ["train", "--nproc", "2", "--cp", "2", "--cp-method", "ring"],
     "--cp-method ring on cpu: torch's ring attention runs on CUDA only", 2),
    ("cp not dividing the world", ["train", "--nproc", "3", "--cp", "2"],
     "world size 3 (--nproc 3 × --nnodes 1) is not divisible by --pp 1 × --cp 2 = 2", 2),
    ("cp with ep", ["train", "--nproc", "4", "--cp", "2", "--experts", "4", "--ep", "2"],
     "--cp 2 with --ep 2: context parallel does not compose with expert parallel yet", 2),
    ("cp with local stages", ["train", "--local-stages", "2", "--cp", "2"],
     "--cp 2 with --local-stages 2: context parallel splits each sequence over processes", 2),
    ("cp with document masks", ["train", "--nproc", "2", "--cp", "2", "--model", "hf:{tmp}/model"],
     "--cp 2 with document masks (on for an hf:DIR model's shard sets): context parallel takes causal "
     "attention without a mask", 2),
    ("check: cp with documents", ["check", "--documents", "--cp", "2"],
     "--cp 2 with --documents: context parallel takes causal attention without a mask", 2),
    ("check: documents on a model without them", ["check", "--documents", "--model", "toy"],
     "--documents with toy: only the gpt and hf:DIR models take packed documents", 2),
    ("check: ep not dividing the experts", ["check", "--experts", "4", "--dp", "3", "--ep", "3",
                                            "--batch-size", "6"],
     "--ep 3 does not divide the 4 experts of block 1: give --ep a divisor of 4", 2),
    ("check: ep not dividing dp", ["check", "--experts", "4", "--dp", "2", "--ep", "4"],
     "--ep 4 does not divide the data-parallel width dp 2: give --ep a divisor of 2", 2),
    ("check: ep without experts", ["check", "--model", "gpt", "--dp", "2", "--ep", "2"],
     "--ep 2 but gpt has no mixture-of-experts layer to split", 2),
    ("check: ep on the local runtime", ["check", "--experts", "4", "--dp", "2", "--ep", "2",
                                        "--runtime", "local"],
     "--ep 2 with --runtime local: expert parallel splits experts over processes", 2),
    ("sequence parallel length", ["train", "--nproc", "2", "--tp", "2", "--block-size", "33"],
     "--block-size 33 does not split into --tp 2 equal parts, which sequence parallel needs: use a "
     "--block-size that 2 divides, or --no-sequence-parallel", 2),
    ("microbatches > batch", ["train", "--pp", "2", "--microbatches", "64"],
     "--microbatches 64 is larger than each replica's batch (32)", 2),
    ("balance vs blocks", ["train", "--pp", "2", "--balance", "1,1"],
     "balance [1, 1] sums to 2 but the model has 6 blocks", 2),
    ("malformed balance", ["train", "--pp", "2", "--balance", "3;3"], "expected comma-separated", 2),
    ("auto V 3", ["train", "--pp", "2", "--schedule", "auto", "--virtual", "3"],
     "--virtual 3: schedule auto runs 1 to 2 stage(s) per rank", 2),
    ("auto limit below V", ["train", "--pp", "2", "--schedule", "auto", "--auto-limit", "1"],
     "--auto-limit 1: below the 2 stages each pipeline rank holds", 2),
    ("auto limit, fixed schedule", ["train", "--pp", "2", "--schedule", "zb", "--auto-limit", "3"],
     "--auto-limit 3: only a generated schedule (--schedule auto) takes a memory limit", 2),
    ("block size > context", ["train", "--block-size", "512"], "larger than the model's context 128", 2),
    ("unknown schedule", ["train", "--schedule", "zigzag"], "--schedule 'zigzag'", 2),
    ("malformed toml", ["train", "--config", "{tmp}/bad.toml"], "is not valid TOML", 2),
    ("unknown toml key", ["train", "--config", "{tmp}/typo.toml"], "unknown key 'max_stepz' in [train]", 2),
    ("toml wrong type", ["train", "--config", "{tmp}/type.toml"], "is a str, expected int", 2),
    ("missing toml", ["train", "--config", "{tmp}/none.toml"], "not found: give the path to a .toml", 2),
    ("fault malformed", ["train", "--inject-fault", "kill:rank=one"], "expected KIND:rank=R:step=S", 2),
    ("fault unknown kind", ["train", "--inject-fault", "explode:rank=0:step=1"], "with KIND one of", 2),
    ("fault rank past the world", ["train", "--inject-fault", "kill:rank=2:step=3"],
     "rank 2 does not exist in a world of 2 processes: give a rank from 0 to 1", 2),
    ("fault rank past dp x pp", ["train", "--nproc", "4", "--pp", "2", "--inject-fault", "nan:rank=4:step=1"],
     "rank 4 does not exist in a world of 4 processes", 2),
    ("fault rank past dp x cp", ["train", "--nproc", "4", "--cp", "2",
                                 "--inject-fault", "kill:rank=4:step=1"],
     "rank 4 does not exist in a world of 4 processes", 2),
    ("snapshot minutes 0", ["train", "--snapshot-minutes", "0"],
     "--snapshot-minutes 0: must be above 0, the minutes between snapshots; leave it out to snapshot by "
     "--snapshot-every's steps only", 2),
    ("snapshot minutes below 0", ["train", "--snapshot-minutes", "-5"],
     "--snapshot-minutes -5: must be above 0", 2),
    ("snapshot minutes nan", ["train", "--snapshot-minutes", "nan"],
     "--snapshot-minutes nan: must be above 0", 2),
    ("stop grace 0", ["train", "--stop-grace", "0"],
     "--stop-grace 0: must be above 0, the seconds a stop", 2),
    ("snapshot error policy", ["train", "--on-snapshot-error", "ignore"],
     "--on-snapshot-error 'ignore': expected stop (end the run) or warn (say so and train on)", 2),
    ("fault step 0", ["train", "--inject-fault", "kill:rank=0:step=0"],
     "step 0 is never run: give a step from 1 to --max-steps", 2),
    ("fault step past the end", ["train", "--max-steps", "5", "--inject-fault", "stall:rank=0:step=6"],
     "step 6 is never run: give a step from 1 to --max-steps 5", 2),
    # sharding
    ("shard does not divide dp", ["train", "--nproc", "4", "--pp", "2", "--shard", "4"],
     "--shard 4 does not divide the data-parallel width dp 2: give --shard a divisor of 2", 2),
    ("shard 0", ["train", "--shard", "0"], "--shard 0: must be ≥ 1", 2),
    ("shard with local stages", ["train", "--shard", "2", "--local-stages", "2"],
     "--shard 2 with --local-stages 2: FSDP2 shards over a DeviceMesh of one device per process", 2),
    ("elastic shard not dividing dp at MAX", ["train", "--nnodes", "2:3", "--rdzv-endpoint",
                                             "127.0.0.1:29999", "--nproc", "2", "--shard", "4",
                                             "--max-restarts", "1", "--batch-size", "48"],
     "--shard 4 does not divide the data-parallel width dp 6 on 3 node(s)", 2),
    ("check shard does not divide dp", ["check", "--dp", "2", "--shard", "3"],
     "--shard 3 does not divide the data-parallel width dp 2: give --shard a divisor of 2", 2),
    ("check shard under the local runtime", ["check", "--dp", "2", "--shard", "2", "--runtime", "local"],
     "--shard 2 with --runtime local: FSDP2 shards over one device per process", 2),
    ("unknown AdamW update", ["train", "--adamw", "adam"],
     "--adamw 'adam': expected one of auto, fused, foreach, for-loop", 2),
    ("unknown float8 recipe", ["train", "--float8", "blockwise"],
     "--float8 'blockwise': expected one of tensorwise, rowwise", 2),
    ("check: unknown float8 recipe", ["check", "--float8", "blockwise"],
     "--float8 'blockwise': expected one of tensorwise, rowwise", 2),
    ("a measured cut without auto", ["train", "--balance", "measured", "--pp", "2"],
     "--balance measured cuts the blocks for a costed schedule's plan (auto), not for --schedule 1f1b", 2),
    ("a loss chunk of no positions", ["train", "--loss-chunk", "0"], "--loss-chunk 0: must be ≥ 1", 2),
    ("check: a negative loss chunk", ["check", "--loss-chunk", "-4"],
     "--loss-chunk -4: must be ≥ 1 positions", 2),
    ("unknown chunked loss", ["train", "--chunked-loss", "always"],
     "--chunked-loss 'always': expected one of auto, on, off", 2),
    ("unknown recompute", ["train", "--recompute", "some"],
     "--recompute 'some': expected one of none, full", 2),
    ("recompute names a block the model lacks", ["train", "--model", "{tmp}/recompute9.py:make"],
     "recompute names block 9 but the model has 1 blocks (0 to 0): name blocks by their index", 2),
    ("recompute of a block unknown", ["check", "--model", "{tmp}/recomputehalf.py:make", "--runtime",
                                      "local"],
     "block 0 (Linear) declares recompute 'half': expected one of none, full, selective", 2),
    # model
    ("unknown model", ["train", "--model", "vgg"], "unknown model 'vgg'", 2),
    ("model file missing", ["train", "--model", "{tmp}/missing.py:make"], "not found", 2),
    ("factory missing", ["train", "--model", "{tmp}/nofactory.py:make"], "has no factory 'make'", 2),
    ("factory raises", ["train", "--model", "{tmp}/raises.py:make"], "raised ValueError: bad width", 2),
    ("factory returns a non-module", ["train", "--model", "{tmp}/notmodule.py:make"],
     "returned int: expected an nn.Sequential or a list of nn.Module blocks", 2),
    ("blocks do not fit", ["check", "--model", "{tmp}/mismatch.py:make", "--runtime", "local"],
     "block 0 (Linear) outputs shape (1, 7), which block 1 (Linear) cannot take", 2),
    ("blocks do not fit, under train", ["train", "--model", "{tmp}/mismatch.py:make"],
     "block 0 (Linear) outputs shape (1, 7), which block 1 (Linear) cannot take", 2),
    ("blocks do not fit, under train --pp 2", ["train", "--model", "{tmp}/mismatch.py:make", "--pp", "2"],
     "block 0 (Linear) outputs shape (1, 7), which block 1 (Linear) cannot take", 2),
    # data
    ("data missing", ["train", "--data", "{tmp}/nope.txt"], "--data '{tmp}/nope.txt' not found", 2),
    ("data empty", ["train", "--data", "{tmp}/empty.txt"], "is empty", 2),
    ("data binary", ["train", "--data", "{tmp}/blob.bin"], "looks binary", 2),
    ("data shorter than a block", ["train", "--data", "{tmp}/short.txt"],
     "fewer than one block of 128 + 1", 2),
    ("data is a directory", ["train", "--data", "{tmp}"], "is a directory", 2),
    # tokenize
    ("tokenize without --out", ["tokenize", "{tmp}/short.txt", "--model", "hf:{tmp}"],
     "--out is missing: give the folder to write the shards into", 2),
    ("tokenize for a model without a tokenizer", ["tokenize", "{tmp}/short.txt", "--model", "gpt",
                                                  "--out", "{tmp}/shards"], "give hf:DIR", 2),
    ("tokenize a missing corpus", ["tokenize", "{tmp}/nothing.txt", "--model", "hf:{tmp}", "--out",
                                   "{tmp}/shards"], "nothing.txt' not found: give text files", 2),
    # snapshots and outputs
    ("out is a file", ["train", "--out", "{tmp}/short.txt"], "is a file: give a folder", 2),
    ("inspect a missing path", ["inspect", "{tmp}/nothing"], "not found", 2),
    ("generate with no snapshot", ["generate", "--from", "{tmp}"], "holds no complete snapshot", 2),
    # benchmarks
    ("bench split size 0", ["bench", "--model", "toy", "--splits", "0"], "split sizes must be between 1", 2),
    ("bench unknown schedule", ["bench", "--model", "toy", "--schedules", "fast"], "unknown schedule", 2),
    ("bench one rank", ["bench", "--model", "toy", "--ranks", "1"],
     "--ranks 1: expected at least 2 pipeline ranks", 2),
    ("bench more ranks than blocks", ["bench", "--model", "toy", "--ranks", "4"],
     "toy has 3 block(s): bench --ranks 4 needs at least 4 to split", 2),
    ("bench BatchNorm, one sample a rank",
     ["bench", "--model", "resnet50", "--batch-size", "7", "--ranks", "4"],
     "resnet50 has BatchNorm, which needs 2 samples a batch: batch 7 over 4 ranks leaves a data-parallel "
     "rank 1; give --batch-size 8 or more", 2),
    ("bench BatchNorm, micro-batches of one",
     ["bench", "--model", "resnet50", "--batch-size", "8", "--splits", "1,4"],
     "split size 1 of batch 8 gives micro-batches of 1; give brigade bench --splits sizes of 2 or more", 2),
    ("tune BatchNorm, odd micro-batches",
     ["tune", "--model", "resnet50", "--batch-size", "9", "--splits", "2"],
     "split size 2 of batch 9 gives micro-batches of 1; give brigade tune --splits sizes of 3 or more", 2),
    ("bench a model with side inputs", ["bench", "--model", "examples/llama.py:model"],
     "examples/llama.py:model takes side inputs: brigade bench times models whose batch is one tensor", 2),
    ("tune a model with side inputs", ["tune", "--model", "examples/llama.py:model"],
     "examples/llama.py:model takes side inputs: brigade tune times models whose batch is one tensor", 2),
    # environment
    ("rendezvous endpoint malformed", ["train", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                                       "nohost"], "expected HOST:PORT", 2),
    ("local address not on this machine", ["train", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29999",
                                           "--local-addr", "192.0.2.7"],
     "is not an address of this machine", 2),
    # doctor
    ("doctor node rank too large", ["doctor", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint",
                                    "127.0.0.1:29999"], "--node-rank 2: must be between 0 and", 2),
    ("doctor endpoint malformed", ["doctor", "--nnodes", "2", "--rdzv-endpoint", "node0"],
     "expected HOST:PORT", 2),
    ("doctor zero processes", ["doctor", "--nproc", "0"], "--nproc 0: must be ≥ 1", 2),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    make(tmp, "bad.toml", "[train\nmax_steps = 3\n")
    make(tmp, "typo.toml", "[train]\nmax_stepz = 3\n")
    make(tmp, "type.toml", "[train]\nmax_steps = 'three'\n")
    make(tmp, "empty.txt", "")
    make(tmp, "blob.bin", b"\x7fELF\x00\x01\x02\x00" * 64)
    make(tmp, "short.txt", "just a few words")
    for name, body in FACTORIES.items():
        if body:
            make(tmp, name, body)
    return tmp


# Proven as a user runs them (a subprocess: the real entry point prints one line, no traceback);
# one per way of failing: argparse, the configuration, the model factory.
END_TO_END = {"unknown flag", "zero size", "factory raises"}


def assert_clean(result, message: str, code: int) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert message in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("case,argv,message,code", CASES, ids=[c[0] for c in CASES])
def test_catalogue(tmp, cli, case, argv, message, code):
    out = tmp / f"out-{case.replace(' ', '-')}"
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    if argv[0] == "train" and "--out" not in argv:
        argv += ["--out", str(out)]
    result = brigade(*argv) if case in END_TO_END else cli(*argv)
    assert_clean(result, message.replace("{tmp}", str(tmp)), code)
    assert not out.exists(), "nothing may be written for a rejected run"


def test_shard_on_a_torch_without_fsdp2(cli, tmp_path, monkeypatch):
    """A torch before 2.6 has no torch.distributed.fsdp.fully_shard: refused, naming the version."""
    import builtins

    real = builtins.__import__

    def no_fsdp(name, *args, **kw):
        if name == "torch.distributed.fsdp" and "fully_shard" in (args[2] if len(args) > 2 else ()):
            raise ImportError("cannot import name 'fully_shard'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_fsdp)
    result = cli("train", "--out", tmp_path / "run", "--shard", "2")
    assert_clean(result, "--shard 2 needs FSDP2 (torch.distributed.fsdp.fully_shard, torch ≥ 2.6)", 2)
    assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback():
    # --debug lets the error escape main(): `python -m brigade` then prints its traceback
    with pytest.raises(BrigadeError, match="unknown model 'vgg'"):
        main(["train", "--model", "vgg", "--debug"])


@pytest.fixture
def run(tiny_run):
    return tiny_run


def damaged(run: Path, tmp: Path, how: str) -> Path:
    copy = tmp / how
    shutil.copytree(run, copy)
    snap = copy / "snapshots" / "step_00000006"
    data = sorted(snap.glob("*.distcp"))[0]
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:100])
    elif how == "bit-flipped":
        blob = bytearray(data.read_bytes())
        blob[-10] ^= 0x01
        data.write_bytes(bytes(blob))
    elif how == "no-manifest":
        (snap / "manifest.json").unlink()
    return snap


@pytest.mark.parametrize("how,message", [
    ("truncated", "does not match its checksum (damaged or truncated)"),
    ("bit-flipped", "does not match its checksum (damaged or truncated)"),
    ("no-manifest", "has no manifest.json: the snapshot is incomplete"),
])
def test_damaged_snapshots(run, cli, tmp_path, how, message):
    snap = damaged(run, tmp_path, how)
    assert_clean(cli("inspect", snap), message, 2)
    assert_clean(cli("generate", "--from", snap, "--tokens", "3"), message, 2)
    # a run folder falls back to the older good snapshot, with a warning
    result = cli("inspect", snap.parent.parent, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["step"] == 3
    assert "skipping snapshot step_00000006" in result.stderr


def test_snapshot_of_another_model(run, cli, tmp_path):
    copy = tmp_path / "other"
    shutil.copytree(run, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    result = cli("train", "--out", copy, *TINY, "--max-steps", "6", "--n-layer", "3")
    assert_clean(result, "is of another model (differs in model.n_layer)", 2)
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_a_resume_that_would_move_the_decay_is_refused(run, cli, tmp_path):
    """--max-steps changed on resume without --decay-steps: the decay's end is the snapshot's."""
    copy = tmp_path / "longer"
    shutil.copytree(run, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    result = cli("train", "--out", copy, *TINY, "--max-steps", "9")
    assert_clean(result, "--max-steps 9: the snapshot in", 2)
    assert "ends its cosine decay on step 6 (--max-steps then)" in result.stderr
    assert "add --decay-steps 6 to keep it" in result.stderr
    assert "or --decay-steps 9 to stretch" in result.stderr
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def _mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")


def test_read_only_out(cli, tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        result = cli("train", "--out", ro / "run", *TINY, "--max-steps", "2")
        assert_clean(result, f"--out '{ro / 'run'}' cannot be written (Read-only file system)", 2)
    finally:
        subprocess.run(["umount", str(ro)])


def _without_root_powers() -> list[str]:
    """A command prefix under which permission bits hold: root ignores them unless it drops
    CAP_DAC_OVERRIDE (and CAP_DAC_READ_SEARCH) for the child; a normal user needs nothing."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permission bits cannot be enforced")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


@pytest.mark.parametrize("where", ["locked", "locked/run"])
def test_out_without_write_permission(tmp_path, where):
    import sys

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    out = tmp_path / where
    try:
        result = subprocess.run([*_without_root_powers(), sys.executable, "-m", "brigade", "train",
                                 "--out", str(out), *TINY, "--max-steps", "2"],
                                capture_output=True, text=True, timeout=120)
        assert_clean(result, f"--out '{out}' cannot be written (Permission denied): choose a writable", 2)
        assert list(locked.iterdir()) == []  # nothing written
    finally:
        locked.chmod(0o755)


def test_full_disk_keeps_the_previous_snapshot(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=2000k")  # room for one snapshot of this model, not for two
    try:
        result = brigade("train", "--out", disk / "run", *TINY, "--max-steps", "12", "--snapshot-every",
                         "5", "--sample-tokens", "0")
        assert result.returncode == 1
        assert "writing snapshot step 10" in result.stderr
        assert "the previous snapshot (step_00000005) is intact" in result.stderr
        assert "Traceback" not in result.stderr
        snaps = disk / "run" / "snapshots"
        assert sorted(p.name for p in snaps.iterdir()) == ["LATEST", "step_00000005"]  # no half-written one
        assert inspect(disk / "run")["step"] == 5
    finally:
        subprocess.run(["umount", str(disk)])


def test_port_in_use(cli, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = cli("train", "--out", tmp_path / "run", *TINY, "--port", port)
    assert_clean(result, f"port {port} on 127.0.0.1 is already in use", 2)


def test_rendezvous_endpoint_that_does_not_answer(cli, tmp_path, monkeypatch):
    from brigade.host import net

    monkeypatch.setattr(net, "REACH_WAIT_S", 1.0)  # the wait is not the point; 15 s by default
    port = net.free_port()
    start = os.times().elapsed
    result = cli("train", "--out", tmp_path / "run", *TINY, "--nnodes", "2", "--node-rank", "1",
                     "--rdzv-endpoint", f"127.0.0.1:{port}")
    assert_clean(result, f"rendezvous endpoint 127.0.0.1:{port} does not answer", 2)
    assert os.times().elapsed - start < 30


def test_too_many_processes_warns(tmp_path):
    # nproc × threads above the cores: 2 processes with enough threads each oversubscribe as
    # cores + 2 processes did, for half the process starts
    threads = (os.cpu_count() or 1) // 2 + 1
    result = brigade("train", "--out", tmp_path / "run", *TINY, "--nproc", "2", "--threads", str(threads),
                     "--max-steps", "1", "--sample-tokens", "0", "--eval-batches", "1")
    assert result.returncode == 0, result.stderr
    assert f"warning: --nproc 2 × --threads {threads} is more than the" in result.stdout


# Property: whatever the TOML file or the command line, the answer is success or a clean error.
_FIELDS = [(s, f.name) for s, cls in config.section_classes().items()
           for f in __import__("dataclasses").fields(cls)]
_values = st.one_of(st.integers(-5, 300), st.floats(-2, 2, allow_nan=False), st.text(max_size=8),
                    st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(_FIELDS + [("train", "bogus"), ("nosection", "x")]), _values,
                       max_size=6))
def test_random_toml_is_accepted_or_cleanly_refused(tmp_path, entries):
    lines = {}
    for (section, key), value in entries.items():
        text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
        lines.setdefault(section, []).append(f"{key} = {text}")
    text = "".join(f"[{s}]\n" + "\n".join(kv) + "\n" for s, kv in lines.items())
    path = tmp_path / "random.toml"
    path.write_text(text)
    try:
        cfg = config.build(None, config.load_toml(path))
    except BrigadeError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    _preflight_is_clean(cfg)


_SMALL = 5_000_000  # GPT parameters (about 12 · layers · width²): larger ones are skipped, to keep it fast


def _preflight_is_clean(cfg) -> None:
    """What parses goes on to preflight (in-process, small models only): success or a BrigadeError."""
    import dataclasses
    import tempfile

    from brigade.train.run import preflight

    m, p = cfg.model, cfg.parallel
    if p.nnodes > 1:  # addressing and reachability: their own tests, with real endpoints
        return
    if m.model == "gpt" and (12 * m.n_layer * m.n_embd ** 2 > _SMALL or m.context > 4096):
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out=str(out)))
        try:
            preflight(cfg)
        except BrigadeError as exc:
            assert "\n" not in str(exc) and str(exc)


_flags = ["--" + name.replace("_", "-") for _, name in _FIELDS] + ["--bogus", "--config", "--json"]
_tokens = st.one_of(st.sampled_from(_flags), st.sampled_from(["0", "-1", "2", "1f1b", "x", "3,3", ""]))


@settings(max_examples=80, deadline=None)
@given(st.lists(_tokens, max_size=8))
def test_random_command_lines_are_accepted_or_cleanly_refused(argv):
    try:
        args = build_parser().parse_args(["train", *argv])
        cfg = config.build(args)
    except SystemExit as exc:
        assert exc.code == 2
        return
    except BrigadeError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    _preflight_is_clean(cfg)


# Property: plausible command lines (small models, layouts, balances, model files) mostly parse,
# so they reach preflight; there too the answer is success or one clean line.
_PLAUSIBLE = {
    "--model": st.sampled_from(["gpt", "toy", "{tmp}/mismatch.py:make", "{tmp}/raises.py:make",
                                "{tmp}/notmodule.py:make"]),
    "--pp": st.integers(1, 4), "--nproc": st.integers(1, 4), "--local-stages": st.integers(1, 3),
    "--n-layer": st.integers(1, 6), "--n-embd": st.sampled_from([8, 16, 24, 32]),
    "--n-head": st.integers(1, 4), "--context": st.sampled_from([8, 16, 32, 64]),
    "--block-size": st.sampled_from([8, 16, 32, 64, 100]), "--batch-size": st.integers(1, 16),
    "--microbatches": st.integers(1, 8), "--schedule": st.sampled_from(["gpipe", "1f1b", "zb"]),
    "--balance": st.sampled_from(["1,1", "2,2,2", "3,3", "0,6", "4,4", "x"]),
    "--backend": st.sampled_from(["auto", "gloo", "nccl"]),
    "--data": st.sampled_from(["{tmp}/short.txt", "{tmp}/blob.bin", "{tmp}/empty.txt"]),
}


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({}, optional=_PLAUSIBLE))
def test_plausible_command_lines_reach_preflight_and_fail_cleanly(tmp, flags):
    argv = [str(a).replace("{tmp}", str(tmp)) for kv in flags.items() for a in kv]
    try:
        cfg = config.build(build_parser().parse_args(["train", *argv]))
    except BrigadeError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    _preflight_is_clean(cfg)


def _hf_copy(tmp_path: Path, family: str = "llama") -> Path:
    from tests.models.hf.dirs import tiny_dir

    copy = tmp_path / f"{family}-copy"
    shutil.copytree(tiny_dir(family), copy)
    return copy


def _no_tokenizer(d: Path, tmp_path: Path) -> list:
    (d / "tokenizer.json").unlink()
    return []


def _bad_json_line(d: Path, tmp_path: Path) -> list:
    return ["--data", make(tmp_path, "notes.jsonl", '{"text": "fine"}\n{"txt": "oops"}\n')]


def _wrong_tokenizer(d: Path, tmp_path: Path) -> list:
    from brigade.models.hf import tiny

    tiny.tokenizer(1024).save(str(d / "tokenizer.json"))  # ids past the model's 257 embeddings
    return []


def _drop_tensor(d: Path) -> list:
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return []


# (case, how the directory or the command is spoiled → extra flags, the error, exit code)
HF_CASES = [
    ("no tokenizer", _no_tokenizer, "tokenizer.json' not found: the directory needs the tokenizer.json", 2),
    ("json line without text", _bad_json_line, "line 2 has no string field 'text'", 2),
    ("tokenizer of another model", _wrong_tokenizer, "but the model has 257 embeddings", 2),
    ("longer than the positions", lambda d, t: ["--block-size", "256"],
     "--block-size 256 is longer than the 128 positions", 2),
    ("gpt2 under tp", lambda d, t: ["--nproc", "2", "--tp", "2"], "has no tensor-parallel plan", 2),
    ("a tensor missing", lambda d, t: _drop_tensor(d), "the weights have no tensor 'model.norm.weight'", 2),
]


@pytest.mark.parametrize("case,spoil,message,code", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_hf_training_refused_in_one_line(cli, tmp_path, case, spoil, message, code):
    pytest.importorskip("transformers")
    directory = _hf_copy(tmp_path, "gpt2" if "gpt2" in case else "llama")
    flags = spoil(directory, tmp_path)
    out = tmp_path / "out"
    assert_clean(cli("train", "--model", f"hf:{directory}", "--out", out, *flags), message, code)
    assert not out.exists(), "nothing may be written for a rejected run"


def _jsonl_without_text(tmp_path: Path) -> list:
    return [make(tmp_path, "d.jsonl", '{"text": "fine"}\n{"txt": "oops"}\n')]


TOKENIZE_CASES = [
    ("binary", lambda t: [make(t, "blob.bin", b"\x7fELF\x00\x01" * 64)], "looks binary (it has NUL bytes)"),
    ("not utf-8", lambda t: [make(t, "latin.txt", b"caf\xe9 au lait\n")], "is not UTF-8 text (byte 3)"),
    ("a json line without text", _jsonl_without_text, "line 2 has no string field 'text'"),
    ("no text at all", lambda t: [make(t, "blank.jsonl", '{"text": ""}\n')], "has no text: give files"),
    ("an empty folder", lambda t: [str((t / "empty").mkdir() or t / "empty")], "has no files"),
]


@pytest.mark.parametrize("case,corpus,message", TOKENIZE_CASES, ids=[c[0] for c in TOKENIZE_CASES])
def test_tokenize_refuses_a_bad_corpus_in_one_line(cli, tmp_path, case, corpus, message):
    pytest.importorskip("tokenizers")
    from tests.models.hf.dirs import tiny_dir

    out = tmp_path / "shards"
    assert_clean(cli("tokenize", *corpus(tmp_path), "--model", f"hf:{tiny_dir('llama')}", "--out", out),
                 message, 2)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_training_refuses_shards_of_another_tokenizer_or_truncated(cli, tmp_path):
    pytest.importorskip("transformers")
    from tests.models.hf.dirs import tiny_dir

    shards = tmp_path / "shards"
    text = make(tmp_path, "notes.txt", "some words to tokenize, and more\n" * 200)
    assert cli("tokenize", text, "--model", f"hf:{tiny_dir('llama')}", "--out", shards).returncode == 0
    other = _hf_copy(tmp_path)
    from brigade.models.hf import tiny

    tiny.tokenizer(300).save(str(other / "tokenizer.json"))
    assert_clean(cli("train", "--model", f"hf:{other}", "--data", shards, "--out", tmp_path / "a"),
                 "were tokenized by another tokenizer", 2)
    (shards / "tokens-00000.bin").write_bytes(b"\x01\x00")
    mine = f"hf:{tiny_dir('llama')}"
    assert_clean(cli("train", "--model", mine, "--data", shards, "--out", tmp_path / "b"),
                 "has 2 bytes where its manifest says", 2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_hf_missing_directory_and_export_of_another_model(cli, run, tmp_path):
    pytest.importorskip("transformers")
    assert_clean(cli("check", "--model", f"hf:{tmp_path / 'nowhere'}"), "no such directory", 2)
    assert_clean(cli("export", "--hf", tmp_path / "out", "--from", run),
                 "is a gpt run: export --hf needs a run of an hf:DIR model", 2)
    assert not (tmp_path / "out").exists()
