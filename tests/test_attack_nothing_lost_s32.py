"""Session 32: what session 31 added, attacked as an outside user would (issue 55, "nothing lost", round four)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.surgery.probe_step import PROBE_SWITCH
from tests.adapters.test_input_grads_s30 import Model, tokens


class Logging(Model):
    """The Reformer-like model of session 30, logging its loss per epoch (plain and through a torchmetrics metric)."""

    def __init__(self, fix: bool = False) -> None:
        super().__init__(fix=fix)
        self.mean = torchmetrics.MeanMetric()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("plain", loss, on_step=False, on_epoch=True)
        self.log("summed", loss, on_step=False, on_epoch=True, reduce_fx="sum")
        self.mean(loss.detach())
        self.log("metric", self.mean, on_step=False, on_epoch=True)
        return loss


def _epoch_metrics(module: Logging) -> dict[str, float]:
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=4, target_modules=r"blocks\.\d\.0")])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader([tokens(1), tokens(2), tokens(3)], batch_size=None))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_the_discarded_first_run_logs_nothing_the_epoch_mean_is_a_plain_runs() -> None:
    """Was: the first step's discarded run (input_grads.py) logged too: the epoch mean counted batch 0 twice."""
    want = _epoch_metrics(Logging(fix=True))  # the user's own hook: no rerun
    got = _epoch_metrics(Logging())  # the rerun
    assert set(want) == {"plain", "summed", "metric"} and set(got) == set(want)
    for key in want:
        assert got[key] == want[key], (key, got[key], want[key])


class Counting(pl.LightningModule):
    """A plain model whose step counts its loss in a torchmetrics metric (no BatchNorm: the probe's fake run succeeds)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.mean = torchmetrics.MeanMetric()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.body(batch).pow(2).mean()
        self.mean(loss.detach())
        self.log("metric", self.mean, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _counted(module: pl.LightningModule, batches: list[torch.Tensor]) -> dict[str, float]:
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=2, target_modules=r"body\.0")])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(batches, batch_size=None))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("build", [lambda: Logging(fix=True), Counting], ids=["real-batch-probe", "fake-probe"])
def test_the_probe_step_counts_nothing_in_the_users_metrics(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the probe step's run of training_step updated the user's torchmetrics metric (the first batch counted
    twice in the epoch's value; on fake tensors, a fake state)."""
    batches = [tokens(1), tokens(2), tokens(3)] if build is not Counting else [torch.randn(4, 8) for _ in range(3)]
    got = _counted(build(), batches) if build is Counting else _epoch_metrics(build())
    monkeypatch.setenv(PROBE_SWITCH, "0")
    want = _counted(build(), batches) if build is Counting else _epoch_metrics(build())
    assert got["metric"] == want["metric"], (got, want)


PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def test_a_reused_plugin_resumes_after_two_fits_with_the_checkpoints_plan(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    """Was: the plan measured by the plugin's last fit (another model) was compared with the checkpoint's at the next
    resume, before that resume's surgery: "other lightning_hbm settings ... layer_modes" though both runs had the
    same settings (the resume takes the checkpoint's plan)."""
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", max_bytes_per_param=0.75, probe_batch=PROBE)  # one, reused
    first = trainer_factory(max_steps=1, plugins=[plugin])
    first.fit(gpt_factory(), datamodule_factory(train_samples=8))
    saved = dict(plugin.layer_modes or {})
    first.save_checkpoint(tmp_path / "first.ckpt")
    trainer_factory(max_steps=1, plugins=[plugin]).fit(gpt_factory(n_layer=1), datamodule_factory(train_samples=8))
    assert plugin.layer_modes != saved  # another model: another plan, measured by the same plugin
    resumed = trainer_factory(max_steps=2, plugins=[plugin])
    resumed.fit(gpt_factory(seed=1), datamodule_factory(train_samples=8), ckpt_path=tmp_path / "first.ckpt")  # was: refused
    assert resumed.global_step == 2 and plugin.layer_modes == saved


def test_a_loader_that_differs_on_some_ranks_only_is_refused_on_every_rank_naming_them() -> None:
    """The ranks' refusals are gathered (a collective): a rank whose loader matches the checkpoint raises too (was: it
    went on into the next collective while the other rank raised, and waited there until the timeout)."""
    from lightning_hbm.data import ResumableDataLoader, check_resume_loader

    saved = ResumableDataLoader(list(range(8)), batch_size=2).state_dict()
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [saved]}}}}
    other = ResumableDataLoader(list(range(8)), batch_size=4)
    refused = "ResumableDataLoader.load_state_dict: the checkpoint was saved with another training dataloader (batch_size 2 -> 4"
    with pytest.raises(ValueError, match=r"^On rank\(s\) 1 of 2: " + re.escape(refused) + r".*No rank changed the model\.$"):
        check_resume_loader(None, checkpoint, lambda: ResumableDataLoader(list(range(8)), batch_size=2),
                            lambda mine: [mine, str(_refusal(checkpoint, other))])  # fmt: skip
    with pytest.raises(ValueError, match=r"^" + re.escape(refused)):  # every rank alike: the one-process message
        check_resume_loader(None, checkpoint, lambda: other, lambda mine: [mine, mine])


def _refusal(checkpoint: dict[str, Any], loader: Any) -> str:
    from lightning_hbm.data import check_resume_loader

    with pytest.raises(ValueError) as caught:
        check_resume_loader(None, checkpoint, lambda: loader)
    return str(caught.value)


def _dilated() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(4, 8, 3, dilation=3, padding=3)  # descript DAC's residual convolutions: a weight delta
    return torch.nn.Sequential(conv, torch.nn.ReLU(), torch.nn.Conv1d(8, 2, 1)), torch.randn(2, 4, 16)


