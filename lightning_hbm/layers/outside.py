"""The coverage table's rows for weights outside any layer kind: raw weight matrices a module's own code uses, MoE
routers, parametrized weights, 3-D weights that are not experts, position tables. Each row says why its weights are
left alone, whether by choice, and what to do when it is warned about (:data:`OUTSIDE`)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hbm.layers.finding import expert_counts
from lightning_hbm.layers.source_scan import attribute_uses

RAW_WEIGHTS = "weights outside any layer"
RAW_WEIGHTS_REASON = "Parameters of 2+ dimensions used by their module's own code (no layer kind lightning_hbm knows)"
ROUTER_WEIGHTS = "router (F.linear)"
PARAMETRIZED_WEIGHTS = "parametrized weights"
GROUPED_WEIGHTS = "3-D weights, not experts"
POSITION_TABLES = "position tables"
#: Rows of the coverage table for Parameters outside any layer kind: (reason, deliberate, what to do when warned).
OUTSIDE: dict[str, tuple[str, bool, str]] = {
    RAW_WEIGHTS: (
        RAW_WEIGHTS_REASON,
        False,
        "Parameters of {names}, which their module's own code uses (no nn.Linear or other layer kind). They stay at full "
        "size in the parameters term: exclude them knowingly, or use a model whose weights are nn.Linear layers",
    ),
    ROUTER_WEIGHTS: (
        "MoE router: a Parameter its module's forward applies with F.linear (one logit per expert, no nn.Linear); kept in "
        "full precision, as routers are (quantized routing changes which experts run), and not adapted",
        True,
        "routers of {names}: kept in full precision on purpose",
    ),
    PARAMETRIZED_WEIGHTS: (
        "factors of a weight computed by a torch parametrization (weight_norm's g and v, parametrize's original0/1): "
        "the layer's weight is recomputed from them at every call, so there is nothing fixed to quantize and LoRA "
        "does not reach them",
        False,
        "factors of {names}. They stay at full size in the parameters term: QuantizedPrecision folds a convolution's "
        "weight_norm into one quantized weight; else remove the parametrization before training "
        "(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight') or torch.nn.utils.remove_weight_norm) to "
        "make each an ordinary layer, or exclude them knowingly",
    ),
    GROUPED_WEIGHTS: (
        "{shape} Parameter of a module whose own code uses 3-D Parameters whose leading dim is no expert count (no "
        "nn.Linear, no experts layer): there is no quantized form for a 3-D Parameter that is no expert stack, so it is "
        "kept at full size, with no adapter (for example RecurrentGemma's RG-LRU per-head gates [heads, in, out])",
        False,
        "3-D weights of {names}, used in their module's own batched matmul. They are not experts (no MoE advice "
        "applies): they stay at full size in the parameters term; exclude them knowingly",
    ),
    POSITION_TABLES: (
        "tables their module adds to the activations (learned positions), not multiplied: kept in full precision like "
        "the embeddings",
        True,
        "tables of {names}: kept in full precision on purpose",
    ),
}
OUTSIDE_ROWS = tuple(OUTSIDE)


def outside_reason(row: str, param: nn.Parameter) -> str:
    """The coverage table's reason for ``param`` in ``row`` of :data:`OUTSIDE`; a 3-D weight's names its own shape
    (was: RecurrentGemma's gates cited for any 3-D Parameter, Swin-V2's ``logit_scale`` [heads, 1, 1] included)."""
    reason = OUTSIDE[row][0]
    return reason.format(shape=list(param.shape)) if row == GROUPED_WEIGHTS else reason


def _is_raw_weight(param: nn.Parameter) -> bool:
    # a matrix (or stack of them) of at least 2 rows; a [1, tokens, width] table broadcast over the batch (ViT
    # cls_token / pos_embed, SigLIP's probe, RWKV's time mixes) is an embedding
    return param.dim() >= 2 and param.shape[0] > 1 and param.is_floating_point()


def outside_kinds(module: nn.Module, candidates: set[int]) -> dict[int, str]:
    """``{id(parameter): row}`` for the weight-like Parameters among ``candidates`` (no layer kind holds them)."""
    found: dict[int, str] = {}
    for parent in module.modules():
        # a router scores one logit per expert: its weight's rows are the expert count of an experts layer beside it
        counts = {n for child in parent.children() for n in expert_counts(child)}
        for owner in parent.children():
            weight_norm = any(type(hook).__name__ == "WeightNorm" for hook in owner._forward_pre_hooks.values())
            listed = isinstance(owner, torch.nn.utils.parametrize.ParametrizationList)
            # weight_norm's g ([out, 1, 1], or [1, 1, k] along another dim) goes with its v, whatever its shape
            factors = {n for n, p in owner.named_parameters(recurse=False) if p.is_floating_point() and (listed or weight_norm and n.endswith(("_g", "_v")))}
            own = [(n, p) for n, p in owner.named_parameters(recurse=False) if id(p) in candidates and (n in factors or _is_raw_weight(p))]
            if not own:
                continue  # nothing to classify: no need to parse the class's source (seconds over a model's classes)
            uses = attribute_uses(type(owner))  # type: ignore[arg-type]  # mypy: a class is not Hashable (lru_cache)
            grouped = any(p.dim() == 3 and "matmul" in uses.get(n, {"matmul"}) for n, p in own)
            for local, param in own:
                if local in factors:
                    found[id(param)] = PARAMETRIZED_WEIGHTS
                elif param.dim() == 2 and param.shape[0] in counts:
                    found[id(param)] = ROUTER_WEIGHTS
                elif uses.get(local) == frozenset({"add"}):
                    found[id(param)] = POSITION_TABLES
                else:
                    found[id(param)] = GROUPED_WEIGHTS if grouped else RAW_WEIGHTS
    for name, param in module.named_parameters(recurse=False):  # the root's own (no parent to look from)
        if id(param) in candidates and _is_raw_weight(param):
            found.setdefault(id(param), POSITION_TABLES if attribute_uses(type(module)).get(name) == frozenset({"add"}) else RAW_WEIGHTS)  # type: ignore[arg-type]  # mypy: a class is not Hashable (lru_cache)
    return found


__all__ = [
    "GROUPED_WEIGHTS",
    "OUTSIDE",
    "OUTSIDE_ROWS",
    "PARAMETRIZED_WEIGHTS",
    "POSITION_TABLES",
    "RAW_WEIGHTS",
    "RAW_WEIGHTS_REASON",
    "ROUTER_WEIGHTS",
    "outside_kinds",
    "outside_reason",
]
