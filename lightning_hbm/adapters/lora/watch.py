"""Dead adapters found at the first backward; adapters whose gradient stays all-zero, over the first few; MoE experts
whose adapters no gradient reached in the whole fit."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_hbm._compat.torch import foreach_norm
from lightning_hbm.adapters.lora.base import adapted_layers
from lightning_hbm.layers import weight_readers
from lightning_hbm.layers.experts import PROJECTIONS, LinearExperts
from lightning_hbm.naming import name_list, under

#: backward passes over which an adapter whose gradient was all-zero at the first is watched. Each costs one fused
#: norm over the adapters still all-zero and one device sync (after the first pass usually none are: no cost).
ZERO_STEPS = 3


class AdapterWatch:
    """Finds dead adapters at the first backward: a LoRA layer that got no gradient is an error naming it.

    Two ways an adapter dies, told apart by forward hooks on each LoRA layer and on its parent:
    the layer ran but no gradient reached its ``lora_A``/``lora_B`` (the graph is cut), or the parent
    ran and the layer did not (the parent reads the wrapped weight directly, as
    ``nn.MultiheadAttention`` does with ``out_proj``). A layer whose parent did not run either (an
    expert no token was routed to, a branch not taken) cannot be judged and is not an error.

    A third kind gets a gradient that is all zeros, not ``None``: its output is computed, then dropped by an indexing
    or a mask, or its input is all zeros (a LoRA gradient is its input times its output's gradient: a vector
    quantizer whose codebook is still all zeros, as a freshly built codec's, decodes every code to a zero vector and
    the layers after it see zeros). One all-zero first gradient can be chance; all-zero over the first
    :data:`ZERO_STEPS` backward passes (or every pass of a shorter fit) is reported like a cut adapter, and the
    adapters whose input was all zeros in the first step (measured by the same pre-hooks: the largest ``|input|``,
    kept on the device, read only for the adapters reported) are named apart.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # peft's LoraLayer modules (Any: their lora_A/lora_B are ModuleDicts the nn.Module type does not declare)
        self.layers: dict[str, Any] = dict(adapted_layers(module))
        self.ran: set[int] = set()
        self.gradless: set[int] = set()  # ran in a training forward with gradients off (inside an autograd.Function)
        self.inputs: dict[int, list[torch.Tensor]] = {}  # each LoRA layer's largest |input| per call, first step (no sync)
        self.layer_ids = {id(m) for m in self.layers.values()}
        self.handles: list[Any] = []
        self.fixed: list[str] = []  # input embeddings made to require grad at the first step (input_grads.py)
        self.parents = {n: module.get_submodule(n.rpartition(".")[0]) if "." in n else module for n in self.layers}
        watched = {id(m): m for m in [*self.layers.values(), *self.parents.values()]}
        for sub in watched.values():
            self.handles.append(sub.register_forward_pre_hook(self._ran))
        self.passes = 0  # backward passes seen
        self.zero: list[str] = []  # adapters whose gradient was all-zero at every pass seen
        self.unused: list[str] = []  # adapters reported: cut from the graph, then all-zero ones
        self.behind: dict[str, list[tuple[str, bool]]] = {}  # all-zero at the first pass: the zero scales around them

    def _ran(self, module: nn.Module, args: Any) -> None:
        self.ran.add(id(module))
        if module.training and not torch.is_grad_enabled():
            self.gradless.add(id(module))
        x = args[0] if args else None
        # the same ops at every call of the first step, its recompute under checkpointing included: selective
        # checkpointing replays the forward's ops and refuses one the forward did not run (a torch.maximum with
        # the peak already seen ran only in the recompute: "aten.maximum.default encountered during backward")
        if self.passes == 0 and id(module) in self.layer_ids and type(x) is torch.Tensor and x.is_floating_point() and x.numel():
            self.inputs.setdefault(id(module), []).append(x.detach().abs().amax())

    def gradless_adapters(self) -> list[str]:
        """The adapters that ran in a training forward with gradients off (so far)."""
        return [n for n, m in self.layers.items() if id(m) in self.gradless]

    def fix_applied(self, embeddings: list[str]) -> None:
        self.fixed = embeddings

    def check_loss(self, loss: Any) -> None:
        """At the first backward: a loss that does not require grad is an error naming why (was: torch's "element 0
        of tensors does not require grad"), before any optimizer step. transformers Reformer runs its layers inside a
        ``torch.autograd.Function`` (reversible layers, recomputed in its backward): the adapters run with gradients
        off, and the backward reaches them only when the layers' input requires grad, which frozen embeddings'
        output does not. The first step makes it require grad where it can (:mod:`.input_grads`): this error is for
        a model with no input embedding to hook, or one whose loss still has no gradient after."""
        if self.passes or not isinstance(loss, torch.Tensor) or loss.requires_grad:
            return
        self.close()  # raised below: the fit ends here, its hooks must not stay on the model
        gradless = self.gradless_adapters()
        if gradless and self.fixed:
            raise RuntimeError(
                f"LoRA: the loss of the first training step does not require grad: the adapters {name_list(gradless)} "
                "ran with gradients off (inside a torch.autograd.Function's forward), and making the output of the "
                f"input embeddings {name_list(self.fixed)} require grad (what transformers' enable_input_require_grads() "
                "does) did not give the loss a gradient: the Function's input does not come from them. Make that input "
                "require grad (a forward hook on the module computing it that returns output.requires_grad_())."
            )
        if gradless:
            raise RuntimeError(
                f"LoRA: the loss of the first training step does not require grad: the adapters {name_list(gradless)} "
                "ran with gradients off (inside a torch.autograd.Function's forward, as transformers Reformer's "
                "reversible layers run them), so the backward can reach them only through the layers' input, which "
                "does not require grad, and the model has no input embedding (get_input_embeddings() or nn.Embedding) "
                "whose output lightning_hbm could make require grad, as transformers' enable_input_require_grads() "
                "does. Make that input require grad: a forward hook on the module computing it that returns "
                "output.requires_grad_(), or x.requires_grad_() on a float input in training_step."
            )
        raise RuntimeError(
            "LoRA: the loss of the first training step does not require grad: no adapter reaches it (a .detach(), "
            "torch.no_grad() or .item() in training_step?). Return a loss computed from the model's output."
        )

    def after_backward(self) -> bool:
        """Check one backward pass; ``True`` once the watch is over (the callback drops it)."""
        self.passes += 1
        if self.passes == 1:
            self.unused = self.check()
            ran = [n for n in self.layers if id(self.layers[n]) in self.ran and n not in self.unused]
            self.zero = _all_zero({n: self.layers[n] for n in ran})
            # before the first optimizer step moves a trained one: the zero scales around them, kept for the report
            self.behind = zero_scales_around(self.module, self.zero, list(self.layers))
        else:
            self.zero = _all_zero({n: self.layers[n] for n in self.zero})
        if self.zero and self.passes < ZERO_STEPS:
            return False
        self.finish()
        return True

    def finish(self) -> None:
        """Report the adapters still all-zero (also at the end of a fit shorter than :data:`ZERO_STEPS` passes)."""
        zero, self.zero = self.zero, []
        inputs, self.inputs = self.inputs, {}
        if not zero:
            return
        fed_zeros = [n for n in zero if id(self.layers[n]) in inputs and not any(bool(p != 0) for p in inputs[id(self.layers[n])])]
        behind = {n: scales for n, scales in self.behind.items() if n in zero and n not in fed_zeros}
        waiting = [n for n in zero if n in behind and all(trained for _, trained in behind[n])]
        if waiting:
            scales = list(dict.fromkeys(s for n in waiting for s, _ in behind[n]))
            rank_zero_info(
                f"LoRA: {len(waiting)} adapter(s) had all-zero gradients at each of the first {self.passes} backward "
                f"pass(es): {name_list(waiting)}. A trained scale after them is still all zeros, as initialised: "
                f"{_listed(scales)}. No gradient passes a zero scale; an optimizer step moves it, and they get "
                "gradients after it (expected)."
            )
        zero = [n for n in zero if n not in waiting]
        if not zero:
            return
        self.unused = [*self.unused, *zero]
        frozen = {n: [s for s, trained in behind[n] if not trained] for n in zero if n in behind}
        rank_zero_warn(
            f"LoRA: {len(zero)} adapter(s) ran but their gradient was all zeros at each of the first {self.passes} "
            f"backward pass(es), so they are not trained: {name_list(zero)}. {_zero_causes(zero, fed_zeros, frozen)} "
            "They stay at their initial value (lora_B = 0, no effect). To not create them, pass "
            f"LoRA(exclude_modules={sorted(zero)!r})."
        )

    def close(self) -> None:
        """Remove the forward pre-hooks (at the first backward's check, or when the fit ends or fails before it: they
        held the watch, and through it the model, on the model for the rest of the process; session 30)."""
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()

    def check(self) -> list[str]:
        """Raise for dead adapters; warn for (and return) the ones whose output never reaches the loss."""
        self.close()
        dead, cut = [], []
        for name, layer in self.layers.items():
            grads = _grads(layer)
            if not grads or any(g is not None for g in grads):
                continue
            if id(layer) in self.ran:
                cut.append(name)
            elif id(self.parents[name]) in self.ran:
                dead.append(name)
        if dead:
            dead = self._branches_not_taken(dead)
        if dead:
            raise RuntimeError(
                f"LoRA adapters received no gradient in the first backward: {dead} were never called although their "
                "parent module ran (it reads their weight directly, so the adapter is dead); exclude them with "
                "LoRA(exclude_modules=[...]) or report the model class to lightning_hbm."
            )
        if cut:
            # The layer ran but its output never reaches the loss: the model's own design (a BERT pooler under
            # mean pooling), not a lightning_hbm failure. They get no gradient, so no optimizer updates them or
            # allocates state for them; they stay in the model (lora_B = 0: they change nothing) so checkpoints
            # and resume see the same parameters.
            rank_zero_warn(
                f"LoRA: {len(cut)} adapter(s) ran but their output never reaches the loss, so they are not trained: "
                f"{name_list(cut)}. No gradient path leads back to them: an op without a gradient in between (an "
                "argmin or argmax, as a vector quantizer's codes; a comparison; a cast to an integer), a .detach() or "
                "torch.no_grad(), or an output the loss does not use. They stay at their initial value (lora_B = 0, no "
                f"effect). To not create them, pass LoRA(exclude_modules={sorted(cut)!r})."
            )
        return cut

    def _branches_not_taken(self, dead: list[str]) -> list[str]:
        """Of the adapters not called although their parent ran, the ones whose weight the parent reads (the probe
        step saw it, or the source shows it): returned, an error. The others sit on a branch of the parent's forward
        the first batch did not take (transformers Longformer's ``query_global``/``key_global``/``value_global`` run
        only for tokens with global attention; was: this error, stopping a model that trains): warned by name, and
        trained on the steps that take it."""
        readers = weight_readers(self.module, uses_only=True)
        branch = [n for n in dead if n not in readers]
        if branch:
            rank_zero_warn(
                f"LoRA: {len(branch)} adapter(s) were not called in the first training step although their parent module "
                f"ran, and no code reads their weight: {name_list(branch)}. They sit on a branch of the parent's forward "
                "this batch did not take (transformers Longformer's query_global/key_global/value_global run only for "
                "tokens with global attention): they get a gradient on the steps that take it. If no batch does, "
                f"LoRA(exclude_modules={sorted(branch)!r}) leaves them out."
            )
        return [n for n in dead if n in readers]


