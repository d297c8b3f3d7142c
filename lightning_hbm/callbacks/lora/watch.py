"""Dead adapters found at the first backward."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_hbm.callbacks.lora.base import _lora_layer_cls
from lightning_hbm.naming import name_list


class _AdapterWatch:
    """Finds dead adapters at the first backward: a LoRA layer that got no gradient is an error naming it.

    Two ways an adapter dies, told apart by forward hooks on each LoRA layer and on its parent:
    the layer ran but no gradient reached its ``lora_A``/``lora_B`` (the graph is cut), or the parent
    ran and the layer did not (the parent reads the wrapped weight directly, as
    ``nn.MultiheadAttention`` does with ``out_proj``). A layer whose parent did not run either (an
    expert no token was routed to, a branch not taken) cannot be judged and is not an error.
    """

    def __init__(self, module: nn.Module) -> None:
        lora_cls = _lora_layer_cls()
        # peft's LoraLayer modules (a class looked up at run time, typed `type`): their lora_A/lora_B are ModuleDicts
        self.layers: dict[str, Any] = {n: m for n, m in module.named_modules() if isinstance(m, lora_cls)}
        self.ran: set[int] = set()
        self.handles: list[Any] = []
        self.parents = {n: module.get_submodule(n.rpartition(".")[0]) if "." in n else module for n in self.layers}
        watched = {id(m): m for m in [*self.layers.values(), *self.parents.values()]}
        for sub in watched.values():
            self.handles.append(sub.register_forward_pre_hook(self._ran))

    def _ran(self, module: nn.Module, args: Any) -> None:
        self.ran.add(id(module))

    def check(self) -> list[str]:
        """Raise for dead adapters; warn for (and return) the ones whose output never reaches the loss."""
        for handle in self.handles:
            handle.remove()
        dead, cut = [], []
        for name, layer in self.layers.items():
            grads = [p.grad for c in (layer.lora_A, layer.lora_B) for p in c.parameters() if p.requires_grad]
            if not grads or any(g is not None for g in grads):
                continue
            if id(layer) in self.ran:
                cut.append(name)
            elif id(self.parents[name]) in self.ran:
                dead.append(name)
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
                f"{name_list(cut)}. They stay at their initial value (lora_B = 0, no effect). To not create them, pass "
                f"LoRA(exclude_modules={sorted(cut)!r})."
            )
        return cut
