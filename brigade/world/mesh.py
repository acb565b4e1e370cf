"""`World`: this process's place in the parallel world, and the one DeviceMesh every part asks.

Built once per process from the run's `Degrees`, after the process group is joined
(`launcher.groups.init`): one DeviceMesh over every dimension (`degrees.DIMS`, named, size-1
dimensions included, so adding a degree changes no caller), the groups of the dimensions that
span several of the mesh's (the data-parallel one: replicate × shard) beside it, and the groups
of each. The trainer, `brigade check`, the benches and the tuner take
their groups, sub-meshes and coordinates from here; nothing else builds a mesh or computes a
rank from coordinates.

    mesh ("replicate", "shard", "pp", "cp", "tp")
      ├ "dp" = replicate × shard, one group: DDP's group, the loss's mean over replicas
      ├ shard_mesh: ("shard") or ("replicate", "shard"): what FSDP2 shards (and HSDP replicates) over
      ├ "tp": parallelize_module's mesh (tensor parallel and FSDP2 from one root: 2-D DTensors)
      ├ "pp": the pipeline's sends and receives, the gradient norm over stages
      ├ "ep": the expert groups, ep consecutive dp ranks each (made only where ep > 1)
      ├ "cp": the processes one stage's sequences are split over (`parallel.context`)
      └ "dpcp" = replicate × shard × cp, one group where cp > 1: DDP's group (cp processes hold
               the same weights), the loss's mean over replicas and parts

    data_mesh ("dreplicate", "dshard", "dpp", "dtp")   where cp > 1: the same ranks, shard × cp
      ├ ("dreplicate", "dshard"): what FSDP2 shards over under --cp (the cp processes share the
      │  shards, torchtitan's dp_shard × cp), `shard_mesh` then
      └ "dtp": tensor parallel's mesh then, so that FSDP2's 2-D DTensors have one root

    expert_mesh ("edp", "ep", "epp", "ecp", "etp")   where ep > 1: the same ranks, dp cut in two
      ├ "ep": the processes a mixture of experts' experts are split over (`parallel.experts`)
      └ "edp": the processes holding the same experts, which shard them (FSDP2) or sum their
               gradients: dp ÷ ep of them, one from each expert group

The expert mesh is a second root over the same ranks in the same order (dp = edp · ep + ep
rank, ep innermost, as `Degrees.groups("ep")` has it): an expert weight is a DTensor split over
its "ep" dimension, and FSDP2 shards it further over "edp" of the same root. Its other names
are its own ("epp", not "pp"): DTensor caches what it computed for a mesh by shape and names.

The data mesh is the main grid with cp moved beside shard (a DeviceMesh over a permuted table of
the ranks: a rank keeps its coordinates, `Degrees.coords`), so that shard × cp is one dimension.

A world of one process without a process group (`brigade check --runtime local` in the calling
process) has no mesh: it has nothing to communicate.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from brigade.errors import BrigadeError
from brigade.world.degrees import DIMS, FLATTENED, Coords, Degrees

EXPERT_DIMS = ("edp", "ep", "epp", "ecp", "etp")  # the expert mesh's (module docstring)
DATA_DIMS = ("dreplicate", "dshard", "dpp", "dtp")  # the data mesh's, where cp > 1


class World:
    """This process's place among the degrees, and the mesh and groups of the run.

    Args:
        degrees: every dimension's size; checked against the process group's world size.
        device: this process's device (stage 0's under local stages).
        devices: the devices of the pipeline ranks this process drives itself, one each (local
            stages, stage 0's first, from `launcher.groups.local_devices`); None: one pipeline
            rank, on `device`.

    Raises:
        BrigadeError: degrees that do not make this world (`Degrees.check`).
    """

    def __init__(self, degrees: Degrees, device: torch.device, devices: list[torch.device] | None = None):
        joined = dist.is_initialized()
        degrees.check(dist.get_world_size() if joined else 1)
        self.degrees, self.device = degrees, torch.device(device)
        self.devices = [torch.device(d) for d in devices] if devices else [self.device]
        self.local = devices is not None  # it drives its pipeline ranks itself (a LocalPipeline)
        self.rank = dist.get_rank() if joined else 0
        self.coords: Coords = degrees.coords(self.rank)
        self.mesh, self._flat, self.expert_mesh, self.data_mesh = None, {}, None, None
        if joined:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, degrees.shape, mesh_dim_names=DIMS)
            # Groups over several dimensions, made by every rank in one order. Not DeviceMesh's
            # `_flatten`: a flattened mesh and its root point at each other, and the groups they
            # hold outlive the process group until a garbage collection, which in a process forked
            # from this one (the launcher forks on CPU) runs their destructors without their threads.
            self._flat = {name: _groups(degrees, name) for name in FLATTENED
                          if name == "dp" or degrees.cp > 1}
            if degrees.ep > 1:  # carved out of dp: no dimension of the mesh, a root of its own
                shape = (degrees.dp // degrees.ep, degrees.ep, degrees.pp, degrees.cp, degrees.tp)
                self.expert_mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=EXPERT_DIMS)
            if degrees.cp > 1:
                self.data_mesh = _data_mesh(self.device.type, degrees)

    def group(self, dim: str):
        """The process group of this rank along `dim`: a dimension of the mesh, "dp", or "ep" and
        "edp" (where ep > 1: the expert mesh's); None in a world without a process group."""
        if self.mesh is None:
            return None
        if dim in ("ep", "edp"):
            if self.expert_mesh is None:
                raise ValueError(f"no expert groups in a world of ep {self.degrees.ep}")
            return self.expert_mesh[dim].get_group()
        if dim in FLATTENED:
            return self._flat[dim] if dim in self._flat else self._flat["dp"]  # dpcp at cp 1: dp
        return self.mesh[dim].get_group()

    @property
    def shard_mesh(self):
        """What FSDP2 shards over: ("shard"), or ("replicate", "shard") where there are replicas
        (HSDP; with --shard 1 under tensor parallel: replication only); under --cp the data
        mesh's, shard × cp."""
        mesh, (rep, shard) = (self.data_mesh, DATA_DIMS[:2]) if self.data_mesh is not None else \
            (self.mesh, ("replicate", "shard"))
        return mesh[shard] if self.degrees.replicate == 1 else mesh[rep, shard]

    @property
    def shard_group(self):
        """The group of processes one FSDP2 shard set spreads over (not its replicas): "shard", or
        under --cp the data mesh's shard × cp. What a sharded gradient norm sums over."""
        return self.data_mesh["dshard"].get_group() if self.data_mesh is not None else self.group("shard")

    @property
    def tp_mesh(self):
        """parallelize_module's mesh: the "tp" dimension of the root FSDP2 shares (the data mesh's
        under --cp)."""
        return self.data_mesh["dtp"] if self.data_mesh is not None else self.mesh["tp"]

    @property
    def cp_mesh(self):
        """The 1-D mesh of this stage's context-parallel processes (ring attention's DTensors)."""
        return self.mesh["cp"]

    def stage_group(self, device: torch.device):
        """A new group over this rank's data-parallel replicas for one local stage, bound to that
        stage's device (each device's thread issues its own stage's all-reduces).

        A group created without `device_id` inherits the default group's binding; torch refuses
        another. So `launcher.groups.init(local_stages=n)` leaves the default group unbound.

        Raises:
            BrigadeError: the default group is bound to one GPU.
        """
        ranks = self.degrees.group("dp", self.rank)
        if device.type != "cuda":
            return dist.new_group(ranks)
        bound = dist.distributed_c10d._get_default_group().bound_device_id
        if bound is not None:
            raise BrigadeError(f"the process group is bound to {bound} but this process drives several "
                               "GPUs: pass local_stages to brigade.launcher.groups.init")
        with torch.cuda.device(device):  # the communicator and its first collective on this GPU
            return dist.new_group(ranks, device_id=device)

    def tie_ranks(self) -> list[list[int]]:
        """Every pipeline line of the world: for each place off the pipeline (replica, shard, cp, tp),
        the global rank of each pipeline rank. The processes holding copies of a weight tied across
        stages are found on one line (`pipeline.stages.ties.StageTies`)."""
        return self.degrees.groups("pp")

    @property
    def stream(self) -> int:
        """The random stream this process draws from. The tp processes of one stage share one: the
        activations they hold whole must get the same dropout masks on each."""
        c = self.coords
        return self.degrees.rank(replicate=c.replicate, shard=c.shard, pp=c.pp, cp=c.cp) // self.degrees.tp

    @property
    def place(self) -> str:
        """This process's coordinates as the hang report names them: "dp1 pp0" (and "cp", "tp"
        where those are split)."""
        c, d = self.coords, self.degrees
        return f"dp{c.dp} pp{c.pp}" + (f" cp{c.cp}" if d.cp > 1 else "") + (f" tp{c.tp}" if d.tp > 1 else "")


def _data_mesh(device_type: str, degrees: Degrees):
    """The data mesh (module docstring): the ranks' grid with cp beside shard, flattened with it."""
    from torch.distributed.device_mesh import DeviceMesh

    d = degrees
    grid = torch.arange(d.size).view(d.replicate, d.shard, d.pp, d.cp, d.tp).permute(0, 1, 3, 2, 4)
    return DeviceMesh(device_type, grid.reshape(d.replicate, d.shard * d.cp, d.pp, d.tp),
                      mesh_dim_names=DATA_DIMS)


def _groups(degrees: Degrees, dim: str):
    """This rank's group along `dim`, every group of it made in `Degrees.groups`' order."""
    return dist.new_subgroups_by_enumeration(degrees.groups(dim))[0]


@contextlib.contextmanager
def fake_world(size: int):
    """A `size`-process world of which this process is rank 0 and the others are not there, and
    its 1-D mesh; None where torch.distributed is already initialized here (or cannot fake one).
    torch's fake process group: every collective returns at once, its output of the right shape,
    its contents whatever the memory held. For measuring in one process what one of several
    tensor-parallel processes does (`planner.split_costs`, the cpu probe's `measure.gloo_probe`)."""
    if not dist.is_available() or dist.is_initialized():
        yield None
        return
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:  # a torch without it: priced from tp 1's costs
        yield None
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    torch.set_flush_denormal(True)  # a fake collective's output is any memory: no slow denormals
    try:
        # A name of its own: DTensor caches what it computed for a mesh (each rank's part, by
        # its coordinate here: 0) under the mesh's shape and names, and a process forked after
        # (a test's, a benchmark's workers) that builds an unnamed mesh of this shape would read
        # rank 0's parts on every rank: FSDP2's shards of rank 1 then overlapped rank 0's.
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("fake",))
    finally:
        torch.set_flush_denormal(False)
        dist.destroy_process_group()