class ExpertWatch:
    """The MoE experts whose adapters never received a non-zero gradient in a whole fit, warned at its end.

    :class:`AdapterWatch` cannot judge an expert at the first backward: an expert no token of the first batch reached
    (its parent ran, it did not) trains once the router sends it tokens (FlexOlmo, Aria; a warning at fit start would
    fire on healthy runs). So each expert (the ``gate_up_proj.e`` / ``down_proj.e`` adapters of a
    :class:`~lightning_hbm.layers.experts.LinearExperts`) is watched over the whole fit: trained once one of its
    adapters' gradients is non-zero after a backward. An expert not routed in a step has no gradient (``None``): no
    cost; one that ran and is not yet known trained costs one fused norm and one sync in that step, and is known
    after it, so the syncs stop once every expert was reached. At the end of the fit (:meth:`finish`), the experts
    never trained are warned by name, with the steps and the fix; nothing is said when every expert trained.
    """

    def __init__(self, module: nn.Module) -> None:
        #: per expert, "<experts module> expert <e>": its adapters by name; an expert leaves it once trained
        self.pending: dict[str, dict[str, Any]] = {}
        self.experts = 0
        for name, layer in adapted_layers(module).items():
            owner, _, index = name.rpartition(".")
            experts, _, projection = owner.rpartition(".")
            if projection in PROJECTIONS and isinstance(_submodule(module, experts), LinearExperts):
                self.pending.setdefault(f"{experts} expert {index}", {})[name] = layer
        self.experts = len(self.pending)
        self.steps = 0  # backward passes seen

    def after_backward(self) -> None:
        """Drop the experts whose adapters got a non-zero gradient in this backward."""
        self.steps += 1
        reached = {expert: layers for expert, layers in self.pending.items() if any(g is not None for layer in layers.values() for g in _grads(layer))}
        if not reached:
            return
        layers = {name: layer for adapters in reached.values() for name, layer in adapters.items()}
        zero = set(_all_zero(layers))
        with_grads = {name for name, layer in layers.items() if any(g is not None for g in _grads(layer))}
        for expert, adapters in reached.items():
            if any(name in with_grads and name not in zero for name in adapters):
                del self.pending[expert]

    def finish(self) -> list[str]:
        """Warn about the experts never trained in the fit (silent when every one trained); their adapters' names."""
        if not self.pending or not self.steps:
            return []
        names = sorted(name for adapters in self.pending.values() for name in adapters)
        rank_zero_warn(
            f"LoRA: the adapters of {len(self.pending)} of {self.experts} MoE experts never received a non-zero gradient "
            f"in this fit's {self.steps} backward pass(es), so they did not train (lora_B = 0, no effect): "
            f"{_listed(list(self.pending), shown=6)}. The router sent them no token of any batch (an expert that no "
            "token of the first batches reaches trains once tokens reach it, so this is said at the end of the fit). "
            "Fix: train more steps, turn on the router's load-balancing loss (transformers: output_router_logits=True "
            f"with router_aux_loss_coef > 0 in the model's config) so tokens reach every expert, or leave them out: "
            f"LoRA(exclude_modules={names!r})."
        )
        return names


