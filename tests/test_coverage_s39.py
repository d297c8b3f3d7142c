"""Adapters the training step never runs, and the "found no repeated blocks" error (issue 53, session 39).

* Musicgen's decoder (transformers ``MusicgenForCausalLM``, trained without encoder states) got LoRA adapters on its 8
  cross-attention projections (``encoder_attn``) that never run: no gradient, never trained, their memory spent for
  nothing, and nothing said so (the first backward's adapter watch cannot judge a layer whose parent did not run
  either). Now the probe step (the user's step run once before the model is changed) records which layers and parent
  modules ran, and the surgery warns at fit start with the count, the names, the trainable parameters they hold and
  the fix (``LoRA(exclude_modules=[...])``). Quantized layers never run are said in an info line with their stored
  size (quantized, they take the least they can: only the user can remove them).
* Healthy models whose adapters all run (T5, Llama, ViT) get no such warning; neither do the experts of a
  mixture-of-experts layer no token of the probe batch was routed to (SwitchTransformers' ``expert_N``: picked by the
  data, a sibling ran).
* ``ActivationCheckpointing()`` on a model with no stack said only "no nn.ModuleList or nn.Sequential whose children
  share one class", though since session 38 a plain module running children of one class in order is a stack too;
  now the error says what is accepted, names the plain modules that came near, and gives a ``blocks=[...]`` example.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.layers.coverage_table import UNRUN_ADAPTERS
from lightning_hbm.record import coverage_of
from tests import families_s38 as families
from tests.layers.test_blocks_plain_s38 import Net, ShuffledStage

transformers = pytest.importorskip("transformers")

UNRUN = "adapter(s) sit on layers the training step never runs"


class _Seen(pl.Callback):
    """The warnings raised before the fit's first training step (at fit start: the surgery)."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self.caught = caught
        self.at_start: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = [str(w.message) for w in self.caught]


