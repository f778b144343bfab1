"""Every private name of torch and torchgpipe that pipeckpt reaches (pipeckpt/_compat/); Lightning's
in tests/test_compat_lightning.py, torch.distributed's pipelining and FSDP2 in
tests/test_compat_distributed.py, transformers' in tests/test_compat_transformers.py.

One test per entry, asserting the behaviour pipeckpt relies on: an upgrade that removes or
changes one of them fails here, by name.
"""

import collections
import inspect
import threading

import pytest
import torch
from torch import nn

from pipeckpt import _compat


def test_every_name_in_all_exists():
    missing = [name for name in _compat.__all__ if not hasattr(_compat, name)]
    assert missing == []


def test_dispatch_modes_can_be_read_pushed_and_popped_on_another_thread():
    class Counting(_compat.TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting() as mode:
        seen = list(_compat.dispatch_mode_stack())

        def other_thread() -> None:
            assert list(_compat.dispatch_mode_stack()) == []  # modes are thread-local
            _compat.push_dispatch_mode(mode)
            try:
                torch.ones(2) + 1
            finally:
                _compat.pop_dispatch_mode()

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == [mode]
    assert Counting.calls >= 1


def test_pytree_flattens_and_rebuilds_nested_structures():
    tree = {"a": (torch.ones(1), None), "b": [2, "s"]}
    leaves, spec = _compat.tree_flatten(tree)
    assert isinstance(spec, _compat.TreeSpec)
    assert len(leaves) == 4
    rebuilt = _compat.tree_unflatten(leaves, spec)
    assert rebuilt["b"] == [2, "s"] and torch.equal(rebuilt["a"][0], torch.ones(1))
    assert _compat.tree_map(lambda x: x * 2 if isinstance(x, int) else x, [3])[0] == 6


def test_tree_is_leaf_tells_leaves_from_pytree_nodes():
    Pair = collections.namedtuple("Pair", "a b")
    assert _compat.tree_is_leaf(3) and _compat.tree_is_leaf("s") and _compat.tree_is_leaf(torch.ones(1))
    assert not _compat.tree_is_leaf(Pair(1, 2))
    assert not _compat.tree_is_leaf(collections.OrderedDict(a=1))


def test_a_registered_pytree_node_is_walked_by_tree_flatten():
    class Box:
        def __init__(self, items: list) -> None:
            self.items = items

    _compat.register_pytree_node(Box, lambda b: (b.items, None), lambda items, _: Box(list(items)))
    leaves, spec = _compat.tree_flatten({"b": Box([torch.ones(1), 2])})
    assert len(leaves) == 2 and torch.equal(leaves[0], torch.ones(1)) and leaves[1] == 2
    assert _compat.tree_unflatten(leaves, spec)["b"].items[1] == 2


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.SyncBatchNorm(2)])
def test_batch_norm_base_covers_every_batch_norm(norm):
    assert isinstance(norm, _compat.BatchNormBase)


def test_default_store_is_callable_without_arguments():
    assert inspect.signature(_compat.default_store).parameters == {}


def test_apply_to_tensors_keeps_parameter_objects_and_can_skip_children():
    outer = nn.Sequential(nn.Linear(2, 2))
    outer.register_buffer("scale", torch.ones(1))
    weight = outer[0].weight
    _compat.apply_to_tensors(outer, lambda t: t.double(), recurse=False)
    assert outer.scale.dtype == torch.float64 and outer[0].weight.dtype == torch.float32
    _compat.apply_to_tensors(outer, lambda t: t.double())
    assert outer[0].weight is weight and weight.dtype == torch.float64


def test_existing_buffers_can_leave_the_state_dict():
    norm = nn.BatchNorm1d(2)
    _compat.keep_buffers_out_of_state_dict(norm, ["running_mean"])
    assert "running_mean" not in norm.state_dict() and hasattr(norm, "running_mean")


def test_own_tensors_lists_a_modules_own_parameters_then_buffers_and_set_own_tensor_replaces_one():
    norm = nn.Sequential(nn.BatchNorm1d(2))[0]
    assert [(n, p) for n, _, p in _compat.own_tensors(norm)] == [
        ("weight", True), ("bias", True), ("running_mean", False), ("running_var", False),
        ("num_batches_tracked", False),
    ]  # fmt: skip
    weight = nn.Parameter(torch.zeros(2))
    _compat.set_own_tensor(norm, "weight", weight, True)
    _compat.set_own_tensor(norm, "running_mean", torch.ones(2), False)
    assert norm.weight is weight and torch.equal(norm.state_dict()["running_mean"], torch.ones(2))


def test_own_tensor_is_the_tensor_in_a_parameters_or_a_buffers_slot():
    norm = nn.BatchNorm1d(2)
    assert _compat.own_tensor(norm, "weight", True) is norm.weight
    assert _compat.own_tensor(norm, "running_mean", False) is norm.running_mean


