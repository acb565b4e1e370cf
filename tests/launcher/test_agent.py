"""brigade.launcher.agent: how workers are started, and which failure the agent names."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from brigade.launcher import agent


def test_workers_are_forked_on_cpu_and_spawned_with_a_gpu(monkeypatch):
    assert not dist.is_initialized()
    assert agent._start_method() == ("spawn" if torch.cuda.is_available() else "fork")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert agent._start_method() == "spawn"


def test_a_process_with_its_own_group_spawns_its_workers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert agent._start_method() == "spawn"
    finally:
        dist.destroy_process_group()
    assert agent._start_method() == "fork"


_COMPILE_THEN_LAUNCH = textwrap.dedent("""
    import torch
    from brigade.launcher import agent

    def _compiled_sum(n):
        return float(torch.compile(lambda x: torch.relu(x) * 2)(torch.ones(n)).sum())

    if __name__ == "__main__":
        assert _compiled_sum(3) == 6.0  # this process compiles first, as a test worker may have
        assert agent._start_method() == "fork"  # workers that inherit what the compile left
        print(sorted(agent.launch(_compiled_sum, 2, 4).items()))  # (by rank: workers end in any order)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_that_compile_after_their_launcher_has_compiled_do_not_hang(tmp_path):
    """A forked worker waited for ever on the compile threads its parent had started (CI's
    timeout of `brigade bench --compile` run inside a test process that had compiled before)."""
    script = tmp_path / "compile_then_launch.py"
    script.write_text(_COMPILE_THEN_LAUNCH)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[(0, 8.0), (1, 8.0)]"


def _what_a_worker_sees() -> tuple:
    inherited = gc.get_freeze_count() > 0 and "torch._dynamo" in sys.modules  # agent._ready_to_fork
    return os.environ.get("BRIGADE_TEST_MARK"), torch.get_num_threads(), int(os.environ["RANK"]), inherited


@pytest.mark.timeout(120)
def test_a_worker_sees_the_launching_process_environment(monkeypatch):
    """...and, forked, starts with torch._dynamo loaded and the agent's objects frozen out of its
    garbage collector; the agent's own are unfrozen once the workers are done."""
    monkeypatch.setenv("BRIGADE_TEST_MARK", "from the caller")
    frozen = gc.get_freeze_count()
    got = agent.launch(_what_a_worker_sees, 2)
    forked = agent._start_method() == "fork"
    assert got == {0: ("from the caller", 1, 0, forked), 1: ("from the caller", 1, 1, forked)}
    assert gc.get_freeze_count() == frozen


@pytest.mark.parametrize("message", [
    "[gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:1234",
    "Read error [127.0.0.1]:5678: Connection reset by peer",
    "This is typically caused by a remote worker crashing.",
])
def test_a_broken_connection_is_recognised_as_a_symptom(message):
    assert agent._PEER_GONE.search(message)


def test_an_ordinary_error_is_not_a_symptom():
    assert not agent._PEER_GONE.search("stage 1: expected a tensor of shape (4, 8), got (4, 9)")
