"""``QuantizedFSDPStrategy``: shard a quantized base + trainable adapters across ranks with torch FSDP2.

What it shrinks, per rank: the **parameters**, **gradients** and **optimizer states** terms, each
divided by the number of ranks (the frozen base is quantized first by ``QuantizedPrecision``, then
sharded). Activations are not sharded (use ``ActivationCheckpointing`` for those).

Why not Lightning's ``FSDPStrategy``: it rejects every precision plugin that is not an
``FSDPPrecision`` (Lightning issue 20855) and refuses the CPU accelerator. We build on Lightning's
``ModelParallelStrategy`` instead, which is torch's FSDP2 (``fully_shard``, DTensor parameters):

* FSDP2, not FSDP1: FSDP1 flattens each unit into one buffer and needs a uniform storage dtype
  (bitsandbytes ``quant_storage`` equal to the compute dtype) plus ``use_orig_params``. FSDP2
  shards every parameter on its own along dim 0, so the packed uint8 4-bit weights shard next to
  bf16/fp32 norms and adapters as they are: no ``quant_storage`` change is needed (checked on CPU:
  2-rank loss equals the 1-rank loss). The quantization constants (``quant_state``: absmax, code
  book) stay on the ``Linear4bit`` module, replicated on every rank (~3% of the 4-bit bytes with
  nf4-dq, ~12.5% with nf4: each rank holds payload / N + all constants);
  bitsandbytes restores them on the all-gathered weight in every forward
  (``fix_4bit_weight_quant_state_from_module``).
* Input embeddings stored in int8 (``QuantizedPrecision``'s default) or 4-bit shard the same way: the table is the
  storage layer's weight (``lightning_hbm.layers.embedding``), its packed rows sharded along dim 0, its row scales (or
  4-bit constants) whole on every rank, gathered with the unit for the lookup. A head tied to it
  (``TiedHead``) multiplies with that one gathered copy, so it must run inside the embedding's unit (a causal LM's
  top-level model holding both): checked before sharding (``_check_tied_heads``).
* int8 Linears (``QuantizedPrecision("int8")``: bitsandbytes ``Linear8bitLt``) shard the same way, rows along dim 0,
  row scales whole on the layer; bitsandbytes' forward reads the rows from ``weight.CB``, which FSDP2's gathered weight
  lacks, so each layer's state is handed the gathered rows before its forward
  (``lightning_hbm._compat.bitsandbytes.shard_int8_layers``).
* It runs on CPU with gloo (``init_device_mesh("cpu")``), so the same
  ``Trainer(strategy="fsdp_qlora")`` is tested on two CPU processes and used unchanged on GPUs.
* The user's model is not touched: ``ModelParallelStrategy`` asks the user to call
  ``fully_shard`` in ``configure_model``; this strategy calls it itself, after lightning_hbm's
  surgery (``precision_plugin.convert_module``: quantize -> LoRA -> checkpointing -> kernels) and
  before ``configure_optimizers``, so the user's optimizer sees the sharded trainable parameters.

Checkpoints are gathered to rank 0 in the ordinary single-file format and hold only what is trained
(``requires_grad`` parameters: LoRA adapters, or norms/embeddings/biases without LoRA) plus full
optimizer states in ``torch.optim`` format. The frozen base is not saved: it is rebuilt from the
user's model when the run resumes, as in QLoRA. Such a checkpoint resumes on any number of ranks,
including a single device without this strategy (the surgery spine loads it after the surgery).
Lightning restores a checkpoint after this strategy's setup, i.e. after the surgery: the tensors' CRCs and the
file are checked, but the settings and frozen-base fingerprints that lightning_hbm compares on a single device
or DDP (lightning_hbm/resume/) are not compared here.

Example::

    trainer = Trainer(accelerator="gpu", devices=4, strategy="fsdp_qlora",
                      plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")], callbacks=[LoRA(r=16)])
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hbm import resume
from lightning_hbm._compat import _PATH, _materialize_distributed_module, _optimizers_to_device
from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._validate import check_args
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.layers.embedding import TiedHead
from lightning_hbm.optim import OPTIMIZER_KINDS, MemoryEfficientOptimizer

log = logging.getLogger(__name__)

class QuantizedFSDPStrategy(ModelParallelStrategy):
    """Fully sharded data parallel (torch FSDP2) for quantized bases with trainable adapters.

    Args:
        shard_modules: class names of the submodules that become one FSDP unit each (one
            all-gather per unit in forward and backward), e.g. ``["LlamaDecoderLayer"]``. Default
            (``None``): every module held in an ``nn.ModuleList`` (the transformer blocks of
            nanoGPT, Llama, ...) and the repeated blocks held in an ``nn.Sequential`` (torchvision's
            ViT, timm, a LightningModule's own ``nn.Sequential(*blocks)``: :func:`sequential_blocks`).
            The rest of each top-level submodule (embeddings, final norm, head) forms one more unit.
            A name that matches no submodule is an error.
        cpu_offload: keep the parameter shards, their gradients and the optimizer states in CPU
            memory (FSDP2 ``CPUOffloadPolicy``); the optimizer steps on the CPU. Shrinks the
            device's parameters/gradients/optimizer-states terms to the unit being computed.
        reshard_after_forward: free each unit's gathered weights after its forward (``True``,
            gathers again in backward: least memory) or keep them until backward (``False``: one
            all-gather fewer per unit, the whole gathered model stays alive between forward and
            backward).
        process_group_backend: ``"nccl"`` / ``"gloo"``; default: the accelerator's (gloo on CPU).
        timeout: timeout of the collectives.

    Logs nothing itself. Registered as ``strategy="fsdp_qlora"``.
    """

    strategy_name = "fsdp_qlora"

    def __init__(
        self,
        shard_modules: Optional[list[str]] = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        check_args(QuantizedFSDPStrategy.__init__, locals())
        if shard_modules is not None and (
            isinstance(shard_modules, str) or not all(isinstance(n, str) and n for n in shard_modules)
        ):
            raise TypeError(
                f"shard_modules must be a list of module class names such as ['LlamaDecoderLayer'], got "
                f"{shard_modules!r}."
            )
        super().__init__(
            # pure data parallel: the sizes are fixed to (world size, 1) in setup_environment
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,  # one file, gathered on rank 0 (see module docstring)
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.checkpoint_io = resume.CheckedCheckpointIO()  # rank 0 writes the gathered file atomically
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward

    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy's "auto" means data parallel across nodes, tensor parallel inside
        # a node. Sharding only (no tensor parallel): every rank is one data-parallel replica.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, minus its requirement that the user shards the model in
        # configure_model: here the strategy shards, after lightning_hbm's surgery.
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        _choose_units(self.model, self.shard_modules)  # validate before changing anything
        full = [type(cb).__name__ for cb in trainer.callbacks if getattr(cb, "full_checkpoint", False)]  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        if full:
            raise ValueError(
                f"{full[0]}(full_checkpoint=True) asks for the frozen base in every checkpoint, but "
                "QuantizedFSDPStrategy saves only the trainable weights (gathered on rank 0; the base is rebuilt "
                "from your model on resume). Use full_checkpoint=False, or save the merged model after fit."
            )
        eight_bit = [cb for cb in trainer.callbacks if isinstance(cb, MemoryEfficientOptimizer)]  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        if eight_bit:  # known now: refused before the model changes, not after quantizing and sharding it
            raise self._bnb_refusal(OPTIMIZER_KINDS[eight_bit[0].kind][0])
        _materialize_distributed_module(self.model, self.root_device)
        # Quantize -> LoRA -> checkpointing -> kernels (lightning_hbm/surgery/), on the full model.
        # Without the mesh ModelParallelStrategy put on the LightningModule meanwhile (peft reads it as tensor parallel)
        with lightning_compat.device_mesh_hidden(self.model):
            self.model = self.precision_plugin.convert_module(self.model)
        if not self.cpu_offload:
            self.model_to_device()
        self._broadcast_trainable(self.model)
        # chosen again: the surgery replaced layers (the check above ran on the model as built)
        self._shard(self.model, _choose_units(self.model, self.shard_modules))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()  # runs the optimizer transforms (e.g. MemoryEfficientOptimizer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_optimizers()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_optimizers(self) -> None:
        """bitsandbytes optimizers call kernels that have no DTensor rule: fail now, not at step 1."""
        for optimizer in self.optimizers:
            optimizer = lightning_compat.unwrap_optimizer(optimizer)
            if type(optimizer).__module__.startswith("bitsandbytes"):
                raise self._bnb_refusal(type(optimizer).__name__)

    def _bnb_refusal(self, name: str) -> ValueError:
        return ValueError(
            f"{name} (bitsandbytes) cannot step FSDP2-sharded (DTensor) parameters: its "
            "kernels have no sharding rule. Sharding already splits the optimizer states over the "
            f"{self.world_size} rank(s): use a torch.optim optimizer and drop MemoryEfficientOptimizer, or "
            "keep the 8-bit optimizer with strategy='ddp'."
        )

    def _broadcast_trainable(self, module: nn.Module) -> None:
        """Start every rank from rank 0's trainable weights, as DDP does when it wraps a model.

        FSDP2 has no ``sync_module_states``: each rank shards its *own* copy, so adapters initialized
        from a different RNG state on another rank would silently give a model no rank ever had.
        Only trainable tensors (adapters: small) are sent; the frozen base is already rank 0's (the
        surgery sends the model as built before quantizing: ``lightning_hbm.surgery.ranks``).
        """
        if self.world_size == 1:
            return
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # already sharded (validate/test after fit)
        with torch.no_grad():
            for param in module.parameters():
                if param.requires_grad:
                    # NCCL only sends device tensors: with cpu_offload the weights are still on the host
                    buffer = param.data.to(self.root_device)
                    torch.distributed.broadcast(buffer, src=0)
                    param.data.copy_(buffer)

    def _shard(self, module: nn.Module, units: list[nn.Module]) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # trainer.validate/test after fit: already sharded
        # Pinned memory needs a CUDA build; on CPU the "offload" keeps tensors where they are.
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        mesh = self.device_mesh["data_parallel"]
        kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
        _check_tied_heads(module, units)  # before any module is sharded
        bnb_compat.shard_int8_layers(module)  # int8 Linears: row scales whole on the layer, the gathered rows handed over
        for unit in units:
            fully_shard(unit, **kwargs)
        # One more unit per top-level child holding the remaining parameters (embeddings, head).
        for child in _remainder_units(module):
            fully_shard(child, **kwargs)
        log.info("lightning_hbm: FSDP2 sharded %d units over %d ranks", len(units), mesh.size())

    # ----------------------------------------------------------------------------------------
    # Checkpoints: trainable parameters + optimizer states, full tensors, one file from rank 0.
    # Written by hand rather than torch.distributed.checkpoint.state_dict: get_model_state_dict
    # would gather the frozen 4-bit base too (and bitsandbytes' state_dict hooks expect a
    # Params4bit, not a DTensor), and Lightning's full optimizer format numbers the parameters
    # among *all* module parameters, which does not load into the single-device optimizer after
    # frozen parameters are pruned. Here the optimizer keeps its own torch.optim format.
    # ----------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full tensors of the trainable parameters (collective; non-empty on rank 0 only)."""
        assert self.model is not None
        state = {}
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                full = _full(param.detach())  # every rank takes part in the all-gather
                if self.is_global_zero:
                    state[name] = full.cpu()
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's ``state_dict`` with every sharded state gathered (collective)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        state_dict = optimizer.state_dict()
        state = {
            index: {key: _full(value).cpu() if isinstance(value, torch.Tensor) else value for key, value in s.items()}
            for index, s in state_dict["state"].items()
        }
        if not self.is_global_zero:
            return {}
        return {"state": state, "param_groups": state_dict["param_groups"]}

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            raise ValueError(
                f"ckpt_path={str(path)!r} is a directory (a sharded checkpoint). QuantizedFSDPStrategy reads the "
                "single-file checkpoints it writes (gathered on rank 0): pass the .ckpt file."
            )
        checkpoint = resume.read_file(path, weights_only=weights_only)  # checked and verified by resume, as on one device
        assert self.model is not None
        if cast(pl.LightningModule, self.lightning_module).trainer.state.fn == TrainerFn.FITTING:
            # Lightning restores after this strategy's setup (the surgery already ran: trainer.ckpt_path is not known
            # before), so the settings and base fingerprints are checked here, before any tensor is loaded or step run
            resume.check_resume(cast(pl.LightningModule, self.lightning_module).trainer, cast(pl.LightningModule, self.lightning_module), checkpoint.get(resume.META_KEY), path)
        self._load_trainable(_trainable_part(checkpoint))
        optimizer_states = checkpoint.pop("optimizer_states", [])
        if cast(pl.LightningModule, self.lightning_module).trainer.state.fn == TrainerFn.FITTING and optimizer_states:
            for optimizer, full_state in zip(self.optimizers, optimizer_states):
                optimizer.load_state_dict(_shard_optimizer_state(optimizer, full_state))
        return checkpoint

    def _load_trainable(self, state_dict: Mapping[str, Any]) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        assert self.model is not None
        params = dict(self.model.named_parameters())
        frozen = {name for name, p in params.items() if not p.requires_grad}
        frozen |= {name for name, _ in self.model.named_buffers()}
        unknown = [
            key for key in state_dict if key not in params and not any(key.startswith(f + ".") for f in frozen)
        ]
        lacking = [name for name, p in params.items() if p.requires_grad and name not in state_dict]
        if unknown or lacking:
            raise ValueError(
                "The checkpoint does not fit the model after lightning_hbm's changes: "
                f"keys the model lacks {unknown[:10]}, trainable parameters the checkpoint lacks {lacking[:10]}. "
                "Resume with the same precision mode and LoRA settings as the run that saved it."
            )
        with torch.no_grad():
            for name, param in params.items():
                if not param.requires_grad:
                    continue  # the frozen base was rebuilt from the user's model
                full = state_dict[name].to(dtype=param.dtype)
                if isinstance(param, DTensor):
                    full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
                param.copy_(full)


