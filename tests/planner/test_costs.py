"""The planner's measured costs (brigade/planner/costs.py): timed in the run's half precision on
this machine, with memory still measured in fp32, and kept as measured when planned for here."""

from dataclasses import replace

import pytest

from brigade.models import load_model
from brigade.planner.costs import measure
from brigade.planner.devices import TABLE
from brigade.planner.scaling import scaled


def _here():
    """A stand-in for this machine's probe: measured, with a bf16 peak."""
    return replace(TABLE["h100"], name="cpu", measured=True, cores=2)


@pytest.mark.timeout(120)
def test_bf16_costs_are_timed_in_bf16_and_their_memory_in_fp32():
    spec = load_model("mlp", seed=0)
    fp32 = measure(spec, [4], ["none"], _here())
    bf16 = measure(spec, [4], ["none"], _here(), "bf16")
    assert (fp32.precision, bf16.precision) == ("", "bf16")
    assert bf16.modes["none"].held == fp32.modes["none"].held  # memory: fp32's, halved by the model
    assert all(t > 0 for block in bf16.modes["none"].times[4] for t in block[:2])
    # Planned for this machine in bf16, the bf16 times are the ones; an fp32 run's are not.
    assert scaled(bf16, _here(), "bf16") is bf16 and scaled(fp32, _here(), "") is fp32
    assert scaled(fp32, _here(), "bf16") is not fp32
