"""Any pytree across a stage boundary, and side inputs, on the local engine: each checked
against the same layers run unpipelined, and bitwise across checkpoint modes (dropout on)."""

import collections
from typing import Any, Dict, Optional

import pytest
import torch
from torch import Tensor, nn

from pipeckpt import PipeckptConfigError
from pipeckpt._compat import tree_flatten
from pipeckpt.boundaries.microbatch import gather, scatter
from pipeckpt.boundaries.pytrees import Flat, flatten, unflatten
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
MODES = ["never", "except_last", "always", "offload", ["always", "never", "except_last"]]


class ToTree(nn.Module):
    """Returns a dict holding a tuple with None, an int and a string beside tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Dict[str, Any]:
        h = self.a(x)
        return {"h": (h, None), "skip": [x], "n": 3, "tag": "ok"}


class FromTree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, tree: Dict[str, Any]) -> Dict[str, Any]:
        assert tree["n"] == 3 and tree["tag"] == "ok" and tree["h"][1] is None
        h = self.drop(torch.tanh(self.b(tree["h"][0]))) * tree["n"] + tree["skip"][0]
        return {"h": (h, None), "skip": tree["skip"], "n": 3, "tag": "ok"}


class Masked(nn.Module):
    """A layer with a side input it declares by name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        h = self.drop(torch.tanh(self.lin(x)))
        return h if attention_mask is None else h * attention_mask


class NeedsMask(nn.Module):
    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return x * mask


def tree_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ToTree(), FromTree(), FromTree(), FromTree())


def masked_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Masked(), nn.Linear(8, 8), Masked(), Masked())


def pipe_of(seq: nn.Sequential, mode: Any, chunks: int = 4) -> LocalPipeline:
    return LocalPipeline(seq, plan(seq, devices=CPU, balance=[1, 1, 2], checkpoint=mode), chunks=chunks)


def grads(seq: nn.Module, *extra: Tensor) -> Dict[str, Tensor]:
    out = {k: p.grad.clone() for k, p in seq.named_parameters()}
    out.update({f"input{i}": t.grad.clone() for i, t in enumerate(extra)})
    return out


def inputs(seed: int = 2) -> Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def run_tree(mode: Any, chunks: int = 4) -> Dict[str, Tensor]:
    seq, x = tree_layers(), inputs()
    torch.manual_seed(5)
    out = pipe_of(seq, mode, chunks).forward(x)
    assert out["n"] == 3 and out["tag"] == "ok" and out["h"][1] is None
    (out["h"][0].pow(2).mean() + out["skip"][0].sum()).backward()
    return grads(seq, x)


def test_scatter_splits_batch_leaves_and_passes_the_rest():
    x, mask = torch.arange(8.0).view(4, 2), torch.ones(3, 3)
    pieces = scatter(((x, None, 7),), {"m": x[:, 0], "causal": "yes"}, 2, call="f(x)")
    assert len(pieces) == 2
    (first, none, seven), side = pieces[1][0][0], pieces[1][1]
    assert torch.equal(first, x[2:]) and none is None and seven == 7
    assert torch.equal(side["m"], x[2:, 0]) and side["causal"] == "yes"
    unsplit = scatter((x, mask), {}, 2, call="f(x)")
    assert unsplit[0][0][1] is mask and unsplit[1][0][1] is mask


def test_gather_joins_batch_leaves_and_returns_shared_ones_once():
    mask = torch.ones(3, 3)
    out = gather(
        [{"h": torch.zeros(2, 1), "m": mask, "s": "a"}, {"h": torch.ones(2, 1), "m": mask, "s": "b"}],
        call="f",
    )
    assert torch.equal(out["h"], torch.tensor([[0.0], [0.0], [1.0], [1.0]]))
    assert out["m"] is mask and out["s"] == "a"


def test_gather_refuses_a_per_microbatch_scalar():
    with pytest.raises(PipeckptConfigError, match=r"0-dim tensor.*compute the loss from"):
        gather([torch.tensor(1.0), torch.tensor(2.0)], call="f")


def test_a_side_input_of_another_batch_size_is_named():
    with pytest.raises(
        PipeckptConfigError, match=r"side input attention_mask= of f\(x\) \(size\(0\) 3, batch 4\)"
    ):
        scatter((torch.zeros(4, 2),), {"attention_mask": torch.zeros(3, 2)}, 2, call="f(x)")


