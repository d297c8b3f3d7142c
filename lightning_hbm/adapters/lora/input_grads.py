"""The first training step of a model whose adapters run with gradients off: make its input embeddings' output require
grad, and run the step again.

transformers Reformer runs its layers inside a ``torch.autograd.Function`` (reversible layers: the forward runs them
with gradients off, the Function's backward recomputes them). The backward reaches the adapters only when the layers'
input requires grad, and the output of frozen embeddings does not: the loss has no gradient at all. transformers'
``enable_input_require_grads()`` is the fix (a forward hook on the input embeddings that makes their output require
grad); users of LoRA on a frozen model rarely know they need it. :func:`watch_first_step` decides by running: the first
training step runs as the user wrote it; only when adapters ran with gradients off and its loss has no gradient are the
hooks added (named by a warning), the random state and the BatchNorm statistics put back, and the step run again on a
copy of its batch. The same when the loss has a gradient through a head trained in full but an input embedding's output
did not require grad (a Reformer classifier: its adapters would silently get no gradient). Every other model pays
nothing but the copy of its first batch. Where the fix cannot apply (no
embedding to hook, or the loss still has no gradient), ``AdapterWatch.check_loss`` raises its error before any step.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.naming import name_list

#: the forward hook this module added to each embedding (one per embedding, however many fits), held beside the
#: module in a weak map, not stamped on it as an attribute (the house rule of record.py)
HOOKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def input_embeddings(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The input embeddings of ``module``'s models (each ``get_input_embeddings()``, as transformers'
    ``enable_input_require_grads`` hooks them), else its ``nn.Embedding`` layers; each once, by name."""
    names = {id(m): n for n, m in module.named_modules()}
    found: dict[int, tuple[str, nn.Module]] = {}
    for sub in module.modules():
        get = getattr(sub, "get_input_embeddings", None)
        if not callable(get):
            continue
        try:
            embedding = get()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(embedding, nn.Module) and id(embedding) in names:
            found.setdefault(id(embedding), (names[id(embedding)], embedding))
    if not found:
        found = {id(m): (n, m) for n, m in module.named_modules() if isinstance(m, nn.Embedding)}
    return list(found.values())


def _require_grad(module: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor) and output.is_floating_point() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def require_input_grads(module: nn.Module) -> list[str]:
    """Hook every input embedding of ``module`` so that its output requires grad; the names of those hooked."""
    hooked = []
    for name, embedding in input_embeddings(module):
        if embedding not in HOOKS:
            HOOKS[embedding] = embedding.register_forward_hook(_require_grad)
        hooked.append(name)
    return hooked


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else None
    return loss if isinstance(loss, torch.Tensor) else None


class _State:
    """The random state (Python's, NumPy's, torch's CPU and CUDA global RNGs) and the BatchNorm running statistics
    before the first step (a second run draws and counts as the first did, so the step is the one it would have been
    with the hooks there from the start; was torch's alone: a step drawing from ``random`` or NumPy drew other numbers
    in the rerun, session 31), and what ``self.log`` and the module's torchmetrics metrics counted (the discarded run's
    values reached the epoch's mean: the first batch counted twice, session 32)."""

    def __init__(self, module: nn.Module) -> None:
        self.rngs = torch_compat.rng_states()
        self.logged = lightning_compat.logged_values(module)
        self.buffers = [
            (b, b.detach().clone())
            for m in module.modules()
            if getattr(m, "track_running_stats", False) is True  # BatchNorm, InstanceNorm(track_running_stats=True)
            for b in m.buffers(recurse=False)
        ]

    def restore(self) -> None:
        torch_compat.set_rng_states(self.rngs)
        self.logged()
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)