def _submodule(module: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(name) if name else module
    except AttributeError:
        return None


def _zero_causes(zero: list[str], fed_zeros: list[str], frozen: dict[str, list[str]]) -> str:
    """Why ``zero`` got all-zero gradients: measured for ``fed_zeros`` (their input was all zeros), the frozen all-zero
    scales found around the ones in ``frozen`` (:func:`zero_scales_around`), general for the rest."""
    said = []
    if fed_zeros:
        who = "Their input was" if len(fed_zeros) == len(zero) else f"The input of {len(fed_zeros)} of them ({name_list(fed_zeros)}) was"
        said.append(
            f"{who} all zeros in the first training step (measured): a LoRA gradient is its input times its output's "
            "gradient, so it is zero whatever the loss. Something before them outputs zeros: e.g. a vector quantizer "
            "whose codebook is still all zeros (built, not loaded from a trained checkpoint) decodes every code to a "
            "zero vector, or a layer or gate initialised to zero feeds them."
        )
    if frozen:
        said.append(_frozen_scale_cause(zero, frozen))
    if len(fed_zeros) + len(frozen) < len(zero):
        who = "Their output is" if not fed_zeros and not frozen else "The others' output is"
        said.append(
            f"{who} computed but does not change the loss: dropped by an indexing or a mask, a torch.where branch not "
            "taken, scaled by a gate or a scale at zero, or passed through an op whose gradient is zero (rounding, a "
            "step function)."
        )
    return " ".join(said)


def _frozen_scale_cause(zero: list[str], frozen: dict[str, list[str]]) -> str:
    """The cause of the adapters in ``frozen``: the frozen all-zero scales around them, by name, with the fix."""
    scales = list(dict.fromkeys(s for n in zero if n in frozen for s in frozen[n]))
    owners = list(dict.fromkeys(s.rpartition(".")[0] for s in scales))
    who = "They sit" if len(frozen) == len(zero) else f"{len(frozen)} of them ({name_list([n for n in zero if n in frozen])}) sit"
    return (
        f"{who} in a block with a scale that is all zeros and frozen: {_listed(scales)}: the "
        "weight of a norm or a layer scale that closes a residual branch, initialised to zero (timm's zero_init_last, "
        "Swin-V2's post-norms, LeViT's last BatchNorm of each branch) in a model built from its config, not loaded "
        "from trained weights. No gradient passes a zero scale, and LoRA trains only the adapters, so it stays zero "
        "and they never train: load trained weights (a trained model's scales are not zero), or train those "
        f"modules in full: LoRA(modules_to_save={owners!r})."
    )


def _listed(names: list[str], shown: int = 3) -> str:
    """Full names (a short name such as ``weight`` says nothing): the first ``shown``, then the count."""
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


#: parameter names of a scale (a layer scale: timm's ``gamma``, transformers' ``layer_scale_parameter``, CaiT's
#: ``gamma_1``, ``lambda1``), besides a norm's ``weight``
_SCALE_NAME = re.compile(r"gamma|scale|lambda", re.IGNORECASE)
_SKIPPED = re.compile(r"\.(?:lora_[^.]*|original_module)\.")


def _is_scale(owner: nn.Module, name: str, param: torch.Tensor) -> bool:
    if type(param.data) is not torch.Tensor or not param.is_floating_point() or not param.numel():
        return False  # a sharded (DTensor) or quantized parameter: no verdict from one rank's part
    norm = "norm" in type(owner).__name__.lower()  # torch's BatchNorm*d, LayerNorm, GroupNorm, RMSNorm; transformers' RMSNorms
    return (name == "weight" and norm) or (bool(_SCALE_NAME.search(name)) and "bias" not in name.lower())


def zero_scales_around(module: nn.Module, names: list[str], adapters: list[str]) -> dict[str, list[tuple[str, bool]]]:
    """For each adapter in ``names``, the all-zero scales in the nearest module around it that holds one:
    ``(parameter name, trained)``; adapters with none are left out.

    A scale is a norm's ``weight`` or a layer scale (:data:`_SCALE_NAME`); one that is all zeros stops every gradient
    to the layers before it: timm initialises the last norm of each residual branch to zero (RegNet's and ResNet's
    ``zero_init_last``, Swin-V2's res-post-norms, LeViT's ``bn_weight_init=0``), and a model built from its config
    keeps it so. The search goes up from the adapter's parent, not above the module that holds every adapter (the
    model): the scales found are the ones in the same block, not proven to lie after the adapter. Read only when an
    adapter's first gradient is all zeros (one sync), before the first optimizer step moves a trained scale."""
    if not names:
        return {}
    # not the adapters' own (lora_B is zeros), nor peft's frozen original of a module trained in full (modules_to_save:
    # its trained copy runs)
    found = [(f"{owner}.{p}" if owner else p, owner, param) for owner, sub in module.named_modules() if not _SKIPPED.search(f".{owner}.")
             for p, param in sub.named_parameters(recurse=False) if _is_scale(sub, p, param)]  # fmt: skip
    if not found:
        return {}
    device = found[0][2].device
    zero = torch.stack([param.detach().abs().amax().float().to(device) for _, _, param in found]).eq(0).tolist()
    scales = [(name, owner, param.requires_grad) for (name, owner, param), z in zip(found, zero) if z]
    top = _common_parent(adapters)
    around: dict[str, list[tuple[str, bool]]] = {}
    for name in names:
        for block in _ancestors(name, top):
            inside = [(s, trained) for s, owner, trained in scales if (not block or under(owner, [block])) and not under(owner, [name])]
            if inside:
                around[name] = inside
                break
    return around


def _ancestors(name: str, top: str) -> list[str]:
    """The modules around ``name``, innermost first, up to ``top`` (one of them; ``""``: the root) included."""
    parts = name.split(".")
    chain = [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]
    return chain[: chain.index(top) + 1] if top in chain else chain


def _common_parent(names: list[str]) -> str:
    """The deepest module name that holds every one of ``names`` (``""``: the root)."""
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _grads(layer: Any) -> list[Any]:
    """The gradients of a peft LoRA layer's trainable adapter weights (``None`` where none arrived)."""
    return [p.grad for c in (layer.lora_A, layer.lora_B) for p in c.parameters() if p.requires_grad]


def _all_zero(layers: dict[str, Any]) -> list[str]:
    """The names of ``layers`` that have gradients and all of them are zero.

    One ``torch._foreach_norm`` (:func:`~lightning_hbm._compat.torch.foreach_norm`) over every gradient (grouped into a few kernels per device and dtype, as
    ``clip_grad_norm_`` does) and one ``tolist`` sync, not one sync per layer. ``lora_A``'s gradient is zero
    while ``lora_B`` is (peft's init), so ``lora_B``'s carries the decision. A NaN norm is not zero.
    """
    owners, grads = [], []
    for name, layer in layers.items():
        for g in _grads(layer):
            if g is not None:
                owners.append(name)
                grads.append(g.detach())
    # a sharded gradient (FSDP2's DTensor) is one rank's part: all-zero here says nothing of the others' parts, and a
    # verdict would need a collective every rank joins; the check is for single-device and DDP runs
    if not grads or any(type(g) is not torch.Tensor and not isinstance(g, torch.nn.Parameter) for g in grads):
        return []
    norms = foreach_norm(grads)
    nonzero = torch.stack([n.to(norms[0].device, torch.float32) for n in norms]).ne(0).tolist()
    alive = {o for o, nz in zip(owners, nonzero) if nz}
    # a sum of squares underflows below |g| ~ 1e-19: the layers whose norms all read 0 (usually none) are checked again
    # by their largest |g| (a max norm over every gradient would be exact but 14x slower on CPU)
    alive |= {o for o, g in zip(owners, grads) if o not in alive and bool(g.abs().amax() != 0)}
    return [n for n in dict.fromkeys(owners) if n not in alive]
