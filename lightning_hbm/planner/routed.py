"""The experts a traced step did not route to (and the layers it dropped): their optimizer states are counted all the same.

A mixture-of-experts layer runs, in one step, the experts its router picks for the batch (transformers Switch
Transformers' and NLLB-MoE's ``experts`` ``ModuleDict``, a hand-written ``nn.ModuleList`` of experts); the others get
no gradient in that step. A long run routes tokens to every expert, and Adam keeps the states of every parameter it
has ever updated: in the steady state every trainable expert parameter has its optimizer states, while the gradients
alive at the peak are still one step's (the routed experts'). The planner's first step gives those experts states
(:func:`~lightning_hbm.planner.tracing._first_step_state`) and drops their gradient again.

Which modules count is decided by what the structure-deciding forward ran
(:func:`~lightning_hbm.planner.tracing._gradient_receivers`), not by names: a child of an ``nn.ModuleList`` or
``nn.ModuleDict`` that did not run while a sibling of its class did. That is a router's pick (Switch, NLLB-MoE) or a
layer LayerDrop skipped in that step (NLLB-MoE's ``decoder_layerdrop``, Wav2Vec2's ``layerdrop``: a long run updates
every layer): a later step may run it. Not counted: a
module that ran and whose output the loss drops (LLaVA's last vision layer under ``vision_feature_layer=-2``: it runs
in every step and never gets a gradient), and a head or any module outside such a list that never runs. A list the
model cuts at a configured depth (``layers[:n]`` with ``n`` below its length, found in no transformers model whose
cut-off children hold parameters) would be counted whole: a plan over, never under.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class Routed:
    """What :func:`routed_away` found: the ids of the trainable parameters of the experts one step did not route to
    (``ids``), and per container, by name, how many of its experts that is (``containers``)."""

    ids: set[int] = field(default_factory=set)
    containers: dict[str, str] = field(default_factory=dict)


@contextmanager
def modules_run() -> Iterator[set[int]]:
    """The ``id`` of every module whose forward is called inside (a process-wide forward pre-hook, removed after)."""
    ran: set[int] = set()

    def seen(module: nn.Module, args: Any) -> None:
        ran.add(id(module))

    handle = nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        yield ran
    finally:
        handle.remove()


def routed_away(model: nn.Module, ran: set[int], reached: set[int]) -> Routed:
    """The trainable parameters, not in ``reached``, of the experts of ``model`` a step did not run (``ran``: ids of
    the modules it ran, :func:`modules_run`); see the module's docstring for which children count."""
    found = Routed()
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        by_kind: dict[type, list[nn.Module]] = {}
        for child in container.children():
            by_kind.setdefault(type(child), []).append(child)
        said = []
        for kind, alike in by_kind.items():
            skipped = [child for child in alike if id(child) not in ran]
            if len(skipped) == len(alike):  # none of its class ran: nothing says a step runs them
                continue
            params = {id(p) for child in skipped for p in child.parameters() if p.requires_grad and id(p) not in reached}
            if params:
                found.ids |= params
                said.append(f"{len(skipped)} of {len(alike)} {kind.__name__} not run by the traced step")
        if said:
            found.containers[name] = "; ".join(said)
    return found