class _Task(pl.LightningModule):
    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(module: pl.LightningModule, batch: Any, callbacks: list[pl.Callback]) -> list[str]:
    """One step under nf4-dq with the given callbacks; the warnings said at fit start."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = _Seen(caught)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False, plugins=[QuantizedPrecision()],
            callbacks=[*callbacks, seen],
        )  # fmt: skip
        trainer.fit(module, DataLoader([batch], batch_size=None))
    return seen.at_start


def test_musicgen_cross_attention_adapters_that_never_run_are_named_at_fit_start_with_the_fix() -> None:
    """Was: no word; the 8 ``encoder_attn`` adapters (8,192 trainable parameters) stayed at lora_B = 0."""
    module, lora = families.Task("musicgen"), LoRA(r=8, alpha=16)
    said = _fit(module, families.FAMILIES["musicgen"].batch(1), [lora])
    unrun = [m for m in said if UNRUN in m]
    assert len(unrun) == 1, said
    message = unrun[0]
    assert message.startswith("lightning_hbm: 8 adapter(s)") and "encoder_attn.q_proj" in message
    fix = "LoRA(exclude_modules=['encoder_attn.k_proj', 'encoder_attn.out_proj', 'encoder_attn.q_proj', 'encoder_attn.v_proj'])"
    assert fix in message and "self_attn" not in message.partition("exclude_modules")[2]
    # the figure is the adapters' trainable parameters, and they were not trained: lora_B still zero after the step
    named = [n for n in lora.adapted_modules if "encoder_attn" in n]
    held = sum(p.numel() for n in named for p in module.get_submodule(n).parameters() if p.requires_grad)
    assert len(named) == 8 and f"They hold {held:,} trainable parameters" in message
    assert all(torch.count_nonzero(p) == 0 for n in named for p in module.get_submodule(n).lora_B.parameters())
    # the coverage table's adapters row says them as never trained too (was: all counted as trained)
    row = next(r for r in coverage_of(module) or [] if r.kind == "LoRA adapters (trained)")
    assert row.reasons == {UNRUN_ADAPTERS: held} and row.params > held
    # the fix given works: no adapter there, the warning gone, the self-attention still adapted
    lora = LoRA(r=8, alpha=16, exclude_modules=["encoder_attn.k_proj", "encoder_attn.out_proj", "encoder_attn.q_proj", "encoder_attn.v_proj"])
    assert not [m for m in _fit(families.Task("musicgen"), families.FAMILIES["musicgen"].batch(1), [lora]) if UNRUN in m]
    assert lora.adapted_modules and not [n for n in lora.adapted_modules if "encoder_attn" in n]
    assert any("self_attn.q_proj" in n for n in lora.adapted_modules)


def test_quantized_layers_never_run_are_said_with_their_stored_size(caplog: pytest.LogCaptureFixture) -> None:
    """Without LoRA: the cross-attention stored nf4-dq and never run is an info line (the least it can take)."""

    class Scaled(families.Task):  # the model frozen and quantized whole; one trained scale on its loss
        def __init__(self) -> None:
            super().__init__("musicgen")
            self.scale = nn.Parameter(torch.ones(()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.scale * super().training_step(batch, batch_idx)

    module = Scaled()
    with caplog.at_level(logging.INFO):
        said = _fit(module, families.FAMILIES["musicgen"].batch(1), [])
    assert not [m for m in said if UNRUN in m]
    lines = [r.getMessage() for r in caplog.records if "quantized layer(s) are never run by the training step" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lightning_hbm: 8 quantized layer(s)") and "encoder_attn" in lines[0], lines
    assert "MiB stored" in lines[0]


T5 = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)
IDS = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def _lm(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _vit(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(pixel_values=batch[0], labels=batch[1]).loss


HEALTHY: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Any]] = {
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)), _lm, IDS),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)), _lm, IDS),
    "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8, num_labels=5)),
        _vit, (torch.randn(2, 3, 32, 32), torch.tensor([1, 2]))),
    # experts in a ModuleDict (expert_0 ..): the probe's one sample reaches a few; the others are picked by the data
    "switch": (lambda: transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        **T5, num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1, num_experts=8)), _lm, IDS),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_a_healthy_model_whose_adapters_all_run_gets_no_warning(name: str) -> None:
    build, loss, batch = HEALTHY[name]
    said = _fit(_Task(build(), loss), batch, [LoRA(r=8, alpha=16)])
    assert not [m for m in said if UNRUN in m], said


def test_unrun_layers_leave_out_branches_and_numbered_siblings() -> None:
    from lightning_hbm.layers.readers import Read, unrun_layers

    layers = dict.fromkeys(["a.0.x", "a.1.x", "b.expert_0.w", "b.expert_3.w", "c.q", "c.g", "d.0.y", "d.1.y", "e.z", "head"], nn.Identity())
    called = {"a.0.x", "a", "b.expert_3.w", "b.expert_3", "c", "c.q", "e"}
    reads = {"e.z": Read("E.forward", "linear", False), "head": Read("T.training_step", "shape", True)}
    # a.1.x: a sibling ran (LayerDrop); expert_0: a sibling expert ran; c.g: its parent ran (a branch); e.z: read
    assert unrun_layers(layers, called, reads) == {"d.0.y", "d.1.y", "head"}  # head: its shape read only, no use


def test_no_repeated_blocks_says_what_a_stack_is_and_names_the_modules_that_came_near() -> None:
    """Was: "(no nn.ModuleList or nn.Sequential whose children share one class ...)", not the plain-module stacks
    taken since session 38, nor why ``s1``/``s2`` were not."""
    with pytest.raises(
        ValueError,
        match=r"found no repeated blocks in Net: .*A stack is an nn\.ModuleList or nn\.Sequential whose children are composite "
        r"modules of one class, or a plain module whose children are all composite modules of one class that its forward "
        r"runs one after another \(a loop `for block in self\.children\(\)`, or one statement `x = self\.<child>\(x\)` per "
        r"child, in the order they were registered\)\. Plain modules holding children of one class that their forward does "
        r"not run one after another .*so not taken: s1 \(3 Sequential\), s2 \(3 Sequential\)\..*Pass blocks=\[\.\.\.\] "
        r"with the class names or module paths of the layers to checkpoint, e\.g\. blocks=\['s1\.b1', 's1\.b2', 's1\.b3'\]",
    ):
        ActivationCheckpointing().transform_model(Net(ShuffledStage))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class _Dense(nn.Module):  # DenseNet-like: each block sees the sum of the earlier outputs, not a run in order
    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2, self.b3 = _Block(), _Block(), _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b1(x)
        z = self.b2(x + y)
        return self.b3(x + y + z)


def test_no_repeated_blocks_names_the_block_class_of_the_users_module_as_the_fix() -> None:
    model = _Dense()
    with pytest.raises(ValueError, match=r"so not taken: _Dense \(3 _Block\)\. ModuleLists seen: \[\]\..*e\.g\. blocks=\['_Block'\]"):
        ActivationCheckpointing().transform_model(model)
    callback = ActivationCheckpointing(blocks=["_Block"])  # the fix named works
    callback.transform_model(model)
    assert callback.checkpointed == ["b1", "b2", "b3"]
