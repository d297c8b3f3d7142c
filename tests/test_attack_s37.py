"""Session 37, h5: session 36's code attacked by running (the RNGs of its own a loader holds, put back after the
probe draw; ...); each test here failed on main before its fix."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import transformers as tf
from torch.utils.data import ConcatDataset, DataLoader, RandomSampler, Sampler, Subset

from lightning_hbm import QuantizedPrecision
from lightning_hbm.adapters.lora import LoRA
from tests.test_attack_s36 import _Bucketing, _Numbered, _trained, conv_check_of_one_step


class _Augment:
    """A transform object drawing from a NumPy ``RandomState`` of its own."""

    def __init__(self) -> None:
        self.rng = np.random.RandomState(7)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        image[1] += float(self.rng.rand())
        return image


class _Held(_Numbered):
    """Its augmentations drawn from generators held one level down: in a dict, in a list, in a transform."""

    def __init__(self) -> None:
        super().__init__(rng=False)
        self.rngs = {"noise": np.random.default_rng(5)}
        self.generators = [torch.Generator().manual_seed(2)]
        self.transform = _Augment()

    def __getitem__(self, i: int) -> torch.Tensor:
        image = self.transform(super().__getitem__(i))
        image[1] += float(self.rngs["noise"].random()) + float(torch.rand(1, generator=self.generators[0]))
        return image


class _Wrapping(Sampler[Any]):
    """A sampler around another (as Lightning's ``DistributedSamplerWrapper`` holds the user's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Any:
        return iter(self.inner)


_LOADERS = {
    "a Subset of a dataset with its own generator": lambda: DataLoader(Subset(_Numbered(rng=True), list(range(40))), batch_size=4),
    "a ConcatDataset of such": lambda: DataLoader(ConcatDataset([_Numbered(rng=True), _Numbered(rng=True)]), batch_size=4),
    "generators in a dict, a list and a transform": lambda: DataLoader(_Held(), batch_size=4),
    "a sampler wrapping a RandomSampler": lambda: DataLoader(
        _Numbered(), batch_size=4, sampler=_Wrapping(RandomSampler(range(40), generator=torch.Generator().manual_seed(3)))
    ),
    "a batch sampler wrapping a bucketing one": lambda: DataLoader(_Numbered(), batch_sampler=_Wrapping(_Bucketing(torch.Generator().manual_seed(3)))),
}


@pytest.mark.parametrize("case", list(_LOADERS))
def test_rngs_held_one_level_deeper_are_put_back_after_the_probe_draw(case: str, tmp_path: Any) -> None:
    """Session 36 put back the generators held as attributes of the loader, its samplers and its dataset only: one
    level deeper (a Subset's dataset, a dict of generators, a transform's, a sampler inside a wrapper) the conv check's
    32 samples consumed them, and epoch 0 trained other draws or another order than the same seed without us."""
    plain, ours = _trained(_LOADERS[case], None, tmp_path), _trained(_LOADERS[case], [QuantizedPrecision("int8")], tmp_path)
    assert [order for order, _ in ours] == [order for order, _ in plain]
    for (_, got), (_, want) in zip(ours, plain):  # the plugin hands the batch on in bfloat16
        assert got == pytest.approx(want, abs=0.02)


def test_the_rng_walk_stays_small_on_a_large_dataset() -> None:
    """A dataset holding a million items is not walked item by item; a generator nested in dicts and lists is found."""
    import time

    from lightning_hbm._compat.torch import _reachable_rngs

    class Big(_Numbered):
        def __init__(self) -> None:
            super().__init__()
            self.items, self.names = list(range(10**6)), {i: str(i) for i in range(10**6)}
            self.nested = {"a": [{"b": np.random.default_rng(1)}]}

    dataset = Big()
    started = time.perf_counter()
    found = _reachable_rngs(DataLoader(dataset, batch_size=4))
    assert time.perf_counter() - started < 0.5
    assert found == [dataset.nested["a"][0]["b"]]


class _TiedLlama(pl.LightningModule):
    """A small transformers Llama whose head is tied to its embedding (``tie_word_embeddings=True``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tf.LlamaForCausalLM(_tied_config())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _tied_config() -> Any:
    return tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip


_TOKENS = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))


def _lora_fitted(tmp_path: Any, **settings: Any) -> _TiedLlama:
    model = _TiedLlama()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LoRA(r=4, **settings)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(_TOKENS, batch_size=4))
    return model.eval()


def test_save_adapter_of_a_tied_head_trained_in_full(tmp_path: Any) -> None:
    """``modules_to_save=["lm_head"]`` of a tied model trains the embedding too: both names hold one tensor, and
    safetensors refused to save it ("Some tensors share memory") after the fit. Each is written; peft loads both and
    computes the trained model."""
    import peft

    model = _lora_fitted(tmp_path, target_modules=["q_proj"], modules_to_save=["lm_head"])
    LoRA.save_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(_TiedLlama().model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_TOKENS[:2]).logits, model.model(input_ids=_TOKENS[:2]).logits)


def test_merge_warns_where_an_adapter_unties_a_tied_weight(tmp_path: Any) -> None:
    """An adapter on a tied head (named as a target) trains the head, not the embedding: the merged state_dict holds
    two values for one tied tensor, and a tied model loading it computed logits off by 0.64, without a word."""
    model = _lora_fitted(tmp_path, target_modules=["q_proj", "lm_head"])
    with pytest.warns(UserWarning, match=r"model\.lm_head\.weight and model\.model\.embed_tokens\.weight share one tied weight.*tie_word_embeddings=False"):
        merged = LoRA.merge(model, dtype="float32")
    untied = tf.LlamaForCausalLM(tf.LlamaConfig(**{**_tied_config().to_dict(), "tie_word_embeddings": False}))
    untied.load_state_dict({k.removeprefix("model."): v for k, v in merged.items()})
    with torch.no_grad():  # the fix the warning names computes the adapted model
        want = model.model(input_ids=_TOKENS[:2]).logits
        assert torch.allclose(untied.eval()(input_ids=_TOKENS[:2]).logits, want, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoRA.merge(_lora_fitted(tmp_path, target_modules=["q_proj"]))  # nothing tied apart: no warning


class _ResNet(pl.LightningModule):
    """A small transformers ResNet (BatchNorm after each convolution), its convolutions adapted."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tf.ResNetForImageClassification(_resnet_config())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(pixel_values=batch[0]).logits, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _resnet_config() -> Any:
    return tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)