def test_an_adapter_saved_with_weight_deltas_says_plain_peft_computes_another_function(tmp_path: Any) -> None:
    """Was: saved without a word; ``PeftModel.from_pretrained`` on it stopped ("The size of tensor a (16) must match the
    size of tensor b (20)"), or for a standardized or reflect-padded convolution silently computed another function.
    The warning names the layers and the two ways to the trained function, each checked here."""
    import peft
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    model, x = _dilated()
    LoRA(r=2).transform_model(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        want = model(x)
    with pytest.warns(UserWarning, match=r"LoRA.save_adapter: 1 convolution\(s\) 0 are adapted by a low-rank delta of their weight.*"
                      r"plain peft \(PeftModel.from_pretrained\) computes lora_B\(lora_A\(x\)\) for them instead.*LoRA.merge\(model\)"):  # fmt: skip
        LoRA.save_adapter(model, tmp_path / "adapter")
    with pytest.raises(RuntimeError, match="must match the size"):  # what the warning says of plain peft
        peft.PeftModel.from_pretrained(_dilated()[0], str(tmp_path / "adapter"))(x)
    base = _dilated()[0]  # the first way: lightning_hbm's LoRA on the base, then the adapter's weights
    LoRA(r=2).transform_model(base)
    set_peft_model_state_dict(base, load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    with torch.no_grad():
        torch.testing.assert_close(base(x), want, rtol=0, atol=0)
    plain = _dilated()[0]  # the second: the merged weights in the plain model
    plain.load_state_dict(LoRA.merge(model, dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-5)


class Tables(pl.LightningModule):
    """A token table at 8,192 values (converted by 'auto') and BERT's 2-row token-type table (kept wide by 'auto')."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.typ = torch.nn.Embedding(128, 64), torch.nn.Embedding(2, 64)
        self.body, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.head(self.body(self.tok(batch) + self.typ(torch.zeros_like(batch)))).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _fit_tables(tmp_path: Any, steps: int, ckpt: Any = None, **settings: Any) -> Tables:
    model = Tables()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path,
                         plugins=[QuantizedPrecision("nf4-dq", dtype="float32", **settings)], callbacks=[LoRA(r=2, target_modules=["body"])])  # fmt: skip
    batches = [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    trainer.fit(model, DataLoader(batches, batch_size=None), ckpt_path=ckpt)
    if ckpt is None:
        trainer.save_checkpoint(tmp_path / "tables.ckpt")
    return model


@pytest.mark.parametrize(("saved", "resumed", "figures"), [({}, {"quantize_embeddings": "int8"}, "checkpoint 8192, this run 0"),
                                                           ({"quantize_embeddings": "int8"}, {}, "checkpoint 0, this run 8192")])  # fmt: skip
def test_a_resume_that_changes_which_small_tables_are_int8_is_refused(tmp_path: Any, saved: dict, resumed: dict, figures: str) -> None:
    """Was: 'auto' (the 2-row table kept wide) and an explicit 'int8' (converted) saved the same settings, so a resume
    with the other went on silently on another frozen table (its int8 rounding added or dropped)."""
    _fit_tables(tmp_path, 1, **saved)
    with pytest.raises(ValueError, match=r"other lightning_hbm settings.*\n  - QuantizedPrecision.embeddings_kept_under: " + figures):
        _fit_tables(tmp_path, 2, tmp_path / "tables.ckpt", **resumed)


def test_a_checkpoint_that_does_not_record_it_is_resumed_saying_so(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint saved before the setting was recorded (here: lightning_hbm before session 31, every table in int8):
    the resume says it cannot tell, by name, what it does and how to resume as that run did; that way goes on."""
    from lightning_hbm.layers.embedding import QuantizedEmbedding
    from lightning_hbm.precision import quantization, target_listing

    settings = quantization.Quantization.settings
    with monkeypatch.context() as old:
        old.setattr(target_listing, "SMALL_EMBEDDING_VALUES", 0)  # where the listing reads it
        old.setattr(quantization.Quantization, "settings", lambda self: {k: v for k, v in settings(self).items() if k != quantization.KEPT_UNDER})
        assert isinstance(_fit_tables(tmp_path, 1).typ, QuantizedEmbedding)
    with pytest.warns(UserWarning, match=r"does not record whether its input embeddings under 8,192 values \(typ\) were stored in int8.*"
                      r"This run keeps them wide.*resume with quantize_embeddings='int8'"):  # fmt: skip
        assert not isinstance(_fit_tables(tmp_path, 2, tmp_path / "tables.ckpt").typ, QuantizedEmbedding)
    assert isinstance(_fit_tables(tmp_path, 2, tmp_path / "tables.ckpt", quantize_embeddings="int8").typ, QuantizedEmbedding)


def test_layer_modes_naming_a_table_auto_keeps_wide_says_why_and_how() -> None:
    """Was: "layer_modes names ['1'], which are not quantizable Linear layers": the 2-row table is an embedding 'auto'
    keeps wide as too small; the error now says so, and the setting that converts it (which then takes the plan)."""
    from lightning_hbm.layers.embedding import QuantizedEmbedding
    from lightning_hbm.precision import quantize_model

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Embedding(128, 64), torch.nn.Embedding(2, 64), torch.nn.Linear(64, 64))

    with pytest.raises(ValueError, match=r"layer_modes names \['1'\].*left alone: 1: too small to gain: 0.5 KiB.*quantize_embeddings='int8'"):
        quantize_model(model(), "nf4-dq", "float32", quantize_embeddings="auto", layer_modes={"1": "int8"})
    with pytest.raises(ValueError, match=r"left alone: 1: too small to gain"):  # the plugin's checks: the same words
        QuantizedPrecision("nf4-dq", dtype="float32", layer_modes={"1": "int8"}).convert_module(model())
    converted = model()
    quantize_model(converted, "nf4-dq", "float32", quantize_embeddings=True, layer_modes={"1": "int8"})
    assert isinstance(converted[1], QuantizedEmbedding)
