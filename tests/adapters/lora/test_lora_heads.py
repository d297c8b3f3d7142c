"""Task heads under LoRA (issue 33): found by what the model is, trained in full precision, saved with the adapter.

Real transformers classes from tiny configs (random weights), real peft and bitsandbytes on CPU.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import coverage, task_heads

transformers = pytest.importorskip("transformers")


def _trainer(tmp_path: Path, steps: int, lora: LoRA, quant: bool = False) -> pl.Trainer:
    return pl.Trainer(
        callbacks=[lora],
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4", dtype="float32")] if quant else None,
    )


class _Classifier(pl.LightningModule):
    """A model with a classification head trained with cross-entropy: ``forward(x)`` returns logits."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, hf: bool = True) -> None:
        super().__init__()
        self.model, self.hf = model, hf
        self.data = TensorDataset(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=x) if self.hf else self.model(x)
        return out.logits if self.hf else out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _bert_config() -> Any:
    return transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=99, num_labels=3
    )


def _bert_classifier(seed: int = 0) -> _Classifier:
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(_bert_config())
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(1, 99, (8, 12), generator=gen)
    return _Classifier(model, x, x[:, 0] % 3)


def test_wav2vec2_ctc_head_is_trained_in_full_precision_by_default(tmp_path: Path) -> None:
    """Was: the CTC ``lm_head`` quantized to 4 bits and adapted (no nn.Embedding, so no head was found)."""
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=12,
        conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, ctc_loss_reduction="mean",
    )

    class CTC(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.Wav2Vec2ForCTC(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(batch_idx)
            audio = torch.randn(2, 1600, generator=gen)
            labels = torch.randint(1, 12, (2, 5), generator=gen)
            return self.model(input_values=audio, labels=labels).loss

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = CTC()
    lora = LoRA(r=4)
    trainer = _trainer(tmp_path, 2, lora, quant=True)
    before = module.model.lm_head.weight.detach().clone()
    trainer.fit(module)
    head = module.model.lm_head
    assert lora.task_heads == ["model.lm_head"] and lora.saved_modules == ["model.lm_head"]
    assert type(head) is nn.Linear and head.weight.dtype == torch.float32 and head.weight.requires_grad
    assert not hasattr(head, "lora_A") and not torch.equal(head.weight, before)
    # the rest of the model is 4-bit and adapted
    q = module.model.wav2vec2.encoder.layers[0].attention.q_proj
    assert hasattr(q, "lora_A") and not q.get_base_layer().weight.is_floating_point()


def test_sequence_classifier_adapter_reloads_in_plain_peft_with_the_trained_head(tmp_path: Path, caplog: Any) -> None:
    """Was: val acc 0.895 trained, 0.090 reloaded: the random classifier not saved, task_type None, no warning."""
    from peft import PeftModel

    module = _bert_classifier()
    as_built = {k: v.clone() for k, v in module.model.state_dict().items()}
    lora = LoRA(r=4)
    trainer = _trainer(tmp_path, 4, lora)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    said = [r.getMessage() for r in caplog.records]
    assert any("trains the task head(s) ['model.classifier'] in full precision" in m and "modules_to_save=[]" in m for m in said)
    assert not any("narrower than r" in m for m in said) and not any("task head" in str(w.message) for w in caught)
    assert lora.saved_modules == ["model.classifier"] and not torch.equal(module.model.classifier.weight, as_built["classifier.weight"])

    path = LoRA.save_adapter(module, tmp_path / "adapter")
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "classifier" in config["modules_to_save"]
    # a fresh base as from_pretrained of the base checkpoint would give: same backbone, another random classifier
    torch.manual_seed(123)
    base = transformers.BertForSequenceClassification(_bert_config())
    base.load_state_dict({k: v for k, v in as_built.items() if not k.startswith("classifier.")}, strict=False)
    assert not torch.equal(base.classifier.weight, module.model.classifier.weight)
    reloaded = PeftModel.from_pretrained(base, str(path)).eval()
    module.eval()
    x = module.data.tensors[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, module(x), rtol=1e-6, atol=1e-6)


def test_opting_out_of_the_head_is_warned_at_fit_start_and_at_export(tmp_path: Path) -> None:
    module = _bert_classifier()
    lora = LoRA(r=4, modules_to_save=[])
    trainer = _trainer(tmp_path, 1, lora)
    with pytest.warns(UserWarning, match=r"LoRA\(modules_to_save=\[\]\) leaves the task head\(s\) \['model.classifier'\].*frozen.*"
                      r"LoRA\(modules_to_save=\['model.classifier'\]\)"):
        trainer.fit(module)
    assert not module.model.classifier.weight.requires_grad and lora.saved_modules == []
    with pytest.warns(UserWarning, match=r"save_adapter: the task head\(s\) \['classifier'\] .* not in the adapter"):
        LoRA.save_adapter(module, tmp_path / "adapter")


def test_hand_written_transformer_classifier_head_is_trained_and_named(tmp_path: Path, caplog: Any) -> None:
    """Was: its ``Linear(128, 4)`` head silently a frozen ``Linear4bit``, not adapted, not in the coverage table."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True), 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.encoder, self.head = nn.Linear(16, 128), encoder, nn.Linear(128, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x)).mean(1))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 16, generator=gen)
    module = _Classifier(Net(), x, (x[:, 0, 0] > 0).long() + 2 * (x[:, 0, 1] > 0).long(), hf=False)
    before = module.model.head.weight.detach().clone()
    lora = LoRA(r=8)
    trainer = _trainer(tmp_path, 3, lora, quant=True)
    with caplog.at_level(logging.INFO):
        trainer.fit(module)
    head = module.model.head
    assert lora.saved_modules == ["model.head"] and lora.narrow_left_out == []
    assert type(head) is nn.Linear and head.weight.requires_grad and not torch.equal(head.weight, before)
    said = [r.getMessage() for r in caplog.records]
    assert any("trains the task head(s) ['model.head']" in m for m in said)
    assert not any("narrower than r" in m for m in said)
    reasons = {r for row in coverage(module, quantizing=True, adapting=True) for r in row.reasons}
    assert "LoRA modules_to_save: trained in full precision" in reasons  # the head's row in the coverage table
    assert hasattr(module.model.embed, "lora_A")  # the input projection is no head: adapted


def test_language_model_vocabulary_head_is_no_task_head() -> None:
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=37, vocab_size=99
    )
    assert task_heads(transformers.LlamaForCausalLM(config)) == []
    assert task_heads(transformers.LlamaForSequenceClassification(config)) == ["score"]
    assert task_heads(transformers.BertForTokenClassification(_bert_config())) == ["classifier"]
    # a plain MLP has no backbone: nothing is taken from LoRA's targets
    assert task_heads(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))) == []


def test_narrow_layers_message_points_to_modules_to_save(caplog: Any) -> None:
    """A layer narrower than r that is no head (a router gate): the message says how to train it (in full)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 16))
    lora = LoRA(r=4)
    with caplog.at_level(logging.INFO):
        lora.transform_model(model)
    assert lora.narrow_left_out == ["2", "3"]
    assert any("narrower than r" in r.getMessage() and "LoRA(modules_to_save=['2', '3'])" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_real_minilm_sequence_classifier_under_qlora_reloads_in_plain_peft(tmp_path: Path) -> None:
    """The issue's run: all-MiniLM-L6-v2 ``AutoModelForSequenceClassification`` + default ``LoRA()``, nf4 base."""
    from peft import PeftModel

    from lightning_hbm import quantize_model
    from lightning_hbm.pretrained import minilm_path, missing

    if missing("minilm"):
        pytest.skip(f"all-MiniLM-L6-v2: {missing('minilm')}")
    path = minilm_path()
    transformers.logging.set_verbosity_error()  # "newly initialized: classifier" is the point here, not noise

    def load(seed: int) -> nn.Module:
        torch.manual_seed(seed)  # from_pretrained initialises the missing classifier at random
        return transformers.AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=2)

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1000, 5000, (16, 16), generator=gen)
    module = _Classifier(load(0), x, (x[:, 0] > 3000).long())
    lora = LoRA(r=4)
    trainer = _trainer(tmp_path, 4, lora, quant=True)
    trainer.fit(module)
    assert lora.saved_modules == ["model.classifier"] and type(module.model.classifier) is nn.Linear
    adapter = LoRA.save_adapter(module, tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"

    base = load(1)  # another random classifier, as a new user's reload gets
    # the same deterministic quantization as in training, the head kept in full precision as the plugin kept it
    # (and the embeddings as the plugin's default stores them: "auto", int8 tables with the two-row token-type table
    # kept wide, too small to gain, since session 31; quantize_model's own default keeps every table wide)
    quantize_model(base, "nf4", dtype="float32", keep_modules=["classifier"], quantize_embeddings="auto")
    reloaded = PeftModel.from_pretrained(base, str(adapter)).eval()
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, module(x), rtol=1e-5, atol=1e-5)


