"""The inputs each expert of a mixture of experts really sees on the probe batch, for its GPTQ rounding and its calibrated correction.

What it shrinks: nothing; it lets ``QuantizedPrecision(rounding="gptq")`` round and ``correction_rank=r`` correct the
experts (issue 52). The surgery turns a transformers-5 experts layer (two 3-D Parameters) into
:class:`~lightning_hbm.layers.experts.LinearExperts`, one Linear per expert and projection, *after* the probe forward
that measures every target's input statistics (nothing changes before the checks are done). So the experts are
measured on the model as built: while :class:`ExpertInputs` is open, a forward hook on each experts layer takes what
its router handed it (``hidden_states``, ``top_k_index``) and runs transformers' own loop
(:func:`~lightning_hbm.layers.experts.routed_tokens`, the routing ``LinearExperts`` computes with): expert ``e``'s
``gate_up_proj.e`` sees the rows of the tokens routed to it, its ``down_proj.e`` ``act(gate) * up`` of those rows.
Each expert's statistics are those of the tokens routed to it, nothing else (an expert's input covariance differs from
the layer's: the router picks tokens by their direction).

An expert no probe token reached gets zero statistics of its shape (rows 0): every rank pools the same layers
(:func:`~lightning_hbm.precision.gptq.pooled_across_ranks`). GPTQ and the correction each name the experts routed too
few tokens for them (fewer than :data:`~lightning_hbm.precision.gptq.EXPERT_MIN_TOKENS`: nearest rounding; fewer than
the rank: no correction). Which layers are experts, and the names of the Linears they become, are the layer kind's
(:func:`~lightning_hbm.layers.experts.convertible_experts`, :func:`~lightning_hbm.layers.experts.expert_names`), found
once by the measures and handed on.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hbm.layers.experts import PROJECTIONS, routed_tokens


def _weights(layer: nn.Module, expert: int) -> tuple[Tensor, Tensor]:
    """Expert ``expert``'s ``gate_up`` ``[2 * intermediate, hidden]`` and ``down`` ``[hidden, intermediate]`` as Linear
    weights (a transposed layout, ``[experts, in, out]``, read transposed, as ``LinearExperts.from_transformers`` does)."""
    gate_up, down = cast(Tensor, layer.gate_up_proj)[expert], cast(Tensor, layer.down_proj)[expert]
    return (gate_up.t(), down.t()) if getattr(layer, "is_transposed", False) else (gate_up, down)


class ExpertInputs:
    """While open (a context manager), each expert's inputs on every call of the experts layers ``experts`` go to
    ``add(name, layer, x)`` (``_Sums.add`` of :func:`~lightning_hbm.precision.gptq.input_statistics`); at the close an
    expert never reached gets a zero-row input of its width (module docstring).

    Args:
        experts: ``{name: transformers experts layer}`` (:func:`~lightning_hbm.layers.experts.convertible_experts`).
        add: where each input goes.
    """

    def __init__(self, experts: Mapping[str, nn.Module], add: Callable[[str, nn.Module, Tensor], None]) -> None:
        self.experts, self.add = dict(experts), add
        self.reached: set[str] = set()
        self.handles: list[Any] = []

    def __enter__(self) -> ExpertInputs:
        self.handles = [layer.register_forward_hook(self._hook(name), with_kwargs=True) for name, layer in self.experts.items()]
        return self

    def _hook(self, name: str) -> Callable[..., None]:
        def record(layer: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            with torch.no_grad():
                for expert, _, token_idx in routed_tokens(index, cast(Tensor, layer.gate_up_proj).shape[0]):
                    gate_up, down = _weights(layer, expert)
                    x = hidden[token_idx]
                    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
                    act = cast(Callable[[Tensor], Tensor], layer.act_fn)
                    for proj, inputs in zip(PROJECTIONS, (x, act(gate) * up)):  # LinearExperts' Linears, by name
                        self.add(f"{name}.{proj}.{expert}", layer, inputs)
                        self.reached.add(f"{name}.{proj}.{expert}")

        return record

    def __exit__(self, *exc: Any) -> None:
        """Remove the hooks; give each expert never reached zero rows (its statistics exist on every rank)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for name, layer in self.experts.items():
            for expert in range(cast(Tensor, layer.gate_up_proj).shape[0]):
                gate_up, down = _weights(layer, expert)
                for proj, weight in zip(PROJECTIONS, (gate_up, down)):
                    if f"{name}.{proj}.{expert}" not in self.reached:
                        self.add(f"{name}.{proj}.{expert}", layer, weight.new_zeros((0, weight.shape[1]), dtype=torch.float32))


__all__ = ["ExpertInputs"]
