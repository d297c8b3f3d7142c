"""``QuantizationQuality``: measure what quantization cost at fit start, and how far training moved the model.

What it shrinks: nothing; it watches the price of what the other features shrink. At the surgery
point, *before* the base is quantized (``Stage.OBSERVE``), it runs the model as the user built it
on a fixed probe batch and keeps the outputs on CPU, together with a CPU reference of every
``nn.Linear`` weight. After all model changes (``on_fit_start``) it runs the same probe batch through
the changed model and compares, with torchmetrics: the quantization error (``quant/*``). After each
validation once training has stepped, the same comparison measures quantization *plus* training, so it is
logged as drift (``drift/*``), not as quantization error. The references live in host memory: the only
device memory it costs is the probe batch's forward, under ``no_grad``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, Optional, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics.functional.audio import signal_noise_ratio
from typing_extensions import override

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._validate import check_args
from lightning_hbm.layers.correction import correction_weight
from lightning_hbm.precision.registry import format_of
from lightning_hbm.probe import PREFIX, check_forward, compare_outputs, eval_no_grad, first_batch, probe_output  # public here too
from lightning_hbm.surgery import Stage, SurgeryCallback

#: keys of the comparison after training has stepped: the distance from the full-precision model as built
DRIFT_PREFIX = "drift/"


def _module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _dequantized_weight(layer: nn.Module) -> Tensor:
    """The weight a (possibly quantized, possibly LoRA-wrapped) Linear really multiplies with, as fp32."""
    base: nn.Module = cast(Any, layer).get_base_layer() if hasattr(layer, "get_base_layer") else layer  # peft LoRA wrapper
    fmt = format_of(base)  # first: a quantized weight may look floating (torchao's NF4Tensor says bfloat16)
    if fmt is not None:
        weight = fmt.dequantize(base, torch.float32).float()
        correction = correction_weight(base)  # QuantizedPrecision(correction_rank=...): multiplied with too
        return weight if correction is None else weight + correction.to(weight.device)
    weight = cast(Tensor, base.weight)
    if weight.is_floating_point():
        return weight.detach().float()
    raise TypeError(
        f"QuantizationQuality cannot dequantize the {weight.dtype} weight of {type(base).__name__} for the weight "
        "SQNR table (no registered precision format owns the layer). Pass weight_sqnr=False to skip the table."
    )


#: the former metric keys of the sensitivity-aware choice -> their names since issue 54 ("plan" names the planner's):
#: both are logged while the former are deprecated
RENAMED_KEYS = {PREFIX + "plan_cosine_similarity": PREFIX + "layer_modes_cosine_similarity",
                PREFIX + "plan_bytes_per_param": PREFIX + "layer_modes_bytes_per_param"}


def _layer_mode_metrics(plugin: Any) -> dict[str, float]:
    """The figures a sensitivity-aware plan or ``int8-dynamic-smooth`` measured while choosing (none without)."""
    metrics = {}
    report = getattr(plugin, "sensitivity_report", None)
    if report is not None:
        metrics[PREFIX + "uniform_cosine_similarity"] = report.uniform_cosine
        metrics[PREFIX + "layer_modes_cosine_similarity"] = report.cosine
        metrics[PREFIX + "layer_modes_bytes_per_param"] = report.bytes_per_param
        for old, new in RENAMED_KEYS.items():  # the former keys, logged beside the new ones while deprecated
            metrics[old] = metrics[new]
    smoothing = getattr(plugin, "smoothing_report", None)
    if smoothing is not None:
        metrics[PREFIX + "unsmoothed_cosine_similarity"] = smoothing.cosine_before
        metrics[PREFIX + "smoothed_cosine_similarity"] = smoothing.cosine_after
    return metrics


class QuantizationQuality(SurgeryCallback):
    """Compare the quantized (changed) model with the full-precision one, on a fixed probe batch.

    Args:
        probe_batch: the batch to compare on (a tensor, an ``(inputs, targets)`` tuple/list whose first
            element goes to ``forward``, or a dict passed as ``forward(**batch)``). ``None`` (default): the
            first batch of the datamodule's ``train_dataloader`` (drawn without touching the global RNG).
        probe_samples: keep at most this many samples of the probe batch (the reference outputs are
            ``probe_samples x seq x vocab`` floats in host memory).
        task: ``"lm"``: outputs are next-token logits ``(batch, seq, vocab)``, KL divergence is logged;
            ``"generic"``: no KL; ``"auto"``: ``"lm"`` when the output has 3 dimensions.
        on_validation: also compare after every validation (not during the sanity check). Once the optimizer
            has stepped (``trainer.global_step > 0``), this measures the distance of the trained model from the
            full-precision model as built (quantization plus training, mostly training), logged under ``drift/*``
            (KL is then the usual "KL to the base"); before that, under ``quant/*``.
        weight_sqnr: compute the per-layer weight SQNR table at fit start (keeps a CPU reference of every
            Linear weight until then; ``False`` saves that host memory).
        min_cosine_similarity, max_relative_error, max_kl_divergence: thresholds on the quantization error
            (``quant/*``); crossing one warns. ``drift/*`` has none: training is meant to move the model.
        stop_on_threshold: also stop training (``trainer.should_stop``) when a threshold is crossed.

    Logged (fit start: through ``trainer.loggers`` and ``trainer.callback_metrics``; validation:
    ``LightningModule.log``):
        ``quant/cosine_similarity``: mean cosine similarity of output rows (per token), torchmetrics ``CosineSimilarity``.
        ``quant/relative_error``: root relative squared error ``||y_q - y|| / ||y - mean(y)||``,
            torchmetrics ``RelativeSquaredError(squared=False)``.
        ``quant/kl_divergence``: mean over tokens of ``KL(p_fp || p_quant)`` of the next-token
            distributions, torchmetrics ``KLDivergence``'s figure (``task="lm"`` only); a token the model as built gives
            no probability (masked with -inf, or -1e9 that float16 makes -inf) adds 0, one only the changed model
            masks adds inf (with a warning), as does a row the changed model masks whole. A row the full-precision model masks whole (every entry -inf: no distribution to compare with) is
            left out of the mean, with a warning counting such rows (NaN if every row is); the cosine leaves out rows
            both models mask whole.
        ``quant/weight_sqnr_db_min`` and ``quant/weight_sqnr_db_mean``: weight signal-to-quantization-noise
            ratio over the Linear layers, dB (torchmetrics ``signal_noise_ratio``; fit start only). The whole
            table, worst layers first, is in :attr:`layer_sqnr` and printed at fit start.
        At validations after the first optimizer step: ``drift/cosine_similarity``, ``drift/relative_error`` and
        ``drift/kl_divergence``, the same three comparisons of the trained model with the full-precision model as
        built (before training). A trained model is meant to differ: a cosine near 0 or below after training from a
        random init is training, not a broken quantization. The error against the quantized start is ``quant/*``
        at fit start.
        With a sensitivity-aware ``QuantizedPrecision`` plan (``max_bytes_per_param``/``min_cosine``), at fit
        start: ``quant/uniform_cosine_similarity`` and ``quant/layer_modes_cosine_similarity``, the same cosine on
        the plugin's probe batch with every layer in the base mode (before) and in its chosen mode (after), and
        ``quant/layer_modes_bytes_per_param`` (quantizable weights, constants included); until a later release also
        under their former keys ``quant/plan_cosine_similarity`` and ``quant/plan_bytes_per_param`` (deprecated:
        "plan" names the planner's, issue 54; :data:`RENAMED_KEYS`). With
        ``int8-dynamic-smooth``, at fit start: ``quant/unsmoothed_cosine_similarity`` and
        ``quant/smoothed_cosine_similarity``, the probe output cosine before and after smoothing.

    Example::

        trainer = Trainer(plugins=[QuantizedPrecision("int8-dynamic")],
                          callbacks=[QuantizationQuality(min_cosine_similarity=0.99)])
    """

    stage = Stage.OBSERVE

    def __init__(
        self,
        probe_batch: Optional[Any] = None,
        probe_samples: int = 2,
        task: Literal["auto", "lm", "generic"] = "auto",
        on_validation: bool = True,
        weight_sqnr: bool = True,
        min_cosine_similarity: Optional[float] = None,
        max_relative_error: Optional[float] = None,
        max_kl_divergence: Optional[float] = None,
        stop_on_threshold: bool = False,
    ) -> None:
        check_args(QuantizationQuality.__init__, locals())
        if isinstance(probe_samples, bool) or not isinstance(probe_samples, int):
            raise TypeError(f"probe_samples must be an int, got {probe_samples!r} of type {type(probe_samples).__name__}.")
        if probe_samples < 1:
            raise ValueError(f"probe_samples must be at least 1, got {probe_samples}.")
        if task not in ("auto", "lm", "generic"):
            raise ValueError(f"task must be 'auto', 'lm' or 'generic', got {task!r}.")
        if probe_batch is not None and not isinstance(probe_batch, (Tensor, tuple, list, Mapping)):
            raise TypeError(
                f"probe_batch must be a tensor, an (inputs, targets) tuple/list or a dict of tensors, got "
                f"{type(probe_batch).__name__}. Pass None to use the datamodule's first training batch."
            )
        thresholds = (
            ("min_cosine_similarity", min_cosine_similarity),
            ("max_relative_error", max_relative_error),
            ("max_kl_divergence", max_kl_divergence),
        )
        for name, value in thresholds:
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"QuantizationQuality({name}={value!r}): pass a number, or None for no threshold.")
            if not math.isfinite(value):
                raise ValueError(
                    f"QuantizationQuality({name}={value!r}): a threshold must be a finite number (a NaN threshold "
                    "never triggers); pass None for no threshold."
                )
        if min_cosine_similarity is not None and not -1.0 <= min_cosine_similarity <= 1.0:
            raise ValueError(f"min_cosine_similarity must be in [-1, 1], got {min_cosine_similarity}.")
        for name, value in (("max_relative_error", max_relative_error), ("max_kl_divergence", max_kl_divergence)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (or None for no threshold), got {value}.")
        self.probe_batch = probe_batch
        self.probe_samples = probe_samples
        self.task = task
        self.on_validation = on_validation
        self.weight_sqnr = weight_sqnr
        self.min_cosine_similarity = min_cosine_similarity
        self.max_relative_error = max_relative_error
        self.max_kl_divergence = max_kl_divergence
        self.stop_on_threshold = stop_on_threshold
        self._trainer: Optional[pl.Trainer] = None
        self._probe: Optional[Any] = None  # on CPU
        self._reference: Optional[Tensor] = None  # fp32, on CPU
        self._fp_weights: dict[str, Tensor] = {}
        self._task: str = task  # resolved from the output shape when "auto"
        #: ``(layer name, weight SQNR in dB)``, worst first; filled at fit start.
        self.layer_sqnr: list[tuple[str, float]] = []
        #: the last measured metrics (keys as logged).
        self.metrics: dict[str, float] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_forward(pl_module, "QuantizationQuality")  # before the surgery is installed: a refusal changes nothing
        self._trainer = trainer  # transform_model needs the datamodule for the probe batch
        super().setup(trainer, pl_module, stage)

    # ------------------------------------------------------------------ before quantization

    @override
    def transform_model(self, module: nn.Module) -> None:
        """Keep the full-precision probe outputs and Linear weights on CPU (the model is not changed)."""
        batch = self.probe_batch if self.probe_batch is not None else first_batch(self._trainer, "QuantizationQuality")
        n = self.probe_samples
        batch = apply_to_collection(batch, Tensor, lambda t: t[:n] if t.dim() > 0 else t)
        self._probe = move_data_to_device(batch, torch.device("cpu"))
        with eval_no_grad(module):
            output = probe_output(module, move_data_to_device(self._probe, _module_device(module)))
        task = self.task if self.task != "auto" else ("lm" if output.dim() == 3 else "generic")
        if task == "lm" and output.dim() < 2:
            raise ValueError(
                f"QuantizationQuality(task='lm') needs logits of shape (batch, seq, vocab), got an output of shape "
                f"{tuple(output.shape)}. Use task='generic' for this model."
            )
        self._task = task
        self._reference = output.detach().float().cpu()
        if self.weight_sqnr:
            # .cpu() is a no-op for CPU weights: a reference, no copy. Quantization replaces the Linear (and
            # casts build new tensors), it never writes into this storage, and the table is built before any
            # optimizer step.
            self._fp_weights = {
                name: sub.weight.detach().cpu()
                for name, sub in module.named_modules()
                # a quantized layer is no reference, even one whose weight looks floating (torchao's NF4Tensor)
                if isinstance(sub, nn.Linear) and sub.weight.is_floating_point() and format_of(sub) is None
            }

    # ------------------------------------------------------------------ after the changes

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Run the probe batch through ``pl_module`` as it is now and compare with the references."""
        if self._reference is None:
            raise RuntimeError(
                "QuantizationQuality has no full-precision reference: the model was already changed before this "
                "Trainer ran (its surgery happens once per model). Use a fresh model instance."
            )
        plugin = trainer.strategy.precision_plugin
        batch = plugin.convert_input(move_data_to_device(self._probe, _module_device(pl_module)))
        # at fit start, before the loop draws its loader's order: a forward that draws (noise, sampling) leaves the
        # user's RNGs as they were (issue 55), as the reference forward inside the surgery does
        with eval_no_grad(pl_module), plugin.forward_context(), torch_compat.preserved_rngs():
            output = probe_output(pl_module, batch).float().cpu()
        reference = self._reference
        if output.shape != reference.shape:
            raise RuntimeError(
                f"QuantizationQuality: the changed model's output shape {tuple(output.shape)} differs from the "
                f"full-precision one {tuple(reference.shape)} on the same probe batch."
            )
        return compare_outputs(output, reference, self._task == "lm")

    def _weight_table(self, pl_module: pl.LightningModule) -> dict[str, float]:
        table = []
        for name, reference in self._fp_weights.items():
            weight = _dequantized_weight(pl_module.get_submodule(name)).cpu()
            sqnr = signal_noise_ratio(weight.flatten(), reference.float().flatten(), zero_mean=False)
            table.append((name, float(sqnr)))
        self._fp_weights = {}  # done: release the host copies
        table.sort(key=lambda item: item[1])
        self.layer_sqnr = table
        if not table:
            return {}
        lines = "\n".join(f"  {sqnr:8.2f} dB  {name}" for name, sqnr in table[:10])
        rank_zero_info(f"QuantizationQuality: weight SQNR of {len(table)} Linear layers, worst first:\n{lines}")
        values = [sqnr for _, sqnr in table]
        return {PREFIX + "weight_sqnr_db_min": values[0], PREFIX + "weight_sqnr_db_mean": sum(values) / len(values)}

    def _check(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        crossed = []
        cos, rel, kl = (metrics.get(PREFIX + k) for k in ("cosine_similarity", "relative_error", "kl_divergence"))
        if self.min_cosine_similarity is not None and cos is not None and not cos >= self.min_cosine_similarity:
            crossed.append(f"cosine_similarity={cos:.6f} < min_cosine_similarity={self.min_cosine_similarity}")
        if self.max_relative_error is not None and rel is not None and not rel <= self.max_relative_error:
            crossed.append(f"relative_error={rel:.6f} > max_relative_error={self.max_relative_error}")
        if self.max_kl_divergence is not None and kl is not None and not kl <= self.max_kl_divergence:
            crossed.append(f"kl_divergence={kl:.6f} > max_kl_divergence={self.max_kl_divergence}")
        if not crossed:
            return
        action = "Stopping training (stop_on_threshold=True)." if self.stop_on_threshold else "Training continues."
        rank_zero_warn(
            f"QuantizationQuality at step {trainer.global_step}: {'; '.join(crossed)}. The quantized model drifts "
            f"from the full-precision one more than allowed; try a higher-precision mode (e.g. 'int8-dynamic' "
            f"instead of 'nf4') or ignore_modules for the worst layers (see layer_sqnr). {action}"
        )
        if self.stop_on_threshold:
            trainer.should_stop = True

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._reference is None:
            rank_zero_warn("QuantizationQuality: no full-precision reference (model changed before this fit); skipped.")
            return
        metrics = self.measure(trainer, pl_module)
        if self._fp_weights:
            metrics.update(self._weight_table(pl_module))
        metrics.update(_layer_mode_metrics(trainer.strategy.precision_plugin))
        self.metrics = metrics
        # self.log is not allowed in on_fit_start: log through the loggers, and expose to other callbacks.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items() if math.isfinite(v)})
        self._check(trainer, metrics)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.on_validation or trainer.sanity_checking or self._reference is None:
            return
        metrics = self.measure(trainer, pl_module)
        trained = trainer.global_step > 0
        if trained:  # quantization plus training: not the quantization error the quant/ keys name
            metrics = {DRIFT_PREFIX + key.removeprefix(PREFIX): value for key, value in metrics.items()}
        self.metrics = metrics
        for key, value in metrics.items():
            # every rank measured the same probe batch: the mean over ranks only silences Lightning's DDP warning
            pl_module.log(key, value, sync_dist=True)
        if not trained:
            self._check(trainer, metrics)
