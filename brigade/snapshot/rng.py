"""Each rank's random-number generator states, saved in a snapshot as `rng_<rank>.json`."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import torch

from brigade.snapshot.format import tensor_sha256


def rng_state(devices: Sequence[torch.device] = ()) -> dict:
    """This process's random-number generator states, as JSON-able lists.

    Args:
        devices: the GPUs this process computes on (where its model lives), in stage order. Only
            their generators are saved, not every visible GPU's: a rank owns its devices only,
            and a node with fewer GPUs can resume.
    Returns:
        {"torch", "python", optional "cuda" (one state per device, in order), optional "numpy"}.
    """
    state = {"torch": torch.get_rng_state().tolist(), "python": _py_state(random.getstate())}
    gpus = [d for d in devices if d.type == "cuda"]
    if gpus:
        state["cuda"] = [torch.cuda.get_rng_state(d).tolist() for d in gpus]
    if "numpy" in sys.modules:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def _py_state(s):
    return [s[0], list(s[1]), s[2]]


def set_rng_state(state: dict, devices: Sequence[torch.device] = ()) -> None:
    """Restore what `rng_state` saved; the k-th saved GPU state goes to the k-th of `devices`.

    Matching by position, not by index, lets a rank resume on other GPU numbers; states or
    devices without a partner (another layout) are left as they are.
    """
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    gpus = [d for d in devices if d.type == "cuda"]
    for saved, device in zip(state.get("cuda", []), gpus):
        torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8), device)
    if "numpy" in state and "numpy" in sys.modules:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def torch_rng_fingerprint() -> str:
    """A hash of this process's torch CPU generator state: equal runs draw equal numbers."""
    return tensor_sha256(torch.get_rng_state())
