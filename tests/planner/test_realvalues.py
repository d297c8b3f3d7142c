"""The planner on ordinary models whose Python reads tensor values (FakeTensorMode alone cannot run them)."""

from __future__ import annotations

import math
import types
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.planner import Candidate, plan, predict
from lightning_hbm.planner.reference import memtracker_peak

BATCH = synthetic_batch(2, 16)


class _TokenLM(pl.LightningModule):
    """Embedding -> ``self.body`` -> Linear head; subclasses build ``body``; AdamW over every parameter."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.head = nn.Linear(width, 256)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self.head(self.body(self.embed(idx)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TruncNormalInit(_TokenLM):
    """torchvision/timm style: ``trunc_normal_`` init (``.item()`` of its bounds, ``if not mask.any()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(32, 2304)  # 73,728 elements: above the real-twin size, its checks are guessed
        self.back = nn.Linear(2304, 32)
        for module in (self.wide, self.back, self.head):
            nn.init.trunc_normal_(module.weight, std=0.02)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.back(F.gelu(self.wide(h)))


def test_trunc_normal_init() -> None:
    prediction = predict(TruncNormalInit, BATCH, Candidate("32-true"))
    assert prediction.categories["parameters"] == parameter_bytes(TruncNormalInit())
    assert prediction.guessed_reads > 0  # the big weight's rejection checks: read as False, loop ends
    result = plan(TruncNormalInit, BATCH, candidates=[Candidate("32-true")])
    assert "read as 0/False" in str(result)  # and the plan says so


class DropPath(_TokenLM):
    """Stochastic depth as many repositories write it: a Python branch on ``torch.rand(1).item()``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)))
        self.p = p

    def body(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training and torch.rand(1).item() < self.p:
                continue  # the whole block dropped for this step
            h = h + block(h)
        return h


def test_drop_path_item() -> None:
    prediction = predict(DropPath, BATCH, Candidate("32-true"))
    assert prediction.guessed_reads == 0  # torch.rand(1) has a real twin: its value was really drawn
    assert prediction.peak > prediction.categories["parameters"]


class RopeScaled(_TokenLM):
    """Llama-3 style RoPE frequency scaling: Python ``if wavelen < ...`` on each frequency (a 0-dim tensor)."""

    def __init__(self, width: int = 32, factor: float = 8.0) -> None:
        super().__init__(width)
        freqs = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
        scaled = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                scaled.append(freq)
            elif wavelen > low_wavelen:
                scaled.append(freq / factor)
            else:
                scaled.append(freq / 2)
        self.register_buffer("freqs", torch.stack(scaled), persistent=False)
        self.mix = nn.Linear(width, width)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(h.shape[1], device=h.device)[:, None] * self.freqs[None, :]
        return self.mix(h * torch.cat([angles.cos(), angles.sin()], dim=-1))


def test_rope_scaling_branches() -> None:
    prediction = predict(RopeScaled, BATCH, Candidate("bf16-true"))
    assert prediction.guessed_reads == 0 and prediction.categories["other"] >= 16 * 4  # the freqs buffer (fp32)


class LogsLossItem(_TokenLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()  # what many training_steps do for their own logging
        return loss


def test_loss_item_in_training_step() -> None:
    prediction = predict(LogsLossItem, BATCH, Candidate("32-true"))
    assert prediction.peak == pytest.approx(memtracker_peak(LogsLossItem, BATCH, Candidate("32-true")), rel=0.05)


@pytest.mark.slow
def test_from_pretrained_factory_reads_no_weight(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)

    class Pretrained(_TokenLM):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch[0], labels=batch[1].contiguous()).loss

    def no_reading(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the planner read the checkpoint's weights")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "load_state_dict", no_reading)
        patch.setattr("safetensors.torch.load_file", no_reading)
        prediction = predict(Pretrained, BATCH, Candidate("32-true"))
    assert prediction.categories["parameters"] == parameter_bytes(Pretrained())  # loaded for real here


class Seq2Seq(_TokenLM):
    """``nn.Transformer`` with a causal ``tgt_mask`` and a padding mask: ``_detect_is_causal_mask`` reads the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        padding = torch.zeros(h.shape[:2], dtype=torch.bool)
        return self.transformer(h, h, tgt_mask=mask, src_key_padding_mask=padding, memory_key_padding_mask=padding)


@pytest.mark.slow
def test_nn_transformer_with_masks() -> None:
    candidate = Candidate("32-true")
    prediction = predict(Seq2Seq, BATCH, candidate)
    assert prediction.guessed_reads == 0
    assert prediction.peak == pytest.approx(memtracker_peak(Seq2Seq, BATCH, candidate), rel=0.05)


class SequentialBlocks(_TokenLM):
    """Blocks in an ``nn.Sequential``: ActivationCheckpointing cannot find them by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)))

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks(h)


@pytest.mark.slow
def test_checkpointing_blocks_named_by_the_candidate() -> None:
    batch = synthetic_batch(4, 32)
    named = Candidate("32-true", checkpointing="full", blocks=["blocks.0", "blocks.1", "blocks.2", "blocks.3"])
    wrong = Candidate("32-true", checkpointing="full", blocks=["blocks.9"])
    result = plan(SequentialBlocks, batch, candidates=[Candidate("32-true"), named, wrong])
    full, checkpointed = result.find(Candidate("32-true")), result.find(named)
    assert checkpointed.categories["activations"] < 0.6 * full.categories["activations"]
    assert "blocks: [blocks.0, blocks.1, blocks.2, blocks.3]" in named.yaml()
    # a name that matches nothing: the callback's own error, under the table; the other candidates are planned
    assert len(result.predictions) == 2 and "['blocks.9'] name no submodule path" in result.notes()[0]
    with pytest.raises(ValueError, match=r"Candidate blocks must be a non-empty list of class names or module paths, got 'blocks'"):
        Candidate(checkpointing="full", blocks="blocks")  # type: ignore[arg-type]


class _KeepPositive(nn.Module):
    """Boolean indexing of a large activation: its output shape depends on values a fake tensor does not hold."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kept = h[h > 0]  # 2 x 16 x 4096 elements: above the real-twin size, so no twin can answer
        return h * (kept.numel() / h.numel())


class DataDependentShape(_TokenLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 4096), _KeepPositive(), nn.Linear(4096, 32)) for _ in range(2))

    def body(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + block(h)
        return h


class _KeepPositiveDict(_KeepPositive):
    def forward(self, h: torch.Tensor) -> dict:  # type: ignore[override]
        return {"h": super().forward(h)}


class DataDependentDict(DataDependentShape):
    def __init__(self) -> None:
        super().__init__()
        self.blocks[0][1] = _KeepPositiveDict()

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[0][2](self.blocks[0][1](self.blocks[0][0](h))["h"])


def test_untraceable_module_is_named() -> None:
    from lightning_hbm.planner.building import build_template
    from lightning_hbm.planner.tracing import UntraceableModule, trace

    with pytest.raises(UntraceableModule, match=r"forward of blocks\.0\.1 \(_KeepPositive\) cannot run on fake tensors: "
                       r"DynamicOutputShapeException.*Fix: write the branch without reading values") as info:
        trace(build_template(DataDependentShape), BATCH, Candidate("32-true"), "cpu", None)
    assert info.value.module_name == "blocks.0.1" and info.value.module_type == "_KeepPositive"
    DataDependentShape().training_step(BATCH, 0).backward()  # the model itself runs: only the trace cannot


@pytest.mark.parametrize("candidate", [Candidate("32-true"), Candidate("32-true", checkpointing="full")], ids=str)
def test_untraceable_module_runs_for_real(candidate: Candidate) -> None:
    prediction = predict(DataDependentShape, BATCH, candidate)
    assert prediction.fallbacks == tuple(
        f"blocks.{i}.1 (real tensors: DynamicOutputShapeException: aten.nonzero.default)" for i in range(2)
    )
    torch.manual_seed(0)
    reference = memtracker_peak(DataDependentShape, BATCH, candidate)
    assert abs(prediction.peak / reference - 1) < 0.03, (prediction.peak, reference)


def test_fallback_is_printed(capsys: pytest.CaptureFixture) -> None:
    from lightning_hbm.planner.config import print_plan

    print_plan(plan(DataDependentShape, BATCH, candidates=[Candidate("32-true")]))
    assert "32-true: fake tensors cannot run blocks.0.1 (real tensors: DynamicOutputShapeException" in capsys.readouterr().out


def test_a_module_too_large_to_run_for_real_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hbm.planner import fallbacks

    monkeypatch.setattr(fallbacks, "MAX_REAL_RUN_BYTES", 2**10)  # a 1 KiB host: block 0's inputs and weights are larger
    with pytest.raises(RuntimeError, match=r"the forward of blocks\.0\.1 \(_KeepPositive\) cannot run on fake tensors "
                       r"\(DynamicOutputShapeException: aten\.nonzero\.default\), and running it for real on zeros would "
                       r"take 512\.00 KiB of host memory .*MAX_REAL_RUN_BYTES = 1\.00 KiB\)\. Fix: write the branch"):
        predict(DataDependentShape, BATCH, Candidate("32-true"))


class _KeepPositiveObject(_KeepPositive):
    def forward(self, h: torch.Tensor) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(h=super().forward(h))


class DataDependentObject(DataDependentShape):
    def __init__(self) -> None:
        super().__init__()
        self.blocks[0][1] = _KeepPositiveObject()

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[0][2](self.blocks[0][1](self.blocks[0][0](h)).h)


def test_fallback_takes_dicts_and_refuses_other_outputs() -> None:
    prediction = predict(DataDependentDict, BATCH, Candidate("32-true"))  # a dict of tensors: planned, named
    assert prediction.fallbacks == ("blocks.0.1 (real tensors: DynamicOutputShapeException: aten.nonzero.default)",)
    with pytest.raises(TypeError, match=r"blocks\.0\.1 returns SimpleNamespace holding SimpleNamespace: the real-tensor "
                       r"fallback handles tensors, numbers and strings in tuples, lists and dicts"):
        predict(DataDependentObject, BATCH, Candidate("32-true"))


class TinyMamba(pl.LightningModule):
    """transformers' Mamba on its reference PyTorch path (no mamba_ssm kernels): a sequential selective scan."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MambaConfig, MambaForCausalLM

        config = MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
        self.model = MambaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_mamba_plans_without_fallback() -> None:
    """Measured without MemTracker's module hooks (``module_hooks=False``, planner/reference.py): 7,848,036 B, the plan
    to the byte; with them 7,889,508 B (+41,472 B, -0.53 % for the plan: tensors the hooks keep alive, not the step's;
    2-core CPU dev machine, session 34, Dec 6 2026)."""
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    prediction = predict(TinyMamba, batch, Candidate("32-true"))
    assert prediction.fallbacks == ()  # fake tensors run its scan: nothing needs real tensors
    measured = memtracker_peak(TinyMamba, batch, Candidate("32-true"), module_hooks=False)
    assert abs(prediction.peak / measured - 1) < 0.03
    assert abs(prediction.peak - measured) <= 8, (prediction.peak, measured)


def test_twin_arguments_are_read_without_pytree_as_pytree_reads_them() -> None:
    """Session 36: each op's twin took its arguments through pytree (flatten, then rebuild: a tenth of a small model's
    plan). Read directly now, for what aten passes (tensors, ``Tensor?[]`` lists with None, scalars, dtypes in kwargs);
    anything else still by pytree (a Generator here); no twin: no result."""
    from lightning_hbm.planner.building import _fake_mode
    from lightning_hbm.planner.realvalues import _FAILED, RealValues

    aten = torch.ops.aten
    fake_mode = _fake_mode()
    values = RealValues(fake_mode)
    real, index = torch.arange(6.0).reshape(2, 3), torch.tensor([2, 0])
    with fake_mode:
        fake, fake_index, lone = torch.empty(2, 3), torch.empty(2, dtype=torch.long), torch.empty(2)
    values.add(fake, real)
    values.add(fake_index, index)
    assert torch.equal(values._run_real(aten.index.Tensor, (fake, [None, fake_index]), {}), real[:, index])
    assert torch.equal(values._run_real(aten.add.Tensor, (fake, fake), {"alpha": 2}), real + 2 * real)
    assert values._run_real(aten.sum.dim_IntList, (fake, [1]), {"dtype": torch.float64}).dtype == torch.float64
    generator = torch.Generator().manual_seed(0)
    assert values._real_arguments((fake, generator)) is None  # not an aten leaf it knows: pytree's path
    drawn = values._run_real(aten.normal.float_Tensor, (1.0, fake), {"generator": generator})
    assert drawn.shape == (2, 3)
    assert values._run_real(aten.add.Tensor, (fake, lone), {}) is _FAILED  # no twin


def test_plans_read_twins_without_flattening_each_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field of the plans equal to the ones the pytree path makes (the twins, values read and guesses alike), and
    pytree no longer called once per op: was 1,200+ calls on this plan."""
    from torch.utils._pytree import tree_flatten

    from lightning_hbm.planner import realvalues

    def planned() -> list:
        torch.manual_seed(0)
        predictions = plan(DropPath, BATCH, candidates=[Candidate("32-true"), Candidate("nf4-dq", lora_r=4)]).predictions
        return [sorted((k, repr(v)) for k, v in vars(p).items() if k != "candidate") for p in predictions]

    calls: list[int] = []
    monkeypatch.setattr(realvalues, "tree_flatten", lambda tree: calls.append(1) or tree_flatten(tree))
    fast = planned()
    assert len(calls) < 50
    run_real = realvalues.RealValues._run_real

    def by_pytree(self: Any, func: Any, args: tuple, kwargs: dict) -> Any:
        real = self._real((args, kwargs))
        return realvalues._FAILED if real is None else run_real(self, func, tuple(real[0]), dict(real[1]))

    monkeypatch.setattr(realvalues.RealValues, "_run_real", by_pytree)
    monkeypatch.setattr(realvalues, "_leaves", lambda value: tree_flatten(value)[0])
    assert planned() == fast
