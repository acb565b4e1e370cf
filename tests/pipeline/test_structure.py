import collections

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.pipeline import structure
from brigade.pipeline.structure import Spec, StructureError, flatten, unflatten

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


@pytest.mark.parametrize("obj", [nested(), torch.zeros(1), (), {"a": []}, ("é€😀", -(2**63), 2**63 - 1),
                                 [1.5e-300, float("inf"), None]])
def test_encode_decode_round_trip(obj):
    spec = flatten(obj)[1]
    codes = structure.encode(spec)
    assert all(isinstance(c, int) and -(2**63) <= c < 2**63 for c in codes)
    torch.tensor(codes, dtype=torch.int64)  # a transport sends it as one int64 tensor
    assert structure.decode(codes) == spec
    assert structure.decode(torch.tensor(codes).tolist()) == spec


def test_decode_refuses_damaged_or_foreign_descriptions():
    codes = structure.encode(flatten(nested())[1])
    with pytest.raises(StructureError, match="version"):
        structure.decode([99, *codes[1:]])
    with pytest.raises(StructureError, match="damaged"):
        structure.decode(codes[:-3])
    with pytest.raises(StructureError, match="damaged"):
        structure.decode([*codes, 0])


def test_encode_refuses_an_int_beyond_64_bits():
    with pytest.raises(StructureError, match="does not fit in 64 bits"):
        structure.encode(flatten([2**70])[1])


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
    spec = structure.decode(structure.encode(flatten(Pair(torch.ones(1), 2))[1]))
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


def test_gradients_flow_back_through_a_structure():
    """What a boundary does: receive, require grads, run, send input_grads back, backward."""
    w = torch.randn(3, requires_grad=True)
    ids = torch.tensor([[0, 2]])
    sent = {"h": torch.randn(1, 3) * w, "ids": ids, "n": 2, "unused": torch.randn(1, 3) * w}
    received = structure.as_inputs(sent)
    assert received["h"].requires_grad and received["h"].is_leaf and not received["ids"].requires_grad
    (received["h"] * received["ids"].sum()).sum().backward()
    grads = structure.input_grads(received)
    assert grads["ids"] is None and grads["unused"] is None and grads["n"] == 2
    outs, gs = structure.backward_pairs(sent, grads)
    assert len(outs) == 1 and outs[0] is sent["h"]
    torch.autograd.backward(outs, gs)
    assert torch.allclose(w.grad, (2 * sent["h"].detach() / w.detach()).sum(0))


def test_encoded_grads_travel_as_a_flat_list():
    sent = (torch.ones(2, requires_grad=True) * 2, torch.arange(2))
    outs, spec = flatten(sent)
    flat = structure.grad_leaves((torch.ones(2), None), spec)
    assert len(flat) == 2 and flat[1] is None
    kept, grads = structure.select_pairs(outs, flat)
    assert kept == [sent[0]] and torch.equal(grads[0], torch.ones(2))


def test_nothing_to_send_back_is_an_empty_pair():
    assert structure.backward_pairs((torch.ones(2), 3), (None, 3)) == ([], [])


@pytest.mark.parametrize("grads,message", [
    ((torch.ones(2),), r"grad is tuple\(Tensor\(2\) float32\), expected a tuple of 2"),
    ((torch.ones(2), "x"), r"grad\[1\] is a str: expected a gradient tensor or None"),
    ((torch.ones(3), None), r"gradient of output tensor 0 has shape \(3,\), expected \(2,\)"),
])
def test_mismatched_gradients_are_refused(grads, message):
    sent = (torch.ones(2, requires_grad=True) * 2, torch.ones(2, requires_grad=True) * 3)
    with pytest.raises(StructureError, match=message):
        structure.backward_pairs(sent, grads)


def test_select_pairs_checks_the_count():
    with pytest.raises(StructureError, match="got 1 gradients for 2 output tensors"):
        structure.select_pairs([torch.ones(1), torch.ones(1)], [None])