def test_optimizers_to_device_moves_state_tensors():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    opt.step()
    _compat.optimizers_to_device([opt], torch.device("meta"))
    assert opt.state[p]["exp_avg"].is_meta


def test_gpipe_flags_are_what_torchgpipes_flag_readers_read():
    from torchgpipe import is_checkpointing, is_recomputing

    flags = _compat.gpipe_flags
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    flags.is_checkpointing, flags.is_recomputing = True, True
    try:
        assert (is_checkpointing(), is_recomputing()) == (True, True)
    finally:
        flags.is_checkpointing, flags.is_recomputing = False, False


def test_torchgpipe_microbatch_checks_tensors_or_tuples_of_tensors():
    _compat.microbatch.check((torch.ones(1), torch.ones(1)))
    with pytest.raises(TypeError, match="expected Tensor"):
        _compat.microbatch.check([torch.ones(1)])


def test_fork_and_join_order_two_lanes_backward():
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    order = []
    a2 = a * 2
    a2.register_hook(lambda g: order.append("a"))
    forked, phony = _compat.fork_dependency(a2)
    assert phony.numel() == 0
    b2 = _compat.join_dependency(b * 3, phony)
    b2.register_hook(lambda g: order.append("b"))
    (forked.sum() + b2.sum()).backward()
    # the forked lane (a) waits until the joined lane (b) has its gradient
    assert order == ["b", "a"]
    assert torch.equal(a.grad, torch.full((2,), 2.0)) and torch.equal(b.grad, torch.full((2,), 3.0))