def test_an_adapted_but_not_saved_head_is_warned_at_export(tmp_path: Path) -> None:
    """r=2 and modules_to_save=[]: all-linear adapts the random classifier; its base would be another random one."""
    module = _bert_classifier()
    lora = LoRA(r=2, modules_to_save=[])
    with pytest.warns(UserWarning, match=r"leaves the task head\(s\) \['model.classifier'\] .*at most adapted"):
        lora.transform_model(module)
    assert "model.classifier" in lora.adapted_modules
    with pytest.warns(UserWarning, match=r"\['classifier'\] .* not in the adapter \(frozen; only the LoRA update of \['classifier'\] is\)"):
        LoRA.save_adapter(module, tmp_path / "adapter")


class _FastRCNNPredictor(nn.Module):
    """torchvision's ``FastRCNNPredictor`` written out (torchvision is not installed here): two heads on one input."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.cls_score = nn.Linear(in_channels, num_classes)
        self.bbox_pred = nn.Linear(in_channels, num_classes * 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cls_score(x), self.bbox_pred(x)


class _Detector(pl.LightningModule):
    """The shape of torchvision's Faster R-CNN box branch: a backbone of blocks, ``TwoMLPHead`` (fc6, fc7), then the
    predictor; its class scores under cross-entropy, its boxes under a smooth L1 loss."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.backbone = nn.ModuleList(nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU()) for c in (3, 16))
        self.fc6, self.fc7 = nn.Linear(16 * 4 * 4, 1024), nn.Linear(1024, 1024)
        self.box_predictor = _FastRCNNPredictor(1024, num_classes)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, labels, boxes = batch
        for block in self.backbone:
            x = block(x)
        x = F.relu(self.fc7(F.relu(self.fc6(F.adaptive_avg_pool2d(x, 4).flatten(1)))))
        scores, deltas = self.box_predictor(x)
        return F.cross_entropy(scores, labels) + F.smooth_l1_loss(deltas, boxes)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_heads_of_one_predictor_are_trained_together(tmp_path: Path) -> None:
    """Was: bbox_pred (12 outputs) trained in full as the task head, cls_score (3 outputs, narrower than r) left out of
    'all-linear' and frozen at its random init: a detector of new classes could not learn them."""
    torch.manual_seed(0)
    module = _Detector()
    assert task_heads(module) == ["box_predictor.cls_score", "box_predictor.bbox_pred"]
    before = module.box_predictor.cls_score.weight.detach().clone()
    lora = LoRA(r=8)
    batch = (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 1]), torch.randn(4, 12))
    _trainer(tmp_path, 2, lora).fit(module, DataLoader([batch], batch_size=None))
    assert lora.modules_to_save == ["box_predictor.cls_score", "box_predictor.bbox_pred"]
    assert "box_predictor.cls_score" not in lora.narrow_left_out
    assert not torch.equal(module.box_predictor.cls_score.weight, before)  # trained: no longer its random init
    # an MLP head in an nn.Sequential is one head at its end: its hidden layer runs before it, on other features
    mlp_head = nn.Module()
    mlp_head.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    mlp_head.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    assert task_heads(mlp_head) == ["head.2"]
