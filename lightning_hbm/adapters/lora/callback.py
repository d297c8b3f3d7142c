"""The ``LoRA`` callback: its arguments, the layers it adapts, and the injection at the surgery point."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Literal, Optional, Union, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._validate import check_args
from lightning_hbm.adapters.lora import variants
from lightning_hbm.adapters.lora.base import ADAPTER_NAME, ALL_LINEAR, _import_peft, adapted_layers, adapter_state_dict
from lightning_hbm.adapters.lora.checks import quantized_modes, refuse_present_adapters, refuse_variants, refuse_wide_ranks
from lightning_hbm.adapters.lora.compute import compute_in_input_dtype
from lightning_hbm.adapters.lora.config import LoRAConfig
from lightning_hbm.adapters.lora.export import save_adapter
from lightning_hbm.adapters.lora.folder import check_adapter_folder
from lightning_hbm.adapters.lora.forward import lora_forward
from lightning_hbm.adapters.lora.input_grads import unwatch_first_step, watch_first_step
from lightning_hbm.adapters.lora.merge import merge
from lightning_hbm.adapters.lora.notices import tell_heads, tell_left_out
from lightning_hbm.adapters.lora.quantized_base import check_quantized_base
from lightning_hbm.adapters.lora.targets import select
from lightning_hbm.adapters.lora.watch import AdapterWatch, ExpertWatch
from lightning_hbm.adapters.lora.weight_delta import as_plain_convolutions, own_forward_convs, weight_delta_forward
from lightning_hbm.layers import prepare_model, repeated_reads_dequantize_once, report_coverage, task_heads
from lightning_hbm.memory import parameter_bytes, parameter_count
from lightning_hbm.naming import did_you_mean, name_matches
from lightning_hbm.precision.plugin import QuantizedPrecision
from lightning_hbm.precision.registry import format_of, to_dtype
from lightning_hbm.surgery import Stage, SurgeryCallback

log = logging.getLogger(__name__)

#: the settings read on the callback as its own (``lora.r``): the fields of its config but ``modules_to_save``, a
#: property (the argument, or the task heads found at the surgery)
_SETTINGS = frozenset(f.name for f in dataclasses.fields(LoRAConfig)) - {"modules_to_save"}


class LoRA(SurgeryCallback):
    """Adapter-only training: inject peft LoRA layers, freeze everything else.

    Args:
        r: rank of the adapters (``> 0``).
        alpha: LoRA scaling numerator (the update is scaled by ``alpha / r``).
        dropout: dropout on the adapter input. Keep ``0.0`` for bit-exact resume (Lightning does not
            checkpoint the RNG state).
        target_modules: ``"all-linear"`` (every ``nn.Linear``, quantized or not, transformers ``Conv1D``,
            the projections of ``nn.MultiheadAttention`` and each expert of a transformers-5 MoE layer,
            which are first replaced by equal modules made of Linears (:mod:`lightning_hbm.layers`);
            except the output head of Hugging Face models and Linears whose weight is tied to another module), a list of module names (a name matches itself and every
            module whose name ends with ``.name``, e.g. ``["q_proj", "v_proj"]``) or a regex that must
            match the full module name. Names are relative to the LightningModule
            (``model.model.layers.0.self_attn.q_proj`` for :class:`~lightning_hbm.models.LlamaLM`).
        exclude_modules: same forms (no ``"all-linear"``); matching Linears get no adapter.
        modules_to_save: modules trained fully besides the adapters, e.g. a new classifier head.
            Their parameters are made trainable in place (names unchanged, no second copy, unlike
            peft's ``ModulesToSaveWrapper``); ``QuantizedPrecision`` leaves them unquantized; ``save_adapter``
            saves them. ``None`` (default): the model's task heads (:func:`lightning_hbm.layers.task_heads`:
            a transformers ``...ForSequenceClassification``'s ``classifier``, a CTC ``lm_head``, the last
            Linear of a hand-written classifier), named at fit start. A list: exactly those; ``[]`` trains no
            head (a task head left out is warned about at fit start).
        adapter_dtype: storage dtype of the adapter weights (``"float32"`` default). On a bf16 model, plain fp32 LoRA
            adapters compute in bf16, their weights cast at each forward (mixed precision, as ``torch.autocast``), not
            on an fp32 copy of every input (:mod:`lightning_hbm.adapters.lora.compute`); elsewhere (fp32 and fp16
            models, DoRA and the other peft variants) the input is cast to the adapter's dtype, as peft does.
        full_checkpoint: ``False`` (default): Lightning checkpoints hold only the trainable weights
            (adapters + ``modules_to_save``) and their optimizer states; resume rebuilds the frozen
            base from the model's own init (same seed / same pretrained weights). ``True``: keep
            every weight, quantized base included.
        allow_base_change: on resume of an adapter-only checkpoint, the frozen base must be the one the
            adapters were trained on (a fingerprint of it is saved; another seed or other weights are
            an error). ``True`` accepts a different base on purpose.
        use_dora: peft's DoRA: a trainable magnitude per output channel over the direction ``W + B A`` (QDoRA on a
            bitsandbytes 4-bit/8-bit base). Refused on ``int8-dynamic`` and ``nf4-torchao`` Linears (peft cannot
            read their weight norm); convolutions (quantized ones too) take it.
        use_rslora: peft's rank-stabilised scaling ``alpha / sqrt(r)`` instead of ``alpha / r``.
        init_lora_weights: peft's initialisation: ``True`` (default: ``B = 0``, A Kaiming), ``False`` (B random too:
            the model changes at init), ``"gaussian"``, ``"pissa"`` / ``"olora"`` (A, B from the weight's SVD / QR,
            the base rewritten to ``W - B A``: full-precision Linears only, refused on quantized layers and
            convolutions). ``"eva"`` (needs data before the surgery) and ``"loftq"`` (quantizes the full-precision
            weight itself) are refused with the reason.
        bias: peft's ``bias``: ``"none"`` (default), ``"all"`` (every bias of the model trains) or ``"lora_only"``
            (the biases of the adapted layers); the trained biases go into checkpoints and ``save_adapter``.
        rank_pattern: per-layer ranks, ``{regex: rank}``, peft's rule (a key matches the end of a module name,
            ``{"v_proj": 16}``); every key must match an adapted layer.
        alpha_pattern: per-layer alphas, ``{regex: alpha}``, same rule.

    After the first backward of a fit, an adapter that received no gradient because its parent module ran but
    never called it (it reads the weight directly) is a ``RuntimeError`` naming it. One that ran but whose output
    never reaches the loss (a BERT pooler under mean pooling: the model's design) gets a warning naming it and
    stays untrained (``lora_B = 0``, no optimizer state); its names are in ``unused_modules``. So are (with a
    warning too) adapters whose gradient is all zeros at each of the first three backward passes: their input was
    all zeros in the first step (measured, named apart: an empty codebook before them, a layer initialised to zero),
    or their output is computed, then dropped (an indexing, a mask, a scale at zero).
    An expert of a MoE layer (``LinearExperts``) that no token of the first step reached is not judged then (it trains
    once the router sends it tokens); at the end of the fit, the experts whose adapters never received a non-zero
    gradient in any step are warned by name, with the count and the fix (more steps, the router's load-balancing
    loss, ``exclude_modules``), and their adapters' names are in ``untrained_experts``; nothing is said when every
    expert trained.
    Without ``QuantizedPrecision``, the layer-kind coverage table (``layers/...`` keys, see
    :func:`lightning_hbm.layers.report_coverage`) is logged at train start.

    Logged once at fit start, through the Trainer's loggers (``log_metrics``):
        ``lora/trainable_params``: parameters that require grad (adapters + ``modules_to_save``).
        ``lora/total_params``: all parameters, a packed 4-bit weight counted by its real element count.
        ``lora/trainable_percent``: ``100 * trainable / total``.
        ``lora/trainable_bytes`` and ``lora/frozen_bytes``: storage bytes (quantization constants included).

    Example::

        trainer = Trainer(plugins=[QuantizedPrecision("nf4-dq")], callbacks=[LoRA(r=16, alpha=32)])
        trainer.fit(model)
        LoRA.save_adapter(model, "adapter/")         # peft format, PeftModel.from_pretrained loads it
        merged = LoRA.merge(model)                   # plain bf16 state_dict of the original model
    """

    stage = Stage.ADAPTERS
    reads_layers = True  # layers whose weight the model's code reads directly are left out (the probe step says which)

    def __init__(
        self,
        r: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        target_modules: Union[str, list[str]] = ALL_LINEAR,
        exclude_modules: Optional[Union[str, list[str]]] = None,
        modules_to_save: Optional[list[str]] = None,
        adapter_dtype: Literal["float32", "bfloat16"] = "float32",
        full_checkpoint: bool = False,
        allow_base_change: bool = False,
        use_dora: bool = False,
        use_rslora: bool = False,
        init_lora_weights: Union[bool, Literal["gaussian", "pissa", "olora", "loftq", "eva"]] = True,
        bias: Literal["none", "all", "lora_only"] = "none",
        rank_pattern: Optional[dict[str, int]] = None,
        alpha_pattern: Optional[dict[str, float]] = None,
        **unknown: Any,
    ) -> None:
        # taken only to refuse them with the close match (peft's names: lora_alpha -> alpha); Python's own
        # TypeError names no alternative. The typed arguments above stay what the CLI parses.
        if unknown:
            _refuse_unknown(unknown)
        if isinstance(r, LoRAConfig):  # LoRA(LoRAConfig(...)): else "r=LoRAConfig(...): wrong type", no fix named
            raise TypeError(
                f"LoRA({r!r}): a LoRAConfig is the callback's settings, not its rank r. Build the callback from it "
                "with LoRA.from_config(config), or pass the settings as arguments: LoRA(r=16, alpha=32, ...)."
            )
        arguments = locals()
        check_args(LoRA.__init__, arguments)
        _import_peft()
        #: the settings, checked and frozen (the arguments above, by name; read ``lora.config.r`` or ``lora.r``)
        self.config = LoRAConfig(**{field.name: arguments[field.name] for field in dataclasses.fields(LoRAConfig)})
        self.task_heads: list[str] = []  # task heads of the model (layers.task_heads), trainable ones or not
        self.heads_quantized: list[str] = []  # task heads quantized before lightning_hbm: cannot be trained
        # filled at the surgery: what was adapted / made trainable (module names, LightningModule-relative)
        self.adapted_modules: list[str] = []
        self.narrow_left_out: list[str] = []  # all-linear layers narrower than r, left out (named at fit start)
        self.heads_left_out: list[str] = []  # output heads (layers.output_heads) left out of all-linear
        self.saved_modules: list[str] = []
        self.unused_modules: list[str] = []  # adapters that ran but whose output never reaches the loss
        #: the adapters of MoE experts that never received a non-zero gradient in the last fit (warned at its end)
        self.untrained_experts: list[str] = []
        self.summary: dict[str, float] = {}  # the metrics logged at fit start

    @classmethod
    def from_config(cls, config: LoRAConfig) -> LoRA:
        """The callback with the settings ``config`` (as peft's ``get_peft_model(model, LoraConfig(...))`` takes its
        settings): ``LoRA.from_config(LoRAConfig(r=16, alpha=32))`` is ``LoRA(r=16, alpha=32)``, and
        ``LoRA.from_config(dataclasses.replace(lora.config, r=32))`` a callback like ``lora`` at another rank. The
        keyword constructor stays the face a LightningCLI ``config.yaml`` names.

        Raises:
            TypeError: ``config`` is not a :class:`~lightning_hbm.adapters.lora.LoRAConfig` (a dict: ``LoRA(**d)``).
        """
        if not isinstance(config, LoRAConfig):
            raise TypeError(
                f"LoRA.from_config({config!r}): pass a LoRAConfig, e.g. LoRA.from_config(LoRAConfig(r=16)); settings "
                "as a dict go to the constructor: LoRA(**settings)."
            )
        return cls(**{field.name: config.argument(field.name) for field in dataclasses.fields(config)})

    def __getattr__(self, name: str) -> Any:
        # a setting read as the callback's own (lora.r, lora.target_modules): its config's. Only reached when normal
        # lookup fails; __dict__ read directly, as unpickling and deepcopy run this before __init__'s state exists
        config = self.__dict__.get("config")
        if config is not None and name in _SETTINGS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # the settings are checked once and frozen: a write would otherwise be a plain attribute nothing reads (silent)
        if name in _SETTINGS:
            raise AttributeError(
                f"LoRA.{name} is a setting, checked when the callback is built and read from lora.config: build the "
                f"callback with LoRA({name}={value!r}) instead of setting it afterwards."
            )
        super().__setattr__(name, value)

    @property
    def modules_to_save(self) -> list[str]:
        """The modules trained in full: the ``modules_to_save`` given, or (default) the trainable task heads found."""
        if self.config.modules_to_save is not None:
            return list(self.config.modules_to_save)
        return [h for h in self.task_heads if h not in self.heads_quantized]

    def resolve_modules_to_save(self, module: nn.Module) -> list[str]:
        """Find the task heads of ``module`` as built and return :attr:`modules_to_save`; changes nothing.

        The surgery calls it before any check, so that ``QuantizedPrecision`` keeps the heads unquantized.
        """
        self.task_heads = task_heads(module)
        self.heads_quantized = [h for h in self.task_heads if variants.is_quantized(module.get_submodule(h))]
        return self.modules_to_save

    # ------------------------------------------------------------------ surgery

    def resolve(self, module: nn.Module, to_be_quantized: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
        """(Linears that get an adapter, modules made fully trainable), validated; changes nothing.

        The selection is :func:`~lightning_hbm.adapters.lora.targets.select`'s (its ``ValueError`` when a target or a
        ``modules_to_save`` entry is wrong); the layers 'all-linear' left out are kept to be named at fit start.
        """
        self.resolve_modules_to_save(module)  # the task heads: trained by default, warned about when left out
        selection = select(module, self.config, self.modules_to_save, to_be_quantized)
        self.narrow_left_out, self.heads_left_out = selection.narrow, selection.heads_left_out
        return selection.targets, selection.saved

    @override
    def check_model(self, module: nn.Module) -> None:
        """Validate against the model as built, before the precision plugin quantizes anything."""
        refuse_present_adapters(module)
        self.resolve_modules_to_save(module)  # the heads first: the plugin leaves modules_to_save unquantized
        modes = quantized_modes(module)
        targets, _ = self.resolve(module, frozenset(modes))
        refuse_variants(module, self.config, targets, modes)
        refuse_wide_ranks(module, self.config, targets)

    @override
    def resume_config(self) -> dict[str, Any]:
        return self.config.resume_config()

    @override
    def saves_frozen_weights(self) -> bool:
        return self.config.full_checkpoint

    @override
    def allows_base_change(self) -> bool:
        return self.config.allow_base_change

    @override
    def transform_model(self, module: nn.Module) -> None:
        """Inject the adapters into ``module`` in place and freeze everything else."""
        peft = _import_peft()
        targets, _ = self.resolve(module)  # every check before the first change
        refuse_variants(module, self.config, targets, {})
        # nn.MultiheadAttention -> an equal module with four Linear projections (else LoRA on out_proj is
        # never called and the input projection is unreachable), transformers-5 3-D experts -> one Linear
        # per expert (no-ops after QuantizedPrecision did it); excluded ones are left as they are.
        excluded = self.config.exclude_modules
        prepare_model(module, skip=lambda n: excluded is not None and name_matches(n, excluded))
        targets, saved = self.resolve(module)
        # peft picks its bitsandbytes-aware LoRA layers (which can merge) only if the model it is
        # given says it is quantized; quantize_model sets this on the root, a user-quantized
        # submodule may not have, so derive it from the layers themselves.
        kinds = {fmt.peft_kind for fmt in map(format_of, module.modules()) if fmt is not None}
        peft_compat.mark_quantized(module, [k for k in ("4bit", "8bit") if k in kinds])
        config = self.config.peft_config(peft, targets)
        # (a convolution with its own forward gets plain convolutions as its adapter: weight_delta.py)
        # (the names are exact: peft's rewrite of an MoE transformers model's targets is kept out, _compat/peft.py)
        own_convs = own_forward_convs(module) & set(targets)
        with repeated_reads_dequantize_once(), as_plain_convolutions(module, own_convs), peft_compat.exact_targets(module):
            peft.inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
        # peft froze every non-adapter parameter; modules_to_save train in place (stable names)
        for name in saved:
            for param in module.get_submodule(name).parameters():
                param.requires_grad_(True)
        dtype = to_dtype(self.config.adapter_dtype)
        for sub in adapted_layers(module).values():
            # under Lightning's bf16-true the module is bf16 already, so peft made bf16 adapters
            variants.cast_adapters(sub, dtype)
            compute_in_input_dtype(sub)  # fp32 adapters on a bf16 model: bf16 matmuls, no fp32 input copies
            lora_forward(sub)  # the adapter term added inside one addmm (plain layers; forward.py says when)
            weight_delta_forward(sub)  # a convolution with its own forward: its weight adapted (weight_delta.py)
            _expose_base_attributes(sub)
        self.adapted_modules, self.saved_modules = targets, saved
        tell_left_out(module, self.config.r, self.narrow_left_out, self.heads_left_out)
        tell_heads(module, self.config, self.task_heads, self.heads_quantized, self.saved_modules)
        log.info("lightning_hbm: LoRA r=%d on %d Linear layers, %d modules_to_save", self.config.r, len(targets), len(saved))

    # --------------------------------------------------------------- Lightning hooks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainable = parameter_count(pl_module, trainable=True)
        total = parameter_count(pl_module)
        metrics = {
            "lora/trainable_params": float(trainable),
            "lora/total_params": float(total),
            "lora/trainable_percent": 100.0 * trainable / max(total, 1),
            "lora/trainable_bytes": float(parameter_bytes(pl_module, trainable=True)),
            "lora/frozen_bytes": float(parameter_bytes(pl_module, trainable=False)),
        }
        self.summary = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            f"LoRA: {trainable:,} trainable of {total:,} parameters ({metrics['lora/trainable_percent']:.3f}%), "
            f"trainable {metrics['lora/trainable_bytes'] / 2**20:.2f} MiB, frozen {metrics['lora/frozen_bytes'] / 2**20:.2f} MiB"
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(trainer.precision_plugin, QuantizedPrecision):
            report_coverage(pl_module, quantizing=False)  # QuantizedPrecision reports it itself
        self._watch: Optional[AdapterWatch] = AdapterWatch(pl_module)
        self._experts: Optional[ExpertWatch] = ExpertWatch(pl_module)  # the whole fit (an expert trains once reached)
        # a loss without gradient because the adapters ran with gradients off (Reformer): the first step hooks the input
        # embeddings and runs again, warned (only when the first run shows it)
        watch_first_step(pl_module, self._watch.gradless_adapters, self._watch.fix_applied)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.check_loss(loss)  # the first backward only

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            over = watch.after_backward()  # the first few backward passes of the fit only
            self.unused_modules = watch.unused
            self._watch = None if over else watch
        experts = getattr(self, "_experts", None)
        if experts is not None:
            experts.after_backward()
            self._experts = experts if experts.pending else None  # every expert reached: nothing left to watch

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unwatch_first_step(pl_module)  # a fit that ran no training step (or stopped) leaves no wrapper behind
        super().teardown(trainer, pl_module, stage)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        watch, self._watch = getattr(self, "_watch", None), None
        if watch is not None:
            watch.close()  # a fit that ended before its first backward: the hooks are still there
        if watch is not None and watch.passes:  # a fit shorter than the watch: report what it saw
            watch.finish()
            self.unused_modules = watch.unused
        experts, self._experts = getattr(self, "_experts", None), None
        self.untrained_experts = experts.finish() if experts is not None else []

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        watch, self._watch = getattr(self, "_watch", None), None
        if watch is not None:
            watch.close()  # a fit that failed before its first backward's check: no hook left on the model
        self._experts = None  # a failed fit says nothing of its experts
        unwatch_first_step(pl_module)  # nor the first step's wrapper
        super().on_exception(trainer, pl_module, exception)

    # ------------------------------------------------------------ public helpers (lora/export.py)

    adapter_state_dict = staticmethod(adapter_state_dict)
    save_adapter = staticmethod(save_adapter)
    check_adapter_folder = staticmethod(check_adapter_folder)
    check_quantized_base = staticmethod(check_quantized_base)
    merge = staticmethod(merge)


#: peft ``LoraConfig`` names (and the usual spelling ``rank``) -> LoRA's own argument
_PEFT_NAMES = {"rank": "r", "lora_r": "r", "lora_rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout"}


def _refuse_unknown(unknown: dict[str, Any]) -> None:
    """``TypeError`` for the first keyword argument LoRA does not take, with the argument meant."""
    options = [n for n, p in inspect.signature(LoRA.__init__).parameters.items() if n != "self" and p.kind is not p.VAR_KEYWORD]
    key, value = next(iter(unknown.items()))
    meant = _PEFT_NAMES.get(key.lower())
    hint = f" Did you mean {meant!r}?" if meant else did_you_mean(key, options)
    raise TypeError(f"LoRA({key}={value!r}): LoRA has no argument {key!r}.{hint} Its arguments: {', '.join(options)}.")


def _expose_base_attributes(layer: nn.Module) -> None:
    """Give a peft LoRA layer the base layer's plain attributes it lacks (``stride``, ``padding``, ...).

    A parent may read them (transformers Whisper: ``self.conv1.stride[0]``); peft's LoRA Conv layer does not forward
    them ("'Conv1d' object has no attribute 'stride'"). Its own attributes (``in_features``, ``weight``) stay. Only
    plain values are copied: a bitsandbytes layer's ``quant_state`` is an object that changes with the layer.
    """
    for name, value in vars(cast(Any, layer).get_base_layer()).items():  # a peft LoRA layer
        plain = isinstance(value, (bool, int, float, str, tuple))
        if plain and not name.startswith("_") and name not in vars(layer) and not hasattr(type(layer), name):
            setattr(layer, name, value)  # a plain value: nn.Module keeps it in __dict__
