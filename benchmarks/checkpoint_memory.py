"""The checkpoint benchmark's memory accounting: a ``MemTracker`` that keeps activation peaks.

:class:`ActivationTracker` counts live tensor bytes minus parameters, buffers, optimizer state and
gradients, and keeps the running maximum of that figure; :func:`mark_pending_gradients` files the
weight gradients autograd is still summing over micro-batches as gradients; :func:`tracked` runs a
step under the tracker, on torchgpipe's (and pipeckpt's) worker threads too. Why it is measured so
is in bench_checkpoint.py's docstring. Apart because it is the one piece that reaches into torch's
and torchgpipe's internals: importing this module replaces ``torchgpipe.worker.worker`` so that
each worker thread pushes the active tracker onto its mode stack (a no-op when none is active).
"""

import contextlib
import functools
from typing import Dict, Iterator, Optional, Sequence

import torch
import torchgpipe
import torchgpipe.worker
from checkpoint_methods import CPU
from torch import Tensor, nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._python_dispatch import _pop_mode, _push_mode


class ActivationTracker(MemTracker):
    """MemTracker reduced to its tensor accounting, with running maxima of

    - ``peak_activation``: live bytes minus parameters, buffers, optimizer state and
      gradients, gradients including the ones still summed in autograd's input buffers
      (see :func:`mark_pending_gradients`);
    - ``peak_categories``: the same with only ``.grad`` subtracted, i.e. MemTracker's
      categories, where those buffers are temporary memory;
    - ``peak_footprint``: live bytes minus parameters, buffers and optimizer state
      (activations and gradients together: what the step needs beyond the weights).

    Its per-module snapshots are switched off: they refuse a module that runs more than
    once per step, which every micro-batched method does.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = list(model.parameters())
        self.param_ids = {id(p) for p in self.params}
        self.with_grad = {id(p): p.numel() * p.element_size() for p in self.params if p.grad is not None}
        self.peak_activation = self.peak_categories = self.peak_footprint = 0

    def _snap(self) -> Dict[str, int]:
        return self._curr_mem_snap.get(CPU, {})

    def footprint(self) -> int:
        snap = self._snap()
        return snap.get("Total", 0) - sum(
            snap.get(k, 0) for k in (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.OPT)
        )

    def activation(self) -> int:
        return self.footprint() - self._snap().get(_MemRefType.GRAD, 0)

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        super()._update_peak_stats(peak_state)
        footprint = self.footprint()
        self.peak_footprint = max(self.peak_footprint, footprint)
        self.peak_activation = max(self.peak_activation, self.activation())
        self.peak_categories = max(self.peak_categories, footprint - sum(self.with_grad.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # Autograd sums a weight's micro-batch gradients in place when it can, out of place
        # otherwise: a sum with a gradient is a gradient.
        if (
            func is torch.ops.aten.add.Tensor
            and isinstance(out, Tensor)
            and any(self._is_gradient(a) for a in args if isinstance(a, Tensor))
        ):
            self._update_and_maybe_create_winfos(out, _MemRefType.GRAD)
        return out

    def _is_gradient(self, t: Tensor) -> bool:
        return any(
            self._WINFO.get(st, (None, None))[0] is not None
            and self._WINFO[st][0].reftype == _MemRefType.GRAD
            for st in get_untyped_storages(t)
        )

    def _saw_grad(self, p: Tensor) -> None:
        self.with_grad[id(p)] = p.numel() * p.element_size()

    def mark_gradient(
        self,
        slots: Sequence[int],
        grad_inputs: Sequence[Optional[Tensor]],
        grad_outputs: Sequence[Optional[Tensor]],
    ) -> None:
        for k in slots:
            if grad_inputs[k] is not None:
                self._update_and_maybe_create_winfos(grad_inputs[k], _MemRefType.GRAD)

    def _pre_fw_hook(self, module, inputs):  # type: ignore[no-untyped-def]
        pass

    def _post_fw_hook(self, module, inputs, outputs):  # type: ignore[no-untyped-def]
        pass

    def _pre_bw_hook(self, module, args):  # type: ignore[no-untyped-def]
        pass

    def _post_bw_hook(self, module, args):  # type: ignore[no-untyped-def]
        pass


def mark_pending_gradients(loss: Tensor, tracker: ActivationTracker) -> None:
    """Hooks every autograd node that feeds a parameter's AccumulateGrad, so the weight
    gradient it produces is filed as gradient at once, not when AccumulateGrad runs
    (which, in a single backward over several micro-batches, is after the last one)."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        slots = []
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is not None and id(getattr(nxt, "variable", None)) in tracker.param_ids:
                slots.append(k)
            elif nxt is not None:
                todo.append(nxt)
        if slots:
            node.register_hook(functools.partial(tracker.mark_gradient, slots))


_thread_tracker: Optional[MemTracker] = None
_original_worker = torchgpipe.worker.worker


def _worker_under_tracker(*args, **kwargs):  # type: ignore[no-untyped-def]
    """torchgpipe's worker loop with the active tracker on this thread's mode stack.

    ``spawn_workers`` looks ``worker`` up in its module at every pipeline run, so
    replacing the module attribute reaches every worker thread, pipeckpt's included.
    """
    tracker = _thread_tracker
    if tracker is None:
        return _original_worker(*args, **kwargs)
    _push_mode(tracker)
    try:
        return _original_worker(*args, **kwargs)
    finally:
        _pop_mode()


torchgpipe.worker.worker = _worker_under_tracker


@contextlib.contextmanager
def tracked(model: nn.Module) -> Iterator[ActivationTracker]:
    global _thread_tracker
    tracker = ActivationTracker(model)
    tracker.track_external(model)
    handles = [p.register_post_accumulate_grad_hook(tracker._saw_grad) for p in tracker.params]
    _thread_tracker = tracker
    try:
        with tracker:
            tracker._track_module_params_and_buffers(model, install_grad_hooks=True)
            yield tracker
    finally:
        _thread_tracker = None
        for h in handles:
            h.remove()