def _trainable_part(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's weights for :meth:`QuantizedFSDPStrategy._load_trainable` (CRCs verified by ``resume.read_file``).

    lightning_hbm writes checkpoints in two parts (:mod:`lightning_hbm.resume`): ``state_dict`` holds what
    fits the model as built (plus placeholders), ``checkpoint["lightning_hbm"]["state_dict"]`` the tensors
    of the changed model (the adapters). This strategy restores after its surgery, into the changed model:
    both parts, without the placeholders. A plain checkpoint (no second part) is read as it is.
    """
    state_dict = checkpoint.pop("state_dict", {})
    meta = checkpoint.get(resume.META_KEY)
    if meta is None:
        return state_dict
    placeholders = set(meta.get("placeholders", []))
    trainable = {k: v for k, v in state_dict.items() if k not in placeholders}
    trainable.update(meta.get("state_dict", {}))
    return trainable


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _shard_optimizer_state(optimizer: Optimizer, full_state: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a gathered (or single-device) optimizer state into this rank's shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for index, per_param in full_state["state"].items():
        param = params[int(index)]
        state[index] = {}
        for key, value in per_param.items():
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
                value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            state[index][key] = value
    return {"state": state, "param_groups": full_state["param_groups"]}


def _is_container(module: nn.Module) -> bool:
    """A ``ModuleList``/``ModuleDict`` without ``forward``: torch's own test before ``fully_shard`` refuses it."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def _remainder_units(module: nn.Module) -> list[nn.Module]:
    """Children of ``module`` that hold parameters outside any unit yet (embeddings, head, ...).

    A container (``self.blocks = nn.ModuleList(...)`` on the LightningModule) cannot be a unit: the
    members it holds are, each on its own.
    """
    return [unit for _, unit in remainder_units(module)]


def remainder_units(module: nn.Module, units: Sequence[nn.Module] = ()) -> list[tuple[str, nn.Module]]:
    """The units :class:`QuantizedFSDPStrategy` makes of the parameters outside ``units`` (the repeated blocks) and
    outside any module already sharded, by name: each child of ``module`` holding parameters (a container's members,
    each on its own). The planner reads them before any sharding (``Prediction.per_rank``): a causal LM's ``model``
    around the blocks, or a backbone and a head side by side, each gathered while its own forward and backward run."""
    from torch.distributed.fsdp import FSDPModule

    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if isinstance(child, FSDPModule) or any(child is u for u in units) or not any(True for _ in child.parameters()):
            continue
        inner = [(f"{name}.{n}", m) for n, m in remainder_units(child, units)] if _is_container(child) else [(name, child)]
        found += inner
    return found


def _check_tied_heads(module: nn.Module, units: list[nn.Module]) -> None:
    """A head tied to a quantized embedding (:class:`~lightning_hbm.layers.embedding.TiedHead`: no weight of its own,
    it multiplies with the embedding's table) must run inside the embedding's FSDP unit, where FSDP2 has gathered the
    table (forward, and backward through the unit's output): a causal LM's top-level model holding both. Elsewhere it
    would read a shard. ``QuantizedPrecision``'s default keeps such tables wide under FSDP (warned); this refuses
    the rest (an explicit ``quantize_embeddings``) before any module is sharded."""
    remainder = _remainder_units(module)
    for name, head in module.named_modules():
        if not isinstance(head, TiedHead):
            continue
        embedding = head.__dict__["embedding"]
        unit = next((u for u in units + remainder if _holds(u, embedding)), None)
        if unit is None or not _holds(unit, head):
            raise ValueError(
                f"{name} is tied to a quantized input embedding, but QuantizedFSDPStrategy puts them in different FSDP "
                "units (units are the shard_modules and the top-level children of the LightningModule): the head would "
                "read a shard of the table. Hold both in one submodule (as a causal LM's model does), or pass "
                "QuantizedPrecision(quantize_embeddings=False) to keep the tied table wide."
            )


def _holds(module: nn.Module, target: nn.Module) -> bool:
    return any(m is target for m in module.modules())


def _choose_units(module: nn.Module, shard_modules: Optional[list[str]]) -> list[nn.Module]:
    """The submodules that become one FSDP unit each; validates the model before anything changes."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters directly ({own[:5]}), outside any submodule. "
            "QuantizedFSDPStrategy shards submodules (Lightning calls training_step, not forward, so the "
            "LightningModule itself cannot be an FSDP unit): move them into a submodule."
        )
    named = list(module.named_modules())
    if shard_modules is None:
        units = default_units(module)
    else:
        found = {type(m).__name__ for _, m in named}
        unknown = [n for n in shard_modules if n not in found]
        if unknown:
            raise ValueError(
                f"shard_modules={shard_modules!r}: {unknown} match no submodule class of {type(module).__name__}. "
                f"Module classes in the model: {sorted(found)[:20]}."
            )
        containers = [m for _, m in named if _is_container(m) and type(m).__name__ in shard_modules]
        if containers:
            members = sorted({type(m).__name__ for m in containers[0].children()})
            raise ValueError(
                f"shard_modules={shard_modules!r}: {type(containers[0]).__name__} is a container without forward, "
                f"which torch's fully_shard cannot make a unit: name the blocks it holds, e.g. {members[:3]}."
            )
        units = [(n, m) for n, m in named if type(m).__name__ in shard_modules]
    # fully_shard manages every parameter not yet managed below it: shard the innermost units first.
    units.sort(key=lambda item: item[0].count("."), reverse=True)
    return [m for _, m in units]


def default_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules :class:`QuantizedFSDPStrategy` makes one FSDP unit each by default (``shard_modules=None``), by
    name, in module order: every member of an ``nn.ModuleList`` holding parameters (not a container itself) and the
    repeated blocks of an ``nn.Sequential`` (:func:`sequential_blocks`). No check: :func:`_choose_units` validates."""
    named = list(module.named_modules())
    lists = {name for name, m in named if isinstance(m, nn.ModuleList)}
    units = [(n, m) for n, m in named
             if n and n.rpartition(".")[0] in lists and not _is_container(m) and any(True for _ in m.parameters())]
    return units + sequential_blocks(module, exclude={n for n, _ in units})


def inner_units(module: nn.Module, blocks: Sequence[nn.Module], holder: Optional[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The default units inside ``holder`` (the unit around the ``blocks``: a model's backbone) that are neither a block
    nor hold one nor lie inside one, by name: transformers ConvNext's ``downsampling_layer`` members (a LayerNorm and a
    Conv2d in a stage's ``nn.ModuleList``), each gathered only while its own forward and backward run. The planner reads
    them before any sharding (``Prediction.inner_units``); a unit holding blocks (ConvNext's stages) is not one: its own
    parameters are planned with the unit around the blocks."""
    if holder is None:
        return []
    ids = {id(b) for b in blocks}
    return [(name, unit) for name, unit in default_units(module)
            if unit is not holder and _holds(holder, unit) and not ids & {id(m) for m in unit.modules()}
            and not any(_holds(b, unit) for b in blocks)]


def sequential_blocks(module: nn.Module, exclude: Collection[str] = ()) -> list[tuple[str, nn.Module]]:
    """The repeated blocks held in an ``nn.Sequential`` (:func:`~lightning_hbm.layers.blocks.find_blocks`: a
    LightningModule's ``self.blocks = nn.Sequential(*blocks)``, torchvision's ViT ``encoder.layers``, timm's ``blocks``),
    by name, holding parameters: one unit each by default, as the members of an ``nn.ModuleList`` are, so the planner's
    blocks (the same ``find_blocks``) are the units FSDP2 gathers one by one. Before session 35 such a stack was one unit
    (all its blocks gathered at once: a 2-block MLP stack planned 9.8 % under the measured per-rank peak)."""
    found = []
    for name, block in find_blocks(module):
        parent = module.get_submodule(name.rpartition(".")[0])
        if name not in exclude and isinstance(parent, nn.Sequential) and any(True for _ in block.parameters()):
            found.append((name, block))
    return found


def register(registry: Any = StrategyRegistry) -> None:
    """Register ``strategy="fsdp_qlora"`` with Lightning (idempotent)."""
    if QuantizedFSDPStrategy.strategy_name not in registry:
        registry.register(
            QuantizedFSDPStrategy.strategy_name,
            QuantizedFSDPStrategy,
            description="FSDP2 sharding of a quantized base with trainable adapters (lightning_hbm)",
        )


__all__ = ["QuantizedFSDPStrategy", "default_units", "inner_units", "register", "remainder_units", "sequential_blocks"]
