"""The CLI as a user runs it: output, JSON, exit codes, one-line errors.

Commands that start no worker and print (schedule, refused arguments) run `brigade.cli.main`
in this process (the `cli` fixture, tests/conftest.py); `check` runs as a real subprocess, and
one refused argument does too, end to end.
"""

import json
import socket
import subprocess
import sys

import pytest


def brigade(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "brigade", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_schedule_grid_and_json(cli):
    out = cli("schedule", "--schedule", "gpipe", "--stages", "2", "--microbatches", "3")
    assert out.returncode == 0
    assert "rank 1 | .   1F0" in out.stdout and "bubble 0.250" in out.stdout
    data = json.loads(cli("schedule", "--stages", "4", "--microbatches", "8", "--json").stdout)
    assert data["schedule"] == "1f1b" and data["stages"] == 4 and data["microbatches"] == 8
    assert data["bubble_fraction"] == pytest.approx(3 / 11) and data["makespan"] == 22



def test_schedule_virtual_stages_grid_and_json(cli):
    out = cli("schedule", "--schedule", "interleaved", "--stages", "2", "--virtual", "2",
              "--microbatches", "4")
    assert out.returncode == 0, out.stderr
    assert "2 stages per rank (loop)" in out.stdout
    assert "rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0" in out.stdout and "rank 1 | .   1F0 1F1 3F0" in out.stdout
    assert "bubble 0.111  makespan 18" in out.stdout and "0:4 1:3 2:2 3:1" in out.stdout
    data = json.loads(cli("schedule", "--schedule", "zbv", "--stages", "2", "--microbatches", "4",
                          "--json").stdout)
    assert data["virtual"] == 2 and data["placement"] == "v"
    assert data["bubble_fraction"] == pytest.approx(1 / 17) and data["makespan"] == 17
    assert data["peak_held"] == {"0": 4, "1": 3, "2": 2, "3": 1}
    assert data["plan"]["1"][:2] == ["1F0", "2F0"]

@pytest.mark.timeout(120)
def test_check_gpt_two_processes_json():
    out = brigade("check", "--model", "gpt", "--stages", "2", "--schedule", "gpipe",
                  "--microbatches", "3", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] and data["max_abs_loss_diff"] <= 1e-5 and data["max_abs_grad_diff"] <= 1e-5


def test_check_local_runtime_user_factory(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch.nn as nn\ndef make():\n"
                 "    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))\n")
    out = brigade("check", "--model", f"{f}:make", "--runtime", "local", "--stages", "3",
                  "--balance", "1,2,1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK:") and "balance [1, 2, 1]" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["check", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    (["check", "--model", "vgg"], "unknown model 'vgg'"),
    (["check", "--stages", "0"], "stages=0"),
    (["check", "--microbatches", "0"], "microbatches=0"),
    (["check", "--microbatches", "9", "--batch-size", "8"], "larger than the batch"),
    (["check", "--model", "toy", "--stages", "4"], "only 3 blocks"),
    (["check", "--model", "toy", "--balance", "1,1"], "sums to 2 but the model has 3 blocks"),
    (["check", "--model", "missing.py:make"], "model file 'missing.py' not found"),
    (["check", "--stages", "two"], "invalid int value: 'two'"),
    (["check", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["schedule", "--stages", "-1"], "stages=-1"),
    (["schedule", "--schedule", "zbv", "--virtual", "3"],
     "--virtual 3: schedule zbv runs exactly 2 stage(s) per rank"),
    (["schedule", "--virtual", "2"], "--virtual 2: schedule 1f1b runs exactly 1 stage(s) per rank"),
    (["schedule", "--schedule", "interleaved", "--virtual", "-1"], "--virtual -1: schedule interleaved"),
    (["schedule", "--schedule", "zigzag"], "--schedule 'zigzag': unknown schedule"),
])
def test_bad_input_is_one_line_and_exit_2(cli, args, message):
    _assert_one_line(cli(*args), message)


def _assert_one_line(out, message: str) -> None:
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_bad_input_from_the_real_command():
    _assert_one_line(brigade("check", "--model", "toy", "--stages", "4"), "only 3 blocks")


def test_check_port_in_use(cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = cli("check", "--model", "toy", "--port", str(port))
    assert out.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_factory_named(cli):
    out = cli("check", "--model", "brigade/models/toy.py:nothing")
    assert out.returncode == 2 and "has no factory 'nothing'" in out.stderr and "mlp, toy" in out.stderr


# --- every flag explains itself ---------------------------------------------------------------

def _help_words(text: str | None) -> list[str]:
    """The words of a help text besides its default: '(default: 4)' alone explains nothing."""
    import re

    rest = re.sub(r"\(default:[^)]*\)", "", (text or "").replace("%(default)s", ""))
    return re.findall(r"[A-Za-z]{2,}", rest)


def _every_action():
    """(command, flag, help) for every argument of `brigade` and of each subcommand, and each
    subcommand's own one-line help."""
    import argparse

    from brigade.cli import build_parser

    top = build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    yield "brigade", "--help", top.description
    for pseudo in subs._choices_actions:
        yield "brigade", pseudo.dest, pseudo.help
    for name, parser in [("brigade", top), *subs.choices.items()]:
        for action in parser._actions:
            if action is not subs:
                yield name, "/".join(action.option_strings) or action.dest, action.help


def test_every_flag_of_every_subcommand_has_a_help_sentence():
    from brigade.cli import build_parser

    subs = build_parser()._subparsers._group_actions[0].choices
    assert {"train", "generate", "plot", "inspect", "schedule", "check", "bench", "tune",
            "doctor"} <= set(subs)
    bare = [f"{cmd} {flag}: {text!r}" for cmd, flag, text in _every_action() if len(_help_words(text)) < 2]
    assert not bare, "flags without a help sentence:\n" + "\n".join(bare)


def test_the_top_level_help_speaks_to_users(cli):
    out = cli("--help")
    assert out.returncode == 0
    assert "brigade train" in out.stdout and "pipeline" in out.stdout
    assert "own module" not in out.stdout
