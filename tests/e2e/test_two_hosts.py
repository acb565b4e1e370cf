"""Two hosts on one machine: network namespaces joined by a veth pair, as two real nodes would be.

Each host has an address that exists only inside its namespace, and both share this machine's
hostname, which resolves to neither: the situation where a plain c10d rendezvous times out. The
snapshot folder is shared (one file system), as on a cluster with NFS. Needs root for `ip netns`;
skipped, with the reason, where that is not allowed.
"""

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY, final_hash, losses, train

# One group under pytest-xdist: the namespaces and the two hosts' processes fill both cores.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("two-hosts"), pytest.mark.full]
SUBNET = "10.213.77"  # only ever inside the two namespaces this file makes
RUN = ["--max-steps", "30", "--snapshot-every", "10", "--pp", "2", "--microbatches", "2",
       "--sample-tokens", "0"]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


class Hosts:
    """Two namespaces, `host 0` at SUBNET.1 and `host 1` at SUBNET.2, joined by a veth pair."""

    def __init__(self, logs: Path):
        tag = uuid.uuid4().hex[:6]
        self.logs, self.started = logs, 0
        self.names = [f"brigade-{tag}-0", f"brigade-{tag}-1"]
        self.addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.links = [f"bv{tag}a", f"bv{tag}b"]

    def create(self) -> str:
        """'' on success, else why the namespaces cannot be made here."""
        if os.geteuid() != 0:
            return "needs root to create network namespaces (ip netns)"
        if shutil.which("ip") is None:
            return "needs iproute2's `ip` to create network namespaces"
        steps = [["netns", "add", self.names[0]], ["netns", "add", self.names[1]],
                 ["link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]]]
        for k in (0, 1):
            steps += [["link", "set", self.links[k], "netns", self.names[k]],
                      ["-n", self.names[k], "addr", "add", f"{self.addrs[k]}/24", "dev", self.links[k]],
                      ["-n", self.names[k], "link", "set", self.links[k], "up"],
                      ["-n", self.names[k], "link", "set", "lo", "up"]]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                self.destroy()
                return (f"cannot create network namespaces here: `ip {' '.join(step)}`: "
                        f"{result.stderr.strip()}")
        return ""

    def start(self, k: int, *args, before: str = "", module: str = "brigade",
              env: dict | None = None) -> subprocess.Popen:
        """`python -m MODULE ARGS` on host k (after `before`, a shell command in the same namespaces).

        Output goes to files, not pipes: a test waits for one host at a time, and a host whose
        unread pipe filled up would block in a write, never reach torchrun's exit barrier, and
        keep the other host waiting there (up to 300 s) after training had finished on both.
        """
        cmd = " ".join([sys.executable, "-m", module, *map(str, args)])
        self.started += 1
        logs = (self.logs / f"{self.started}-host{k}.out", self.logs / f"{self.started}-host{k}.err")
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            proc = subprocess.Popen(["ip", "netns", "exec", self.names[k], "sh", "-c",
                                     f"{before} {'&&' if before else ''} exec {cmd}"],
                                    stdout=out, stderr=err, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        proc.logs = logs  # type: ignore[attr-defined]
        return proc

    def processes(self) -> str:
        """What still runs in each namespace (pid, state, kernel wait channel, command)."""
        lines = []
        for k in (0, 1):
            for pid in _ip("netns", "pids", self.names[k]).stdout.split():
                ps = subprocess.run(["ps", "-o", "pid=,stat=,wchan:24=,args=", "-p", pid],
                                    capture_output=True, text=True).stdout.strip()
                lines.append(f"host {k}: {ps[:200]}")
        return "\n".join(lines) or "nothing runs in either namespace"

    def kill_all(self, k: int) -> None:
        """The whole host goes down: every process in its namespace gets SIGKILL."""
        pids = _ip("netns", "pids", self.names[k]).stdout.split()
        if pids:
            subprocess.run(["kill", "-9", *pids], capture_output=True)

    def destroy(self) -> None:
        for k in (0, 1):
            self.kill_all(k)
            _ip("netns", "del", self.names[k])  # takes its end of the veth pair with it


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def hosts(tmp_path_factory):
    h = Hosts(tmp_path_factory.mktemp("host-logs"))
    why = h.create()
    if why:
        pytest.skip(why)
    yield h
    h.destroy()


@pytest.fixture(autouse=True)
def _nothing_left_on_the_hosts(hosts):
    """Each test starts on empty hosts: a test that failed or timed out leaves its agents running
    in the namespaces, where they would hold the endpoint's port (every test here uses the same
    one) or join the next test's rendezvous."""
    yield
    for k in (0, 1):
        hosts.kill_all(k)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_ip("netns", "pids", n).stdout.split() for n in hosts.names):
        time.sleep(0.1)


def _endpoint(hosts) -> str:
    return f"{hosts.addrs[0]}:{29400 + os.getpid() % 500}"


def _output(node: subprocess.Popen) -> tuple[str, str]:
    return tuple(Path(f).read_text() for f in node.logs)


def _finish_all(hosts: Hosts, nodes: dict[int, subprocess.Popen], timeout: float = 200,
                codes: tuple[int, ...] = (0,)) -> dict[int, tuple[str, str]]:
    """Wait for every host's command together; {host: (stdout, stderr)}.

    A host that exits with a code outside `codes` fails the test at once, by name. Waiting on
    host 0 alone would instead report a hang there: torchrun's agent on the node that hosts the
    rendezvous store waits up to 300 s in its exit barrier for an agent that already failed
    (torch.distributed.elastic's `_exit_barrier`), and shows nothing about why.
    """
    deadline = time.monotonic() + timeout
    while any(node.poll() is None for node in nodes.values()):
        for k, node in nodes.items():
            if node.poll() is not None and node.returncode not in codes:
                out, err = _output(node)
                raise AssertionError(f"host {k} exited {node.returncode} while the other ran on:\n"
                                     f"{hosts.processes()}\nstdout: {out[-1500:]}\nstderr: {err[-2500:]}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"host {k} stdout: {out[-1000:]}\nhost {k} stderr: {err[-1500:]}"
                               for k, (out, err) in ((k, _output(n)) for k, n in nodes.items()))
            raise AssertionError(f"not finished in {timeout:.0f} s; still running:\n{hosts.processes()}\n"
                                 + tails)
        time.sleep(0.2)
    return {k: _output(node) for k, node in nodes.items()}


def test_doctor_on_two_hosts(hosts, tmp_path):
    flags = ["doctor", "--nnodes", "2", "--rdzv-endpoint", _endpoint(hosts), "--out", tmp_path / "runs"]
    node0 = hosts.start(0, *flags, "--node-rank", "0")
    time.sleep(1)
    node1 = hosts.start(1, *flags, "--node-rank", "1")
    for k, (out, _) in _finish_all(hosts, {0: node0, 1: node1}, 120).items():
        assert f"PASS  address         advertises {hosts.addrs[k]} on {hosts.links[k]}" in out
        assert "the hostname resolves to" in out  # the namespaces' addresses are not the hostname's
        for check in ("all-reduce", "point-to-point", "snapshot folder", "clock skew"):
            assert f"PASS  {check}" in out
        assert "shared by every node" in out
    assert not (tmp_path / "runs").exists()  # the doctor leaves nothing behind


def test_doctor_fails_a_folder_that_is_not_shared(hosts, tmp_path):
    out_dir = tmp_path / "runs"
    out_dir.mkdir()
    flags = ["doctor", "--nnodes", "2", "--rdzv-endpoint", _endpoint(hosts), "--out", out_dir]
    node0 = hosts.start(0, *flags, "--node-rank", "0")
    time.sleep(1)
    # Host 1 sees its own empty file system at the same path, as a node without the shared mount.
    node1 = hosts.start(1, *flags, "--node-rank", "1", before=f"mount -t tmpfs tmpfs {out_dir}")
    for out, _ in _finish_all(hosts, {0: node0, 1: node1}, 120, codes=(1,)).values():  # both exit 1
        assert "FAIL  snapshot folder" in out and "it is not the same folder everywhere" in out
        assert "fix: mount one shared file system" in out


def test_doctor_names_an_endpoint_that_does_not_answer(hosts, tmp_path):
    node1 = hosts.start(1, "doctor", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                        _endpoint(hosts), "--out", tmp_path)
    out, _ = _finish_all(hosts, {1: node1}, 60, codes=(1,))[1]
    assert node1.returncode == 1
    assert f"FAIL  endpoint        nothing answers at {_endpoint(hosts)}" in out
    assert "fix: start node 0 first" in out and "group checks skipped" in out


def test_under_torchrun_with_the_flags_such_hosts_need(hosts, tmp_path):
    """torchrun's own multi-node flags; on these hosts it needs what brigade otherwise does itself.

    One restart, as such jobs run: once in many runs (CI, 2026-11-30) host 1's worker died of
    SIGABRT ("terminate called without an active exception", a C++ thread torn down while
    joinable) 3 s after starting, and the agent restarts exactly that. A fault that recurs still
    fails the second attempt.
    """
    out = tmp_path / "torchrun"
    nodes = []
    for k in (0, 1):
        conf = ["--rdzv-conf", "is_host=1"] if k == 0 else []
        nodes.append(hosts.start(k, "--nnodes", "2", "--node-rank", k, "--nproc-per-node", "1",
                           "--max-restarts", "1",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", _endpoint(hosts),
                           "--local-addr", hosts.addrs[k], *conf, "-m", "brigade", "train",
                           "--out", out, *TINY, "--pp", "2", "--max-steps", "4", "--sample-tokens", "0",
                           module="torch.distributed.run", env={"GLOO_SOCKET_IFNAME": hosts.links[k]}))
        time.sleep(1)
    _finish_all(hosts, dict(enumerate(nodes)), 120)  # both exit 0, or the one that did not is named
    assert sorted(losses(out)) == [1, 2, 3, 4]


def test_dp_pp_across_two_hosts_survives_losing_one(hosts, tmp_path):
    reference = tmp_path / "one-host"
    result = train(reference, *RUN, "--nproc", "4")  # dp 2 × pp 2 on this machine
    assert result.returncode == 0, result.stderr

    out = tmp_path / "two-hosts"
    flags = ["train", "--out", out, *TINY, *RUN, "--nproc", "2", "--nnodes", "2",
             "--rdzv-endpoint", _endpoint(hosts), "--max-restarts", "2"]
    node0 = hosts.start(0, *flags, "--node-rank", "0")
    time.sleep(1)
    hosts.start(1, *flags, "--node-rank", "1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_steps(out)) < 14:  # past the snapshot at step 10
        time.sleep(0.2)
    assert len(_steps(out)) >= 14, "the two hosts did not train"
    hosts.kill_all(1)  # host 1 goes down mid-run, agent and workers
    time.sleep(1)
    node1 = hosts.start(1, *flags, "--node-rank", "1")  # and comes back
    (out0, _), (out1, _) = _finish_all(hosts, {0: node0, 1: node1}).values()
    assert f"brigade: node 0 of 2 advertises {hosts.addrs[0]} on {hosts.links[0]}" in out0
    assert f"brigade: node 1 of 2 advertises {hosts.addrs[1]} on {hosts.links[1]}" in out1
    assert re.search(r"brigade: rank \d died .* restarting 1/2 from snapshot step (10|20)", out0), out0
    assert final_hash(out) == final_hash(reference)
    assert losses(out) == losses(reference)


def _steps(out: Path) -> dict:
    try:
        return losses(out)
    except (OSError, ValueError, KeyError):
        return {}


# --- elastic: --nnodes 1:2, dp 2 × pp 2 across the hosts; host 1 lost for good, or back -----------

ELASTIC_RUN = ["--max-steps", "200", "--snapshot-every", "10", "--eval-every", "1000", "--pp", "2",
               "--microbatches", "2", "--sample-tokens", "0", "--batch-size", "16"]


def _elastic_flags(hosts, out: Path) -> list:
    return ["train", "--out", out, *TINY, *ELASTIC_RUN, "--nproc", "2", "--nnodes", "1:2",
            "--rdzv-endpoint", _endpoint(hosts), "--max-restarts", "2", "--rdzv-last-call", "3",
            "--rdzv-timeout", "90"]


def _lose_host_1(hosts, out: Path) -> tuple[subprocess.Popen, float]:
    """dp 2 × pp 2 across both hosts past a complete snapshot, then host 1 goes down; host 0 resumes
    alone."""
    from tests.e2e.test_elastic import _layouts, _steps_after, _wait_for, _written_after

    node0 = hosts.start(0, *_elastic_flags(hosts, out), "--node-rank", "0")
    time.sleep(1)
    hosts.start(1, *_elastic_flags(hosts, out), "--node-rank", "1")
    _wait_for(out, lambda rows: _layouts(rows) and _layouts(rows)[-1]["n_nodes"] == 2
              and len(_steps_after(rows, _layouts(rows)[-1])) >= 12
              and _written_after(rows, _layouts(rows)[-1]), seconds=240)
    hosts.kill_all(1)  # agent and workers, never to return
    killed = time.time()
    rows = _wait_for(out, lambda rows: _layouts(rows)[-1].get("change") == "lost"
                     and _steps_after(rows, _layouts(rows)[-1]), seconds=240)
    first = _steps_after(rows, _layouts(rows)[-1])[0]
    print(f"\nhost lost → next step: {first['time'] - killed:.1f} s")
    lost = _layouts(rows)[-1]
    assert (lost["n_nodes"], lost["dp"], lost["pp"], lost["grad_accum"]) == (1, 1, 2, 2)
    return node0, first["time"] - killed


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def elastic_reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("elastic-hosts") / "one-host"
    result = train(out, *ELASTIC_RUN, "--nproc", "4", timeout=600)  # dp 2 × pp 2 on this machine
    assert result.returncode == 0, result.stderr[-2000:]
    return losses(out)


@pytest.mark.timeout(900)
def test_elastic_host_lost_then_back_and_the_job_grows_back(hosts, tmp_path, elastic_reference):
    """One run takes both changes: host 1 lost (host 0 goes on alone as dp 1 × pp 2), then back with
    the same command (dp 2 × pp 2 again); every step's loss is the uninterrupted run's. A node lost
    for good that the job finishes without is tests/e2e/test_elastic.py's (loopback)."""
    from tests.e2e.test_elastic import _layouts, _same_losses, _steps_after, _wait_for

    out = tmp_path / "grows"
    node0, _ = _lose_host_1(hosts, out)
    back = time.time()
    node1 = hosts.start(1, *_elastic_flags(hosts, out), "--node-rank", "1")  # the same command
    rows = _wait_for(out, lambda rows: _layouts(rows)[-1].get("change") == "joined"
                     and _steps_after(rows, _layouts(rows)[-1]), seconds=240)
    print(f"host back → first step with it: {_steps_after(rows, _layouts(rows)[-1])[0]['time'] - back:.1f} s")
    joined = _layouts(rows)[-1]
    assert (joined["n_nodes"], joined["dp"], joined["pp"], joined["grad_accum"]) == (2, 2, 2, 1)
    out0, _ = _finish_all(hosts, {0: node0, 1: node1}, 600)[0]
    assert re.search(r"brigade: node 1 lost at step \d+ — continuing on 1 node as dp 1 × pp 2 with gradient "
                     r"accumulation 2 \(global batch 16 unchanged\) from snapshot step \d+0", out0), out0
    assert "brigade: node 1 joined at step" in out0 and "continuing on 2 nodes as dp 2 × pp 2" in out0
    _same_losses(out, elastic_reference)