def test_pytree_stage_outputs_match_the_unpipelined_layers():
    seq, x = tree_layers(), inputs()
    for m in seq.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    out = seq(x)
    (out["h"][0].pow(2).mean() + out["skip"][0].sum()).backward()
    expected = grads(seq, x)
    seq, x = tree_layers(), inputs()
    for m in seq.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    out = pipe_of(seq, "always").forward(x)
    (out["h"][0].pow(2).mean() + out["skip"][0].sum()).backward()
    got = grads(seq, x)
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES[1:], ids=str)
def test_pytree_gradients_bitwise_equal_never_with_dropout(mode):
    expected, got = run_tree("never"), run_tree(mode)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def run_masked(mode: Any) -> Dict[str, Tensor]:
    seq, x = masked_layers(), inputs()
    mask = (torch.arange(8)[:, None] % 3 != 0).float().expand(8, 8).clone().requires_grad_()
    torch.manual_seed(5)
    pipe_of(seq, mode).forward(x, attention_mask=mask).pow(2).mean().backward()
    return grads(seq, x, mask)


def test_side_inputs_reach_every_layer_that_declares_them():
    seq, x = masked_layers(), inputs()
    mask = (torch.arange(8)[:, None] % 3 != 0).float().expand(8, 8).clone().requires_grad_()
    for m in seq.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    h = x
    for layer in seq:
        h = layer(h, attention_mask=mask) if isinstance(layer, Masked) else layer(h)
    h.pow(2).mean().backward()
    expected = grads(seq, x, mask)
    seq, x = masked_layers(), inputs()
    mask = mask.detach().clone().requires_grad_()
    for m in seq.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    pipe_of(seq, "always").forward(x, attention_mask=mask).pow(2).mean().backward()
    got = grads(seq, x, mask)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES[1:], ids=str)
def test_side_input_gradients_bitwise_equal_never_with_dropout(mode):
    expected, got = run_masked("never"), run_masked(mode)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_two_positional_arguments_name_the_call_and_first_layer():
    pipe = pipe_of(masked_layers(), "never")
    with pytest.raises(
        PipeckptConfigError, match=r"layers\(arg0, arg1\) \(2 positional arguments\).*layers\.0: forward\(x"
    ):
        pipe.forward(inputs(), inputs())


def test_a_side_input_no_layer_declares_is_named():
    pipe = pipe_of(masked_layers(), "never")
    with pytest.raises(PipeckptConfigError, match=r"side input mask= of layers\(x, mask=\.\.\.\): no layer"):
        pipe.forward(inputs(), mask=torch.ones(8, 8))


def test_a_missing_side_input_names_the_layer_signature():
    seq = nn.Sequential(nn.Linear(8, 8), NeedsMask())
    pipe = LocalPipeline(seq, plan(seq, devices=CPU, balance=[1, 1]), chunks=2, name="model.blocks")
    with pytest.raises(
        PipeckptConfigError,
        match=r"model\.blocks\(x\) without mask=: layer model\.blocks\.1: forward\(x: torch.Tensor, mask",
    ):
        pipe.forward((inputs(),))


# -- the boundary's own walk (boundary.flatten), and values kept flat between stages ---------

Pair = collections.namedtuple("Pair", "a b")


def nested() -> Any:
    t = torch.arange(4.0).view(2, 2)
    return {
        "t": (t, None, 3, "s"),
        "l": [t * 2, {"x": 1.5}],
        "nt": Pair(t * 3, "b"),
        "od": collections.OrderedDict(k=t * 4),
        "size": torch.Size([2, 2]),
    }


def test_flatten_yields_the_tensor_leaves_in_torch_pytree_order():
    tree = nested()
    tensors, _ = flatten(tree)
    expected = [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, Tensor)]
    assert len(tensors) == len(expected) == 4
    assert all(a is b for a, b in zip(tensors, expected))


def test_unflatten_rebuilds_every_container_type_and_keeps_non_tensor_leaves_as_they_were():
    tree = nested()
    tensors, spec = flatten(tree)
    rebuilt = unflatten(spec, [t + 1 for t in tensors])
    assert type(rebuilt["nt"]) is Pair and type(rebuilt["od"]) is collections.OrderedDict
    assert rebuilt["t"][1:] == (None, 3, "s") and rebuilt["l"][1] == {"x": 1.5}
    assert rebuilt["nt"].b is tree["nt"].b and rebuilt["size"] == torch.Size([2, 2])
    assert torch.equal(rebuilt["od"]["k"], tree["od"]["k"] + 1)
    assert list(rebuilt) == list(tree)


