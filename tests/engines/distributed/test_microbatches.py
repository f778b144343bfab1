"""A batch's micro-batches keep the user's structure: a tuple or list of tensors comes back as one
(rebuilt directly), anything else through the pytree, non-tensor leaves and nesting included."""

from typing import Any

import torch

from pipeckpt.engines.distributed.replay import Microbatches

X = torch.arange(8.0).reshape(4, 2)
Y = torch.arange(4)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    return bool(a == b)


def test_a_tuple_or_list_of_tensors_comes_back_as_a_tuple_or_list_of_its_chunks():
    for batch in ((X, Y), [X, Y]):
        got = Microbatches(batch, 2)[1]
        assert _same(got, type(batch)([X[2:], Y[2:]]))


def test_nesting_non_tensor_leaves_and_dicts_keep_their_structure():
    cases = [
        ((X, (Y,)), (X[:2], (Y[:2],))),
        ((X, 3), (X[:2], 3)),
        ({"x": X, "n": "a"}, {"x": X[:2], "n": "a"}),
    ]
    for batch, first in cases:
        assert _same(Microbatches(batch, 2)[0], first), batch


def test_rebuild_puts_the_given_tensors_where_the_batch_had_its_own():
    other = torch.zeros(4, 2), torch.ones(4, dtype=torch.long)
    assert _same(Microbatches((X, Y), 2).rebuild(other), other)
    assert _same(Microbatches([X, 7, Y], 2).rebuild(other), [other[0], 7, other[1]])