def test_skip_layout_lists_stash_pop_routes_between_partitions():
    from torchgpipe.skip import pop, skippable, stash

    @skippable(stash=["x"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("x", x)
            return x

    @skippable(pop=["x"])
    class Pop(nn.Module):
        def forward(self, x):
            return x + (yield pop("x"))

    layout = _compat.inspect_skip_layout([nn.Sequential(Stash()), nn.Sequential(Pop())])
    assert [(name, route) for (_, name), route in layout.by_ns_name.items()] == [("x", (0, 1))]


def test_deferred_batch_norm_converts_a_batch_norm():
    converted = _compat.DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(2), 2)
    assert isinstance(converted, _compat.DeferredBatchNorm)


def test_accumulate_gradients_adds_to_grad_in_place_like_autograd_backward():
    w = nn.Parameter(torch.tensor([2.0, 3.0]))
    x = torch.tensor([1.0, 4.0], requires_grad=True)
    w.grad = held = torch.tensor([10.0, 20.0])
    _compat.accumulate_gradients([w * x], [torch.ones(2)], [x, w])
    assert w.grad is held and torch.equal(held, torch.tensor([11.0, 24.0]))
    assert torch.equal(x.grad, torch.tensor([2.0, 3.0]))


def test_accumulate_gradients_starts_from_a_gradient_edge_once_the_output_is_dropped():
    w = nn.Parameter(torch.tensor([2.0, 3.0]))
    x = torch.tensor([1.0, 4.0], requires_grad=True)
    out = torch.sin(w * x)
    edge = torch.autograd.graph.get_gradient_edge(out)
    expected = torch.cos(w * x).detach() * x
    del out
    _compat.accumulate_gradients([edge], [torch.ones(2)], [x, w])
    assert torch.equal(w.grad, expected)


def test_accumulate_keeping_graph_leaves_the_graph_for_a_second_backward():
    w = nn.Parameter(torch.tensor([2.0, 3.0]))
    x = torch.tensor([1.0, 4.0], requires_grad=True)
    edge = torch.autograd.graph.get_gradient_edge(torch.sin(w * x))
    _compat.accumulate_keeping_graph([edge], [torch.ones(2)], [x])
    assert w.grad is None and x.grad is not None
    _compat.accumulate_gradients([edge], [torch.ones(2)], [w])  # would raise on a freed graph
    assert torch.equal(w.grad, torch.cos(w * x).detach() * x)


def test_param_groups_find_where_a_weights_path_joins_the_inputs():
    w = nn.Parameter(torch.ones(2, 2))
    x = torch.ones(3, 2, requires_grad=True)
    out = torch.tanh(x @ w)
    node = torch.autograd.graph.get_gradient_edge
    reverse = _compat.reverse_graph([out.grad_fn])
    groups = _compat.param_groups([node(x).node], [node(w).node], reverse)
    assert [g["params"] for g in groups] == [{node(w).node}]
    assert [type(n).__name__ for g in groups for n in g["intermediates"]] == ["MmBackward0"]


def test_apply_function_runs_forward_and_backward_of_an_autograd_function():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.ones(2, requires_grad=True)
    y = _compat.apply_function(Double, x)
    y.sum().backward()
    assert torch.equal(y, torch.full((2,), 2.0)) and torch.equal(x.grad, torch.full((2,), 2.0))


def test_is_view_tells_a_view_from_its_base():
    base = torch.ones(2, 3)
    assert _compat.is_view(base.view(3, 2)) and not _compat.is_view(base)


def test_saved_tensors_hooks_now_reads_the_innermost_active_pair():
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    assert _compat.saved_tensors_hooks_now() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            assert _compat.saved_tensors_hooks_now() == (pack, unpack)
    assert _compat.saved_tensors_hooks_now() is None


def test_fake_tensor_mode_runs_a_module_without_allocating():
    with _compat.FakeTensorMode():
        layer = nn.Linear(1024, 1024)
        out = layer(torch.randn(4096, 1024))
    assert out.shape == (4096, 1024)
    assert type(out).__name__ == "FakeTensor"


def test_module_memory_reads_memtrackers_per_module_snapshots():
    layers = nn.ModuleList([nn.Linear(8, 8), nn.ReLU()])
    x = torch.randn(4, 8, requires_grad=True)
    with _compat.MemTracker() as tracker:
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    snap = _compat.module_memory(tracker, layers[1])
    assert set(snap) == set(_compat.MODULE_STATES)
    assert snap["Peak-Forward"] - snap["Pre-Forward"] == 4 * 8 * 4  # ReLU's output, float32


def test_memtracker_tracks_a_module_with_a_frozen_parameter():
    # torch's own registers a gradient hook on every parameter of a module it enters, which a frozen
    # one refuses; pipeckpt's counts it as a parameter and hooks only the trained ones.
    layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    layers[0].requires_grad_(False)
    x = torch.randn(4, 8)
    with _compat.MemTracker() as tracker:
        layers(x).sum().backward()
    assert layers[0].weight.grad is None and layers[1].weight.grad is not None
    assert not layers[0].weight._backward_hooks  # nothing left behind
    snap = _compat.module_memory(tracker, layers[1])
    assert snap["Peak-Forward"] - snap["Pre-Forward"] == 4 * 8 * 4  # its output, float32


def test_sac_saved_ops_resolve_the_matmul_and_attention_kernels_of_this_torch():
    ops = _compat.sac_saved_ops()
    assert len(ops) == len(_compat.SAC_SAVED_OP_NAMES)  # every name exists in torch 2.13
    assert torch.ops.aten.addmm in ops and torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in ops


def test_dcp_metadata_names_the_private_classes_dcp_pickles_and_the_extents_of_its_files(tmp_path):
    import pickletools

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3, 2), "note": 7}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    raw = (tmp_path / ".metadata").read_bytes()
    strings = {arg for op, arg, _ in pickletools.genops(raw) if isinstance(arg, str)}
    # The private names the safe metadata reader admits are the ones DCP writes.
    assert {_compat.DcpStorageInfo.__name__, _compat.DcpMemoryFormat.__name__, "_get_layout"} <= strings
    assert _compat.layout_by_name("torch.strided") is torch.strided
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    extents = _compat.dcp_file_extents(metadata, {"w", "note"})
    assert (
        list(extents) == ["__0_0.distcp"]
        and extents["__0_0.distcp"] == (tmp_path / "__0_0.distcp").stat().st_size
    )
    assert _compat.dcp_file_extents(metadata, set()) == {}
    assert _compat.dcp_files(metadata) == {"w": "__0_0.distcp", "note": "__0_0.distcp"}


def test_hf_init_weights_initialises_one_module_of_a_hugging_face_model():
    from support.hf_models import llama

    model = llama()
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.zero_()
        model.model.norm.weight.zero_()
    _compat.hf_init_weights(model)(norm)
    assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    assert torch.equal(model.model.norm.weight, torch.zeros_like(model.model.norm.weight))  # only that one


def test_is_hf_model_tells_a_pretrained_model_from_its_layers():
    from support.hf_models import gpt2

    model = gpt2()
    assert _compat.is_hf_model(model) and _compat.is_hf_model(model.transformer)
    assert not _compat.is_hf_model(model.transformer.h[0])


def test_output_collector_is_the_dict_of_lists_transformers_hooks_append_recorded_outputs_to():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, use_cache=False,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    collector = _compat.output_collector()
    assert collector is not None and collector.get() is None  # outside a forward
    seen = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda m, args: seen.append(collector.get()))
    out = model(torch.zeros(1, 3, dtype=torch.long), output_router_logits=True)
    assert list(seen[0]) == ["router_logits"] and len(out.router_logits) == 1
    assert out.router_logits[0] is seen[0]["router_logits"][0]  # the list the hooks appended to
    token = collector.set({"router_logits": []})
    collector.reset(token)
    assert collector.get() is None
