"""QuantizationQuality: full-precision references kept before quantization, compared with torchmetrics."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_hbm import QuantizedPrecision, applied_transforms, quantize_model
from lightning_hbm.data import synthetic_batch
from lightning_hbm.quality import QuantizationQuality

START_KEYS = {
    "quant/cosine_similarity",
    "quant/relative_error",
    "quant/kl_divergence",
    "quant/weight_sqnr_db_min",
    "quant/weight_sqnr_db_mean",
}
DRIFT_KEYS = {"drift/cosine_similarity", "drift/relative_error", "drift/kl_divergence"}


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call: what Lightning hands to a real logger."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    @override
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.records.append((step, dict(metrics)))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def with_key(self, key: str) -> list[tuple[Optional[int], dict[str, float]]]:
        return [(step, metrics) for step, metrics in self.records if key in metrics]


def fit_start_metrics(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, mode: Optional[str], **kwargs: Any
) -> tuple[QuantizationQuality, RecordingLogger]:
    quality = QuantizationQuality(**kwargs)
    logger = RecordingLogger()
    plugins = [QuantizedPrecision(mode, dtype="float32")] if mode else None
    trainer = trainer_factory(max_steps=0, plugins=plugins, callbacks=[quality], logger=logger)
    trainer.fit(gpt_factory(), datamodule_factory())
    return quality, logger


def test_unquantized_model_has_cosine_one_and_logs_documented_keys(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any
) -> None:
    quality, logger = fit_start_metrics(gpt_factory, datamodule_factory, trainer_factory, None)
    [(step, metrics)] = logger.with_key("quant/cosine_similarity")
    assert step == 0 and set(metrics) == START_KEYS
    torch.testing.assert_close(metrics["quant/cosine_similarity"], 1.0, rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["quant/relative_error"], 0.0, rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["quant/kl_divergence"], 0.0, rtol=0, atol=1e-6)
    # identical weights: the SQNR is only bounded by torchmetrics' epsilon
    assert metrics["quant/weight_sqnr_db_min"] > 60
    assert quality._reference is not None and quality._reference.device.type == "cpu"
    assert quality._fp_weights == {}  # host copies released after the table


def test_nf4_costs_more_than_int8_dynamic(gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any) -> None:
    results = {}
    for mode in ("nf4", "int8-dynamic"):
        quality, logger = fit_start_metrics(gpt_factory, datamodule_factory, trainer_factory, mode)
        [(_, metrics)] = logger.with_key("quant/cosine_similarity")
        results[mode] = (metrics, quality.layer_sqnr)
    (nf4, nf4_table), (int8, int8_table) = results["nf4"], results["int8-dynamic"]
    assert nf4["quant/cosine_similarity"] < int8["quant/cosine_similarity"] < 1.0
    assert nf4["quant/relative_error"] > int8["quant/relative_error"] > 0
    assert nf4["quant/kl_divergence"] > int8["quant/kl_divergence"] > 0
    # per-layer table: all 9 Linears, worst first; 4-bit ~20 dB, 8-bit ~44 dB
    assert len(nf4_table) == len(int8_table) == 9
    assert [s for _, s in int8_table] == sorted(s for _, s in int8_table)
    assert int8["quant/weight_sqnr_db_min"] == int8_table[0][1]
    # nf4 keeps the output head (layers.output_heads) in the compute dtype: bf16 rounding only, not 4-bit error
    heads = [s for n, s in nf4_table if n.endswith("lm_head")]
    assert len(heads) == 1 and heads[0] > 60
    assert max(s for n, s in nf4_table if not n.endswith("lm_head")) < 25 < 40 < min(s for _, s in int8_table)


def test_validation_metrics_are_logged_through_lightning(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any
) -> None:
    quality = QuantizationQuality(weight_sqnr=False)
    logger = RecordingLogger()
    trainer = trainer_factory(
        max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1, logger=logger,
        plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")], callbacks=[quality],
    )
    trainer.fit(gpt_factory(), datamodule_factory())
    # fit start: the quantization error; the validation after step 2 (not the sanity check): drift, trained
    assert [step for step, _ in logger.with_key("quant/cosine_similarity")] == [0]
    assert [step for step, _ in logger.with_key("drift/cosine_similarity")] == [1]
    assert set(quality.metrics) == DRIFT_KEYS
    assert DRIFT_KEYS <= set(trainer.callback_metrics)
    assert "quant/weight_sqnr_db_min" not in trainer.callback_metrics
    assert quality.metrics == {k: float(trainer.callback_metrics[k]) for k in quality.metrics}


def test_after_training_the_distance_from_the_untrained_base_is_drift_without_thresholds(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, recwarn: pytest.WarningsRecorder
) -> None:
    # unquantized: the fit-start error is 0, so everything validation measures is training moving the model
    quality = QuantizationQuality(weight_sqnr=False, min_cosine_similarity=0.9999, max_relative_error=0.001)
    logger = RecordingLogger()
    trainer = trainer_factory(max_steps=4, val_check_interval=4, limit_val_batches=1, logger=logger, callbacks=[quality])
    model = gpt_factory(lr=3e-2)
    trainer.fit(model, datamodule_factory())
    [(_, start)] = logger.with_key("quant/cosine_similarity")
    torch.testing.assert_close(start["quant/cosine_similarity"], 1.0, rtol=0, atol=1e-6)
    [(_, logged)] = logger.with_key("drift/cosine_similarity")
    drift = {k: v for k, v in logged.items() if "/" in k}  # without the val_loss and epoch Lightning logs with them
    assert set(drift) == DRIFT_KEYS and not any(k.startswith("quant/") for k in logged)
    # the value: the trained model's probe output against the full-precision output kept before training
    again = quality.measure(trainer, model)
    assert drift == pytest.approx({"drift/" + k.removeprefix("quant/"): v for k, v in again.items()}, abs=1e-6)
    assert drift["drift/cosine_similarity"] < 0.9999 and drift["drift/relative_error"] > 0.001  # training moved it...
    assert not [w for w in recwarn if "min_cosine_similarity" in str(w.message)]  # ...which is no threshold crossing


def test_a_module_without_forward_is_refused_at_setup_naming_the_fix(trainer_factory: Any) -> None:
    class NoForward(pl.LightningModule):  # computes in training_step only, as Lightning allows
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.head(self.embed(batch["input_ids"])).logsumexp(-1).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ids = torch.randint(0, 16, (4, 6))
    model = NoForward()
    quality = QuantizationQuality(probe_batch={"input_ids": ids})
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")], callbacks=[quality])
    with pytest.raises(
        TypeError,
        match=r"^QuantizationQuality runs a probe batch through NoForward\.forward \(module\(x\), module\(inputs\) of an "
        r"\(inputs, targets\) pair, or module\(\*\*batch\) of a dict\), but NoForward defines no forward \(Lightning "
        r"trains through training_step, which may compute without one\)\. Define NoForward\.forward returning the "
        r"output tensor or an object with \.logits, e\.g\. `def forward\(self, \*\*batch\): return self\.model\(\*\*batch\)` "
        r"for a dict batch or `def forward\(self, x\): return self\.model\(x\)`\.$",
    ):
        trainer.fit(model, DataLoader([{"input_ids": ids[i]} for i in range(4)], batch_size=2))
    assert trainer.global_step == 0 and applied_transforms(model) == []
    assert isinstance(model.head, nn.Linear) and type(model.head) is nn.Linear  # not quantized
    # the plugin's probes (sensitivity plan, smoothing, GPTQ) share probe_output: the same message, not torch's
    from lightning_hbm.probe import probe_output

    with pytest.raises(TypeError, match=r"^lightning_hbm runs a probe batch through NoForward\.forward .* Define NoForward\.forward"):
        probe_output(model, {"input_ids": ids})


def test_threshold_warns_and_stops_before_training(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any
) -> None:
    quality = QuantizationQuality(min_cosine_similarity=0.9999999, max_kl_divergence=0.0, stop_on_threshold=True)
    trainer = trainer_factory(max_steps=3, plugins=[QuantizedPrecision("nf4", dtype="float32")], callbacks=[quality])
    with pytest.warns(UserWarning, match=r"cosine_similarity=0\.\d+ < min_cosine_similarity=0\.9999999; kl_divergence="):
        trainer.fit(gpt_factory(), datamodule_factory())
    assert trainer.global_step == 0


def test_generic_model_with_given_probe_batch_has_no_kl(trainer_factory: Any) -> None:
    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    quality = QuantizationQuality(probe_batch=(x, y), probe_samples=4)
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")], callbacks=[quality])
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=4))
    assert quality._reference.shape == (4, 8)
    assert set(quality.metrics) == START_KEYS - {"quant/kl_divergence"}
    assert 0.999 < quality.metrics["quant/cosine_similarity"] < 1.0


def test_missing_probe_batch_is_an_error_before_training(gpt_factory: Any, trainer_factory: Any) -> None:
    """No probe batch and no train dataloader to draw one from (``validate`` of a module without one)."""
    model = gpt_factory()
    inputs, targets = synthetic_batch(8, 16)
    model.validation_step = lambda batch, batch_idx: None
    trainer = trainer_factory(max_steps=1, callbacks=[QuantizationQuality()])
    with pytest.raises(ValueError, match=r"found no probe batch: the Trainer has no train dataloader \(no datamodule, no train_dataloaders passed to fit"):
        trainer.validate(model, DataLoader(TensorDataset(inputs, targets), batch_size=4))


def test_the_probe_batch_is_the_first_of_the_loader_passed_to_fit(gpt_factory: Any, trainer_factory: Any) -> None:
    """Was: "found no probe batch: the Trainer has no LightningDataModule" for ``fit(model, loader)``."""
    model = gpt_factory()
    inputs, targets = synthetic_batch(8, 16)
    quality = QuantizationQuality()
    trainer = trainer_factory(max_steps=1, callbacks=[quality])
    trainer.fit(model, DataLoader(TensorDataset(inputs, targets), batch_size=4))
    assert quality._reference is not None and set(quality.metrics) >= {"quant/cosine_similarity"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(probe_samples=0), ValueError, "probe_samples must be at least 1, got 0"),
        (dict(probe_samples=2.5), TypeError, r"probe_samples=2\.5\): wrong type float; pass an int"),
        (dict(task="vision"), ValueError, r"task must be 'auto', 'lm' or 'generic', got 'vision'"),
        (dict(probe_batch="tokens"), TypeError, "probe_batch must be a tensor.*got str"),
        (dict(min_cosine_similarity=1.5), ValueError, r"min_cosine_similarity must be in \[-1, 1\], got 1\.5"),
        (dict(max_relative_error=-0.1), ValueError, r"max_relative_error must be >= 0 .*got -0\.1"),
        (dict(max_kl_divergence=-1.0), ValueError, r"max_kl_divergence must be >= 0 .*got -1\.0"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        QuantizationQuality(**kwargs)


def test_lm_task_needs_logits(trainer_factory: Any) -> None:
    class Scalar(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum(-1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(4, 4)
    trainer = trainer_factory(max_steps=1, callbacks=[QuantizationQuality(probe_batch=(x,), task="lm")])
    with pytest.raises(ValueError, match=r"task='lm'\) needs logits of shape \(batch, seq, vocab\), got an output of shape \(2,\)"):
        trainer.fit(Scalar(), DataLoader(TensorDataset(x), batch_size=2))
    assert trainer.global_step == 0


class _ModeRecorder(pl.Callback):
    """The train/eval flag of every module at the first training step."""

    def __init__(self) -> None:
        self.training: dict[str, bool] = {}

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.training:
            self.training = {name: m.training for name, m in pl_module.named_modules()}


_PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("plugin", "quality"),
    [
        (dict(mode="nf4-dq", rounding="gptq", probe_batch=_PROBE), False),
        (dict(mode="nf4-dq"), True),
        (dict(mode="int8-dynamic-smooth", smoothing=0.5, probe_batch=_PROBE), False),
        (dict(mode="nf4-dq", max_bytes_per_param=0.7, probe_batch=_PROBE), False),
    ],
    ids=["gptq", "QuantizationQuality", "int8-dynamic-smooth", "sensitivity-plan"],
)
def test_probes_keep_each_modules_own_train_eval_flag(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, plugin: dict, quality: bool
) -> None:
    """The probes run the model in eval mode and put back each module's flag, not one flag for the whole model."""
    model = gpt_factory()
    model.model.h[0].eval()  # e.g. a frozen block whose dropout/BatchNorm the user keeps in eval mode
    recorder = _ModeRecorder()
    callbacks = [recorder] + ([QuantizationQuality(probe_batch=_PROBE, on_validation=False)] if quality else [])
    trainer_factory(max_steps=1, plugins=[QuantizedPrecision(dtype="float32", **plugin)], callbacks=callbacks).fit(
        model, datamodule_factory()
    )
    assert recorder.training["model.h.0"] is False and recorder.training["model.h.0.attn"] is False
    assert recorder.training["model.h.1"] is True and recorder.training[""] is True


def test_an_already_quantized_layer_is_no_reference_weight() -> None:
    # torchao's NF4Tensor says it is floating: the format, not the dtype, tells it is quantized
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    quantize_model(model, "nf4-torchao", "float32", ignore_modules=["2"])
    assert model[0].weight.is_floating_point()
    quality = QuantizationQuality(probe_batch=torch.randn(2, 64))
    quality.transform_model(model)
    assert set(quality._fp_weights) == {"2"}
