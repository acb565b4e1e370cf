import collections

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.pipeline.stages import structure
from brigade.pipeline.stages.structure import Spec, StructureError, flatten, unflatten
from brigade.pipeline.transport import wire

Pair = collections.namedtuple("Pair", "hidden extra")


def nested():
    h, k, ids = torch.randn(2, 3), torch.randn(2, 4), torch.arange(6).reshape(2, 3)
    return {"x": h, "cache": [k, (ids, 3, None)], "flag": True, "scale": 0.5, "name": "mlp",
            "pair": Pair(h, -7)}


def test_flatten_then_unflatten_rebuilds_the_same_structure():
    obj = nested()
    tensors, spec = flatten(obj)
    assert len(tensors) == spec.n_tensors == 4
    assert tensors[0] is obj["x"] and tensors[2] is obj["cache"][1][0]
    back = unflatten(tensors, spec)
    assert back.keys() == obj.keys() and back["cache"][1][1:] == (3, None)
    assert type(back["cache"][1]) is tuple and type(back["cache"]) is list
    assert isinstance(back["pair"], Pair) and back["pair"].hidden is obj["x"]
    assert back["flag"] is True and back["scale"] == 0.5 and back["name"] == "mlp"


def test_a_plain_tensor_is_one_slot():
    t = torch.ones(3)
    tensors, spec = flatten(t)
    assert tensors == [t] and spec == structure.TENSOR and unflatten([t], spec) is t


def test_spec_is_hashable_and_ignores_tensor_values_but_not_values():
    a, b = flatten(nested())[1], flatten(nested())[1]
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert flatten((torch.ones(1), 1))[1] != flatten((torch.ones(1), True))[1]  # bool is not int
    assert flatten((torch.ones(1), 1))[1] != flatten((torch.ones(1), 1.0))[1]
    assert flatten({"a": 1, "b": 2})[1] != flatten({"b": 2, "a": 1})[1]  # order is kept
    assert flatten(float("nan"))[1] == flatten(float("nan"))[1]


def _gen():
    yield 1


@pytest.mark.parametrize("obj,path,type_name", [
    ({"cache": [torch.ones(1), object()]}, r"output\['cache'\]\[1\]", "builtins.object"),
    ((torch.ones(1), _gen()), r"output\[1\]", "generator"),
    ({"s": {1, 2}}, r"output\['s'\]", "set"),
    (Pair(torch.ones(1), b"x"), r"output\.extra", "bytes"),
])
def test_unsendable_leaves_are_named_by_path_and_type(obj, path, type_name):
    with pytest.raises(StructureError, match=f"^{path} is a .*{type_name}.*cannot be sent") as err:
        flatten(obj)
    assert isinstance(err.value, BrigadeError) and "\n" not in str(err.value)


def test_dict_keys_must_be_str():
    with pytest.raises(StructureError, match=r"output\['a'\] has the key 3 \(int\): dict keys must be str"):
        flatten({"a": {3: torch.ones(1)}})


def test_the_root_name_is_the_callers():
    with pytest.raises(StructureError, match=r"^block 2's output\[0\] is"):
        flatten([object()], root="block 2's output")


def test_unflatten_checks_the_count():
    tensors, spec = flatten(nested())
    with pytest.raises(StructureError, match="got 3 tensors for a structure that holds 4"):
        unflatten(tensors[:3], spec)


def test_a_namedtuple_from_elsewhere_is_imported_and_a_local_one_named():
    spec = wire.decode(wire.encode(flatten(Pair(torch.ones(1), 2))[1]))
    assert spec.type_name == f"{__name__}:Pair"
    missing = Spec("namedtuple", (structure.TENSOR,), ("a",), type_name="no.such.module:Thing")
    with pytest.raises(StructureError, match="namedtuple no.such.module:Thing cannot be imported"):
        unflatten([torch.ones(1)], missing)


def test_first_difference_names_the_path():
    a = flatten({"x": torch.ones(1), "c": (torch.ones(1), 3)})[1]
    b = flatten({"x": torch.ones(1), "c": (torch.ones(1), 4)})[1]
    assert structure.first_difference(a, a) is None
    assert structure.first_difference(a, b) == "output['c'][1]"
    assert structure.first_difference(a, flatten(torch.ones(1))[1]) == "output"


def test_describe_is_short():
    text = structure.describe((torch.zeros(4, 8), {"m": torch.zeros(4, dtype=torch.bool)}, 3, object()))
    assert text == "tuple(Tensor(4, 8) float32, dict(m: Tensor(4) bool), 3, object)"