def test_a_flat_value_is_a_torch_pytree_node_of_its_tensors():
    tensors, spec = flatten({"h": torch.ones(2), "n": 3})
    leaves, _ = tree_flatten([Flat(tensors, spec)])
    assert len(leaves) == 1 and leaves[0] is tensors[0]


def test_scatter_makes_as_many_pieces_as_torch_chunk():
    for batch, chunks in [(5, 4), (10, 4), (7, 3), (2, 4)]:
        x = torch.arange(float(batch))
        pieces = scatter(({"x": x},), {}, chunks, call="f(x)")
        assert [p[0][0]["x"].tolist() for p in pieces] == [c.tolist() for c in x.chunk(chunks)]


def test_scatter_moves_every_tensor_to_the_device_it_is_given():
    pieces = scatter(
        ({"x": torch.ones(4, 2)},), {"m": torch.ones(4)}, 2, call="f(x)", device=torch.device("meta")
    )
    assert all(p[0][0]["x"].is_meta and p[1]["m"].is_meta for p in pieces)


class Checks(nn.Module):
    """A layer that asserts it is handed the user's dict (never the engine's flat form)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, tree: Dict[str, Any]) -> Dict[str, Any]:
        assert type(tree) is dict and tree["n"] == 3, type(tree)
        return {"h": torch.tanh(self.lin(tree["h"])), "n": 3}


@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_layers_are_handed_the_users_values_and_so_is_the_caller(mode):
    torch.manual_seed(0)
    seq = nn.Sequential(*[Checks() for _ in range(4)])
    x = inputs()
    expected = seq({"h": x, "n": 3})["h"]
    pipe = LocalPipeline(seq, plan(seq, devices=CPU, balance=[1, 1, 2], checkpoint=mode), chunks=4)
    out = pipe.forward({"h": x, "n": 3})
    assert type(out) is dict and out["n"] == 3
    torch.testing.assert_close(out["h"], expected, rtol=0, atol=1e-6)
    with torch.no_grad():  # no autograd Function: stages run the layers directly
        out = pipe.forward({"h": x, "n": 3})
    assert type(out) is dict
    torch.testing.assert_close(out["h"], expected, rtol=0, atol=1e-6)


def test_a_named_tuple_boundary_keeps_its_type_and_gradients():
    class ToPair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Any) -> Pair:
            h = x.a if isinstance(x, Pair) else x
            return Pair(torch.tanh(self.lin(h)), "tag")

    def run(pipelined: bool) -> Dict[str, Tensor]:
        torch.manual_seed(0)
        seq, x = nn.Sequential(ToPair(), ToPair(), ToPair(), ToPair()), inputs()
        out = pipe_of(seq, "always").forward(x) if pipelined else seq(x)
        assert type(out) is Pair and out.b == "tag"
        out.a.pow(2).mean().backward()
        return grads(seq, x)

    expected, got = run(False), run(True)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


class TwoSides(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor, scale: Optional[Tensor] = None, shift: Optional[Tensor] = None) -> Tensor:
        return torch.tanh(self.lin(x)) * scale + shift


class OneSide(Masked):
    def forward(self, x: Tensor, scale: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        return torch.tanh(self.lin(x)) * scale


def test_each_layer_gets_exactly_the_side_inputs_it_declares():
    def run(pipelined: bool) -> Dict[str, Tensor]:
        torch.manual_seed(0)
        seq, x = nn.Sequential(TwoSides(), OneSide(), nn.Linear(8, 8), TwoSides()), inputs()
        scale, shift = inputs(3), inputs(4)
        if pipelined:
            out = pipe_of(seq, "always").forward(x, scale=scale, shift=shift)
        else:
            out = seq[0](x, scale=scale, shift=shift)
            out = seq[3](seq[2](seq[1](out, scale=scale)), scale=scale, shift=shift)
        out.pow(2).mean().backward()
        return grads(seq, x, scale, shift)

    expected, got = run(False), run(True)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


def test_ordered_backward_edges_on_a_pytree_boundary_leave_gradients_bitwise_equal():
    def run(ordered: bool) -> Dict[str, Tensor]:
        seq, x = tree_layers(), inputs()
        torch.manual_seed(5)
        pipe = LocalPipeline(
            seq,
            plan(seq, devices=CPU, balance=[1, 1, 2], checkpoint="always"),
            chunks=4,
            ordered_backward=ordered,
        )
        out = pipe.forward(x)
        (out["h"][0].pow(2).mean() + out["skip"][0].sum()).backward()
        return grads(seq, x)

    expected, got = run(False), run(True)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
