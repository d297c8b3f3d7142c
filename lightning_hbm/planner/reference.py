"""An outside reference for the planner: torch's ``MemTracker`` peak of one real training step (CPU or CUDA).

The planner counts with lightning_hbm's own rules (:mod:`lightning_hbm.memory`); the profiler shares
them, so agreeing with the profiler proves consistency, not accuracy. torch's
``torch.distributed._tools.mem_tracker.MemTracker`` counts live storages by itself. Two of its limits,
found by running it (torch 2.13), decide how it is used here:

* Inside Lightning it labels everything OPT (forward and backward run inside
  ``optimizer.step(closure)``), so the step is run by hand: the candidate applied by the same
  surgery a Trainer runs (:func:`~lightning_hbm.planner.tracing.apply_candidate`), one first step
  (its gradients and optimizer states exist afterwards, as in steady state), then the measured step
  in Lightning's order: forward, ``zero_grad(set_to_none=True)``, backward, optimizer step.
* It registers a gradient hook on every parameter of every module it enters, which raises for a
  frozen parameter ("cannot register a hook on a tensor that doesn't require gradient"): frozen
  bases (LoRA, quantized layers) need it switched off. Its total does not depend on the hooks (they
  only label gradients), see :class:`_FrozenSafeMemTracker`.
* It counts meta tensors as memory of a "meta" device: only the step's own device is summed.
* Its module hooks (torch's ``ModTracker``) change what they watch: with ``FusedLoss`` on a quantized, LoRA-adapted
  head they keep the head's chunk input alive through the backward (+15,360 B, 60 tokens x 64 fp32, on torchtune's
  llama3 at 4 x 16 tokens; the same step without ``ModTracker`` peaks 15,360 B lower, at the planner's figure).
  Where a module's output never reaches the loss they keep its whole graph alive through the backward and the
  optimizer step (held by the hooks' autograd nodes; ``gc.collect()`` does not free it): transformers' ``MimiModel``,
  whose encoder's latents become integer codes (``argmin``), measured 1,036,302 B, 263,048 B of them the encoder's
  activations, which a step without ``ModTracker`` frees at the end of the forward (773,254 B, the planner's figure;
  ``tests/test_model_families_s33_mimi_plan.py``). ``module_hooks=False`` measures without them (only the total is
  meant then: the per-module figures and labels are not kept). Of 53 steps measured both ways (session 34: every
  ``memtracker_peak`` call of the tests that ran here, and Mimi under ``bf16-true``) three read more with the hooks:
  Mimi under nf4-dq (+261,000 B) and ``bf16-true`` (+543,176 B), transformers' Mamba at ``32-true`` (+41,472 B);
  without them each equals its plan. In Mamba the hooks keep each mixer's ``torch.exp(A_log)`` alive (``A`` goes to
  ``mamba_inner_fn``, a kernels-hub module that returns None on CPU: the multi-gradient hook on its inputs holds
  ``A``'s autograd node) and buffer two gradients until every input's has arrived (benchmarks/README.md, "Plans
  against torch's MemTracker without its module hooks"; ``tests/test_memtracker_hooks_s35.py``). The FusedLoss case above did not recur on lightning_hbm's ``LlamaLM`` with the
  head quantized and adapted (the same peak both ways).

Quantization constants live outside the parameters (bitsandbytes ``quant_state``, int8 row scales):
they are handed to MemTracker as external tensors, as it asks for tensors created before it.
It is private torch API: :func:`memtracker_peak` raises ``RuntimeError`` naming the torch version if
it is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import lightning.pytorch as pl
import torch

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.memory import quantization_tensors
from lightning_hbm.planner.candidates import Candidate
from lightning_hbm.planner.tracing import _closure_loss, apply_candidate


def memtracker_peak(factory: Callable[[], pl.LightningModule], batch: Any, candidate: Candidate, seed: int = 0,
                    module_hooks: bool = True, first_batches: Sequence[Any] = ()) -> int:
    """Peak bytes of one steady-state training step of ``factory()`` under ``candidate``, measured by MemTracker.

    ``module_hooks=False``: MemTracker without its ``ModTracker`` module hooks, which keep alive the graph of a module
    whose output never reaches the loss (see the module's docstring); its total counts the same storages.
    ``first_batches``: the batches of the steps run before the measured one (default: one step on ``batch``). A
    mixture of experts routes a batch to a few experts, and its optimizer keeps the states of every expert a run has
    updated: steps on batches that route to every expert give the steady state of a long run."""
    torch.manual_seed(seed)
    plugin = candidate.precision_plugin("cpu")
    module = factory()
    with plugin.tensor_init_context():
        module.configure_model()
    optimizers = apply_candidate(module, candidate, plugin, device="cpu", batch=batch)
    batch = plugin.convert_input(torch_compat.map_tensors(lambda t: t.clone(), batch))
    for first in first_batches or [batch]:  # the first steps: gradients and optimizer states now exist
        first = first if first is batch else plugin.convert_input(torch_compat.map_tensors(lambda t: t.clone(), first))
        _step(module, first, plugin, optimizers)
    tracker = _tracker(module_hooks)
    constants = [t for m in module.modules() for t in quantization_tensors(m)]
    tracker.track_external(module, *optimizers, *constants, *[t for t in _leaves(batch)])
    with tracker:
        _step(module, batch, plugin, optimizers)
    return _total(tracker)


class StepPeak(pl.Callback):
    """The peak bytes of one training step of a real ``Trainer.fit``, measured by torch's MemTracker: the step a plan
    is about, with Lightning's own loop, callbacks and plugins, not one run by hand.

    ``step``: the ``trainer.global_step`` measured (default 1: the first step has made the gradients and the optimizer
    states, as in steady state). ``module_hooks``: off by default, since ``ModTracker``'s module hooks keep alive the
    graph of a module whose output never reaches the loss, which no real step does (transformers' SigLIP-2 attention-
    pooling head under its mean-pooling classifier: 226,536 B with them, 213,120 B without, the plan's figure; see the
    module's docstring). Inside Lightning MemTracker labels everything OPT: only the total, ``peak``, is meant. The
    module, the optimizers, the quantization constants and the batch are handed to it as external tensors."""

    def __init__(self, step: int = 1, module_hooks: bool = False) -> None:
        self.step, self.module_hooks = step, module_hooks
        self.peak: int | None = None
        self._tracker: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or self._tracker is not None:
            return
        self._tracker = _tracker(self.module_hooks)
        constants = [t for m in pl_module.modules() for t in quantization_tensors(m)]
        self._tracker.track_external(pl_module, *trainer.optimizers, *constants, *_leaves(batch))
        self._tracker.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self._tracker is None or self.peak is not None:
            return
        self._tracker.__exit__(None, None, None)
        self.peak = _total(self._tracker)


def _tracker(module_hooks: bool) -> Any:
    """torch's MemTracker with no gradient hook on the parameters (frozen ones refuse it), with or without its module
    hooks, keeping its total peak only (:func:`~lightning_hbm._compat.torch.total_peak_only`: the same total, without
    the per-module bookkeeping that made a 30-layer model's step ~13x slower: benchmarks/README.md, Costs)."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as err:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed._tools.mem_tracker ({err}).") from err

    class _FrozenSafeMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    tracker = _FrozenSafeMemTracker()
    torch_compat.total_peak_only(tracker)  # only the total is read (``_total``)
    if not module_hooks:
        torch_compat.without_module_hooks(tracker)
    return tracker


def _total(tracker: Any) -> int:
    """The tracker's peak over the step's devices: meta tensors hold no memory (FusedLoss's LazyLogits computes view
    shapes on one the size of the logits)."""
    peaks = tracker.get_tracker_snapshot("peak")
    return sum(snapshot["Total"] for device, snapshot in peaks.items() if torch.device(device).type != "meta")


def _step(module: pl.LightningModule, batch: Any, plugin: Any, optimizers: list) -> None:
    with plugin.forward_context():
        loss, _kept = _closure_loss(module.training_step(batch, 1))
    for optimizer in optimizers:  # Lightning zeroes gradients after the forward, before backward
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    del loss
    for optimizer in optimizers:
        optimizer.step()


def _leaves(batch: Any) -> list[torch.Tensor]:
    return torch_compat.tensor_leaves(batch)


__all__ = ["StepPeak", "memtracker_peak"]