def test_save_adapter_keeps_the_running_statistics_training_updated(tmp_path: Any) -> None:
    """The BatchNorm layers of a LoRA-trained conv net update their running statistics in training; the adapter folder
    held none, and peft loading it onto the base normalised with the base's: logits off by 2.5 on a scale of 1.5,
    without a word. They travel as modules_to_save now (as peft's own file holds a saved module's buffers)."""
    import json

    import peft

    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    model = _ResNet()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LoRA(r=4, target_modules=["convolution"])],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(list(zip(images, labels)), batch_size=4))
    LoRA.save_adapter(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"]
    assert "resnet.embedder.embedder.normalization" in saved and "classifier.1" in saved
    loaded = peft.PeftModel.from_pretrained(_ResNet().model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=images[:4]).logits, model.eval().model(pixel_values=images[:4]).logits)


def test_a_frozen_config_with_patterns_is_hashable() -> None:
    """A frozen dataclass is hashable; with a ``rank_pattern`` (kept as a FrozenDict) it raised TypeError: a sweep's
    configs in a set, or one as a cache key, failed."""
    from lightning_hbm.adapters.lora import LoRAConfig

    config = LoRAConfig(r=4, rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 3.0})
    same = LoRAConfig(r=4, rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 3.0})
    assert hash(config) == hash(same) and len({config, same, LoRAConfig(r=4)}) == 2


def test_save_adapter_of_a_student_beside_a_frozen_teacher(tmp_path: Any) -> None:
    """Distillation: a LightningModule holding an adapted student and a frozen teacher (two Hugging Face models).
    save_adapter refused ("holds several Hugging Face models: pass submodule=NAME") where only one holds adapters;
    it saves the student's, which peft loads onto the student's base."""
    import peft

    class Distilled(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.student, self.teacher = tf.LlamaForCausalLM(_tied_config()), tf.LlamaForCausalLM(_tied_config())

    model = Distilled()
    LoRA(r=2, target_modules=["q_proj"], exclude_modules=r"teacher\..*").transform_model(model)
    with torch.no_grad():  # a trained adapter (B = 0 as built)
        for param in model.student.parameters():
            if param.requires_grad:
                param.normal_(generator=torch.Generator().manual_seed(3))
    LoRA.save_adapter(model, tmp_path / "adapter")
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(tf.LlamaForCausalLM(_tied_config()), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_TOKENS[:2]).logits, model.student.eval()(input_ids=_TOKENS[:2]).logits)