def watch_first_step(module: pl.LightningModule, gradless: Callable[[], list[str]], fixed: Callable[[list[str]], None]) -> None:
    """Wrap ``module.training_step`` for its next call (then unwrapped): when ``gradless()`` names adapters that ran
    with gradients off and the loss has no gradient or an input embedding's output did not require grad, hook the
    input embeddings, warn, and run the step again (automatic optimization only: a manual step is not run twice; its
    loss without gradient gets ``check_loss``'s error naming the fix). ``fixed`` gets the embeddings hooked (the error for a loss still
    without gradient names them)."""
    if not module.automatic_optimization:  # its training_step steps the optimizers itself: never run it twice
        return
    own = vars(module).get("training_step")  # an instance attribute of the user's, put back after

    def first_step(*args: Any, **kwargs: Any) -> Any:
        if own is None:
            vars(module).pop("training_step", None)
        else:
            vars(module)["training_step"] = own
        if len(args) > 1 and not lightning_compat.takes_batch_idx(module.training_step):
            args = args[:1]  # Lightning passed batch_idx to this wrapper's *args; a step(self, batch) takes none (s39 h5)
        state = _State(module)
        # the step may change its batch in place: a copy for the second run, in host memory (no second batch on the
        # accelerator at the first step's peak; one device-to-host copy per fit)
        homes: dict[int, torch.device] = {}
        again = torch_compat.map_tensors(lambda t: _away(t, homes), (args, kwargs))
        frozen: list[str] = []  # input embeddings whose output did not require grad
        handles = [e.register_forward_hook(_recorder(frozen, n)) for n, e in input_embeddings(module)]
        try:
            output = module.training_step(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        loss = _loss_of(output)
        cut = loss is not None and not loss.requires_grad
        adapters = gradless() if torch.is_grad_enabled() and (cut or frozen) else []
        if adapters and not cut:  # a Function given the adapters' parameters (token chunks) returns their gradients
            adapters = _unreached(loss if loss is not None else output, module, adapters)
        hooked = require_input_grads(module) if adapters else []
        if not hooked:
            return output
        fixed(hooked)
        rank_zero_warn(
            f"LoRA: the adapters {name_list(adapters)} ran with gradients off in the first training step (inside a "
            "torch.autograd.Function's forward, as transformers Reformer's reversible layers run them, recomputed in "
            f"its backward), and the output of the frozen input embeddings of {_models(module)} did not require grad, "
            f"so no backward could reach them ({'the loss had no gradient' if cut else 'they would get no gradient'}). "
            f"lightning_hbm made the output of {name_list(hooked)} require grad (what transformers' "
            "enable_input_require_grads() does) and ran the first step again (same batch, random state and BatchNorm "
            f"statistics). To skip that second run: {_advice(module)}."
        )
        del output
        state.restore()
        args, kwargs = torch_compat.map_tensors(lambda t: t.to(homes[id(t)]), again)
        return module.training_step(*args, **kwargs)

    _OWN[first_step] = own
    vars(module)["training_step"] = first_step


#: each wrapper -> the user's own ``training_step`` instance attribute it replaced (``None``: none); a weak map, not
#: an attribute stamped on the function (record.py's rule)
_OWN: "weakref.WeakKeyDictionary[Callable[..., Any], Optional[Callable[..., Any]]]" = weakref.WeakKeyDictionary()


def unwatch_first_step(module: nn.Module) -> None:
    """Put ``module.training_step`` back if the wrapper is still there (a fit that ran no training step, or stopped)."""
    step = vars(module).get("training_step")
    try:
        own = _OWN.pop(step)  # type: ignore[arg-type]  # any object: a non-key is the KeyError below
    except (KeyError, TypeError):  # not our wrapper (none, or the user's own: maybe not weakly referable)
        return
    if own is None:
        del vars(module)["training_step"]
    else:
        vars(module)["training_step"] = own


def _unreached(output: Any, module: nn.Module, names: list[str]) -> list[str]:
    """Those of the adapters ``names`` whose trainable parameters the autograd graph of ``output`` does not reach.
    An adapter run with gradients off inside an autograd Function that takes its parameters as inputs
    (lightning_hbm's own token chunks, ``_ChunkedCall``) gets its gradient from that Function's backward: it is
    reached, nothing to fix. Reformer's reversible Function takes only the hidden states: its adapters are not."""
    reached: set[int] = set()
    seen: set[int] = set()
    outputs: list[torch.Tensor] = []
    torch_compat.map_tensors(outputs.append, output)
    todo: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        todo.extend(next_node for next_node, _ in node.next_functions)
    kept = []
    for name in names:
        params = [p for p in module.get_submodule(name).parameters() if p.requires_grad]
        if params and not any(id(p) in reached for p in params):
            kept.append(name)
    return kept


def _away(tensor: torch.Tensor, homes: dict[int, torch.device]) -> torch.Tensor:
    copy = tensor.detach().to("cpu", copy=True)
    homes[id(copy)] = tensor.device
    return copy


def _recorder(frozen: list[str], name: str) -> Callable[[nn.Module, Any, Any], None]:
    def record(embedding: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and not output.requires_grad and name not in frozen:
            frozen.append(name)

    return record


def _advice(module: nn.Module) -> str:
    if any(callable(getattr(m, "enable_input_require_grads", None)) for m in module.modules()):
        return "call model.enable_input_require_grads() on the transformers model in your LightningModule's __init__"
    return "register a forward hook on the input embedding that returns output.requires_grad_()"


def _models(module: nn.Module) -> str:
    """The model classes that own input embeddings (``ReformerModelWithLMHead``), else the module's class."""
    owners = [type(m).__name__ for m in module.modules() if callable(getattr(m, "get_input_embeddings", None))]
    return ", ".join(dict.fromkeys(owners[:1] or [type(module).__name__]))
