"""The experts kind: a transformers-5 mixture-of-experts layer prepared into ``LinearExperts``, one ``nn.Linear`` per expert.

transformers 5 stores all experts of a MoE layer (Mixtral, Qwen-MoE, ...) in two 3-D Parameters,
``gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` and ``down_proj`` ``[experts, hidden,
intermediate]``, read by index in its forward (or by a grouped-matmul kernel). Nothing Linear-based
reaches them: they stayed in 16 bits (77 % of a Mixtral's parameters) with no adapter.

Why a replacement module rather than a quantized 3-D tensor behind a parametrization: a weight that
is dequantized and then used in ``F.linear`` is saved by autograd for the backward, so every MoE
layer's dequantized experts would stay alive until the backward (the memory the quantization was to
save). Per-expert Linears go through the precision mode's own layer (bitsandbytes' ``Linear4bit``
keeps only the packed weight for backward), and LoRA adapts each expert with peft's ordinary layers.
The computation is transformers' eager experts loop, token routing included; outputs and gradients
equal the original's (tests/layers/test_experts.py).

Supported: experts classes built with transformers' ``use_experts_implementation`` in its default
layout (concatenated gate/up, no bias, no post-expert norm, the default gate), transposed (``[experts, in, out]``,
Aria's ``is_transposed=True``) or not. Other
layouts are left as they are and named by the coverage table's warning.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from typing_extensions import override

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._compat import transformers as transformers_compat
from lightning_hbm.layers.finding import expert_counts
from lightning_hbm.layers.kinds import LayerKind, register_kind

#: the projections of one expert, as :class:`LinearExperts` names its Linears (``<experts>.<projection>.<expert>``): the
#: names the quantization measures, rounds and corrects and LoRA's watch reads (one list, here where the kind lives)
PROJECTIONS = ("gate_up_proj", "down_proj")


def supported(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers-5 experts layer in the layout :class:`LinearExperts` reproduces."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3):
        return False
    layout = (
        getattr(module, "has_gate", None),
        getattr(module, "is_concatenated", None),
        getattr(module, "is_transposed", None),
        getattr(module, "has_bias", None),
        getattr(module, "has_post_expert_norm", None),
    )
    # transposed ([experts, in, out], Aria's checkpoints, the layout grouped_mm reads) or not: each expert's slice is a
    # Linear's weight or its transpose (Aria's experts were left at full size, 56 % of a tiny Aria; session 40)
    transposed_or_not = layout[2] in (False, True)
    return transposed_or_not and layout[:2] + layout[3:] == (True, True, False, False) and transformers_compat.uses_default_gate(module)


class _Activation(nn.Module):
    """A plain activation function (``F.silu``) as the child module :class:`LinearExperts` calls."""

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


class LinearExperts(nn.Module):
    """The experts of one MoE layer as ``gate_up_proj[e]`` and ``down_proj[e]`` Linears; same call as the original."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.act_fn = act_fn
        self.gate_up_proj = nn.ModuleList(nn.Linear(hidden, 2 * intermediate, bias=False) for _ in range(num_experts))
        self.down_proj = nn.ModuleList(nn.Linear(intermediate, hidden, bias=False) for _ in range(num_experts))

    @classmethod
    def from_transformers(cls, module: nn.Module) -> LinearExperts:
        """Take over the experts of ``module`` (see :func:`supported`): one Linear per expert and projection."""
        transposed = bool(getattr(module, "is_transposed", False))
        experts, double_intermediate, hidden = cast(torch.Tensor, module.gate_up_proj).shape
        if transposed:  # [experts, hidden, 2 * intermediate]
            hidden, double_intermediate = double_intermediate, hidden
        with torch.device("meta"):
            new = cls(experts, hidden, double_intermediate // 2, nn.Identity())
        act = module.act_fn
        # LFM2-MoE's experts hold a plain function (``self.act_fn = F.silu``): was "cannot assign
        # 'torch.nn.functional.silu' as child module 'act_fn'", the surgery stopped before the first step
        new.act_fn = act if isinstance(act, nn.Module) else _Activation(cast(Callable[[torch.Tensor], torch.Tensor], act))
        for source, target in ((cast(torch.Tensor, module.gate_up_proj), new.gate_up_proj), (cast(torch.Tensor, module.down_proj), new.down_proj)):
            for index, linear in enumerate(target):
                # [experts, out, in]: expert e is already a Linear weight [out, in]; transposed [experts, in, out]: its .t()
                weight = source.detach()[index]
                weight = (weight.t() if transposed else weight).clone(memory_format=torch.contiguous_format)
                linear.weight = nn.Parameter(weight, requires_grad=source.requires_grad)
        new.train(module.training)
        return new

    def as_built_keys(self) -> dict[str, str]:
        """Each expert's weight is a slice of the 3-D Parameter it came from (see ``LayerKind.as_built_keys``)."""
        return {f"{linear}.weight": linear.rpartition(".")[0] for linear in expert_linears(self.num_experts)}

    @override
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if is_fake(hidden_states):
            return self._worst_load(hidden_states, top_k_weights)
        final = torch.zeros_like(hidden_states)
        for expert, top_k_pos, token_idx in routed_tokens(top_k_index, self.num_experts):
            gate, up = self.gate_up_proj[expert](hidden_states[token_idx]).chunk(2, dim=-1)
            out = self.down_proj[expert](self.act_fn(gate) * up)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def _worst_load(self, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The planner's trace (fake tensors hold no values, so no routing): a load that needs the most memory.

        Whatever the router does, the experts compute ``tokens * top_k`` rows in all, so what they save for backward is
        the same for every load. What a load changes is one expert's working set (its gathered tokens, its gate/up
        outputs and their gradients), which grows with its rows, at most ``tokens`` (a token picks an expert once).
        The working set costs most at the ends of the backward: at its start (the last expert, whose backward runs
        first, while every expert's saved tensors are alive) and at its end (the first expert, once every other
        expert's weight gradients exist). So those two experts get every token (the last one alone with
        ``top_k=1``), and the others share the rest evenly. A balanced share for every expert, planned before, was
        under the run on six transformers MoE families (tests/layers/test_experts.py). The tokens are gathered by
        index as in :meth:`forward` (a slice would be a view): the gathered copies and the indices are saved.
        """
        tokens, top_k = top_k_weights.shape
        rows = (_balanced_rows if _BALANCED.get() else _worst_rows)(tokens, top_k, self.num_experts)
        final = torch.zeros_like(hidden_states)
        # forward's one-hot expert mask, int64 [tokens, top_k, experts + 1], alive through the loop: 8 * top_k *
        # (experts + 1) bytes per token (80 B for 4 experts, top-2), which the plan missed (under by 1.17 % at 1,024
        # tokens on Qwen3-MoE). Made from no token tensor, so the token-rows check (activations/token_rows.py) ignores it.
        expert_mask = torch.empty((tokens, top_k, self.num_experts + 1), dtype=torch.long, device=hidden_states.device)
        for expert, count in enumerate(rows):
            # what torch.where(expert_mask[expert]) returns: fresh indices per expert
            token_idx = torch.arange(count, device=hidden_states.device)
            top_k_pos = torch.zeros(count, dtype=torch.long, device=hidden_states.device)
            gate, up = self.gate_up_proj[expert](hidden_states[token_idx]).chunk(2, dim=-1)
            out = self.down_proj[expert](self.act_fn(gate) * up)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        del expert_mask  # freed with forward's locals
        return final


def expert_linears(count: int) -> list[str]:
    """The Linears :class:`LinearExperts` makes of ``count`` experts, relative to it: ``<projection>.<expert>``."""
    return [f"{proj}.{e}" for proj in PROJECTIONS for e in range(count)]


def convertible_experts(module: nn.Module) -> dict[str, nn.Module]:
    """``{name: experts layer}`` of the transformers experts layers of ``module`` the surgery will turn into
    :class:`LinearExperts` (:func:`supported`)."""
    return {name: sub for name, sub in module.named_modules() if EXPERTS.matches(sub) and supported(sub)}


def expert_names(name: str, layer: nn.Module) -> list[str]:
    """The names of the Linears :class:`LinearExperts` makes of the experts layer ``layer`` named ``name``."""
    return [f"{name}.{linear}" for linear in expert_linears(cast(torch.Tensor, layer.gate_up_proj).shape[0])]


def routed_tokens(top_k_index: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(expert, top_k_pos, token_idx)`` of each expert the router sent tokens to, in transformers' eager loop's order:
    ``token_idx`` the tokens routed to it, ``top_k_pos`` which of their choices it was. ``top_k_index == num_experts``
    (a dropped choice) is no expert. :class:`LinearExperts` computes with it, and the calibrated correction records
    each expert's inputs with it (:mod:`lightning_hbm.precision.expert_inputs`)."""
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit.flatten().tolist():
        if expert == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        yield expert, top_k_pos, token_idx


def _worst_rows(tokens: int, top_k: int, experts: int) -> list[int]:
    """Rows per expert of :meth:`LinearExperts._worst_load`: ``tokens`` for the last and the first expert (as far as
    ``tokens * top_k`` rows go), the rest shared evenly by the others, rounded up, and at least one row each: a router
    may send a token to every expert, and each expert that runs gets weight gradients of its own."""
    rows = [0] * experts
    left = tokens * top_k
    for end in (experts - 1, 0):
        if left and rows[end] == 0:
            rows[end] = min(tokens, left)
            left -= rows[end]
    middle = [e for e in range(experts) if rows[e] == 0]
    for e in middle:
        rows[e] = min(tokens, max(1, math.ceil(left / len(middle))))
    return rows


def _balanced_rows(tokens: int, top_k: int, experts: int) -> list[int]:
    """Rows per expert of a balanced router: ``tokens * top_k`` shared evenly, rounded up, at most ``tokens`` each."""
    return [min(tokens, max(1, math.ceil(tokens * top_k / experts)))] * experts


#: Whether :meth:`LinearExperts._worst_load` routes as a balanced router does instead (:func:`balanced_load`).
_BALANCED: ContextVar[bool] = ContextVar("lightning_hbm_balanced_experts", default=False)


@contextmanager
def balanced_load() -> Iterator[None]:
    """Plan the experts with a balanced load inside (every expert ``tokens * top_k / experts`` rows), not the worst.

    Only to say what the worst-load assumption costs (``max_context``'s note on MoE models): a balanced share was
    under the measured run on six MoE families, so it is never the plan itself.
    """
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


# Where a MoE experts module says how many experts it holds: its own attribute (transformers' experts classes set
# ``self.num_experts``; LongcatFlash ``num_routed_experts``/``total_experts``; torchtune's GroupedExperts
# ``num_experts``), or the config transformers built it from (``use_experts_implementation`` keeps it as ``self.config``).
def _is_experts(module: nn.Module) -> bool:
    # Experts are 3-D Parameters [experts, out, in] whose leading dim is the module's declared expert count: that
    # count is what the MoE forward routes tokens over (one slice per expert, `gate_up_proj[expert_idx]`), and it is
    # the one number transformers sizes them from. A leading dim > 1 alone is not enough: RecurrentGemma's RG-LRU
    # gates [heads, width, width] (a per-head batched matmul), torch weight_norm's `original1` [out, in, kernel]
    # (Wav2Vec2's pos_conv_embed) and stacked tables are 3-D as well; they get their own coverage rows
    # (layers/outside.py). Convolutions hold 3-D weights too and are another kind.
    if isinstance(module, torch_compat.ConvNd):
        return False
    # the 3-D parameters first: asking every module for six missing attributes (nn.Module.__getattr__ raising) was
    # ~0.1 s of SmolLM2-135M's CPU fit start (kind_of runs on every module of every walk; session 34)
    three_d = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if not three_d:
        return False
    counts = expert_counts(module)
    return any(p.shape[0] in counts for p in three_d)


def _prepare(module: nn.Module) -> Optional[nn.Module]:
    return LinearExperts.from_transformers(module) if supported(module) else None  # None: named by the coverage table


def _adaptable(layer: nn.Module) -> list[str]:
    if not _is_experts(layer):
        return [""]  # one expert's Linear of a prepared layer
    if not supported(layer):
        return []  # stays as it is: named by the coverage table's warning
    return expert_linears(cast(torch.Tensor, layer.gate_up_proj).shape[0])


EXPERTS = register_kind(
    LayerKind(
        name="Experts (3-D parameters)",
        matches=_is_experts,
        # prepare() turns a supported experts layer into one Linear per expert and projection, tagged
        # with this kind; those are quantized and adapted like any Linear
        to_linear=lambda linear: cast(nn.Linear, linear),
        prepare=_prepare,
        as_built_keys=lambda new: cast(LinearExperts, new).as_built_keys(),
        adaptable_names=_adaptable,
        quantized_as="replaced by `LinearExperts`: the same routing loop, one Linear per expert and projection "
        "(equal outputs and gradients), each quantized",
        adapted_as="each expert's `gate_up_proj.e` / `down_proj.e` Linear",
        option="only transformers-5 experts in the default layout (concatenated gate/up, no bias, transposed or not) are converted; "
        "this one stays at full size in the parameters term: exclude it knowingly or train a model whose experts "
        "are nn.Linear layers",
        modules="3-D expert parameters",
        found_in="transformers-5 MoE (Mixtral, Qwen-MoE, ...)",
        planned_as="one Linear per expert; on fake tensors (no routing) the load that needs the most memory: the first "
        "and the last expert get every token, the others share the rest",
    )
)

__all__ = [
    "EXPERTS", "PROJECTIONS", "LinearExperts", "balanced_load", "convertible_experts", "expert_counts", "expert_linears", "expert_names",
    "routed_tokens", "supported",
]