class _Captioned(torch.utils.data.Dataset):
    """Images with an optional caption (None for some) and their tags, as a custom collate hands them on."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any, list[str]]:
        return torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i)), None if i % 3 else f"image {i}", ["tag"] * (i % 2)


def _captions(items: list[Any]) -> tuple[torch.Tensor, list[Any], list[Any]]:
    return torch.stack([image for image, _, _ in items]), [c for _, c, _ in items], [t for _, _, t in items]


class _Tagged(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))

    def forward(self, batch: tuple[torch.Tensor, list[Any], list[Any]]) -> torch.Tensor:
        return self.net(batch[0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_the_conv_check_joins_batches_with_optional_captions_and_tag_lists(tmp_path: Any) -> None:
    """A per-sample list holding None (an optional caption) or lists (a sample's tags) stopped the join at the first
    batch: the fit-start conv check measured 4 images, not 32 (session 36 joined lists of strings only)."""
    measured, _ = conv_check_of_one_step(tmp_path, _Tagged, DataLoader(_Captioned(), batch_size=4, collate_fn=_captions))
    assert measured is not None and measured.samples == 32


def test_pissa_on_a_layer_pinned_unquantized(tmp_path: Any) -> None:
    """``layer_modes={name: "none"}`` keeps a layer as built; LoRA refused ``init_lora_weights="pissa"`` on it, "this
    layer is quantized (none)". It is adapted on its full-precision weight; the layers quantized are still refused."""

    class Llama(_TiedLlama):
        def __init__(self) -> None:
            super().__init__()
            self.model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**_tied_config().to_dict(), "tie_word_embeddings": False, "num_hidden_layers": 2}))

    def fit(layer_modes: dict[str, str]) -> Llama:
        model = Llama()
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4", layer_modes=layer_modes)],
            callbacks=[LoRA(r=2, target_modules=r"model\.model\.layers\.0\.self_attn\.q_proj", init_lora_weights="pissa")],
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, DataLoader(_TOKENS, batch_size=4))
        return model

    pinned = fit({"model.model.layers.0.self_attn.q_proj": "none"})
    assert type(pinned.model.model.layers[0].self_attn.q_proj.base_layer) is torch.nn.Linear
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa' rewrites the base weight.*quantized \(nf4\)"):
        fit({"model.model.layers.1.self_attn.q_proj": "none"})


class _SystemDrawn(_Numbered):
    """Augmented from the OS's entropy (``random.SystemRandom``: no state), held in a transform."""

    def __init__(self) -> None:
        import random

        super().__init__()
        self.transform = {"noise": random.SystemRandom()}


def test_a_dataset_holding_a_system_random_trains() -> None:
    """``random.SystemRandom`` has no state to put back (``getstate`` raises NotImplementedError): found by the walk
    over the loader's objects, it must be passed over, not stop the fit."""
    from lightning_hbm._compat.torch import _own_rngs_restored

    loader = DataLoader(_SystemDrawn(), batch_size=4)
    restores = _own_rngs_restored(loader)
    assert restores == [] and next(iter(loader)).shape == (4, 3, 8, 8)


def test_a_widened_plan_checked_on_the_32_images_it_was_chosen_on_is_still_cautioned(tmp_path: Any) -> None:
    """``quiet_on_enough`` (session 36) drops the widened-conv caution where the check measured 32 samples quiet, on the
    evidence of 4 chosen, 32 checked. With a ``probe_batch`` of 32 images (or a first batch of 32) the modes are chosen
    on the very samples the check measures: quiet by construction (0.9854 here), and the caution was dropped."""
    import copy

    from tests.test_widened_convs_s36 import CAUTION, _batches, _fit, resnet

    with pytest.warns(UserWarning, match=CAUTION):
        plugin = _fit(copy.deepcopy(resnet.__wrapped__()), QuantizedPrecision(probe_batch=torch.cat(_batches())), tmp_path)  # type: ignore[attr-defined]
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.samples == 32 and not measured.warned
