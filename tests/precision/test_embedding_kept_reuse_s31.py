"""A ``QuantizedPrecision`` reused by a second Trainer compares its embeddings' setting as THIS run keeps them.

Was (session 30): whether the default's int8 embeddings were kept wide (under FSDP, or resuming a checkpoint saved
with them wide) was remembered from the last surgery and read by the next run's resume check, which runs before that
run's surgery: a plugin that had resumed a wide checkpoint then refused to resume its own int8 checkpoint
("quantize_embeddings" differs), though both runs had the same settings.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers.embedding import QuantizedEmbedding


@pytest.mark.slow  # four 1-step fits of a one-layer Llama
def test_a_plugin_that_resumed_a_wide_checkpoint_resumes_an_int8_one_after(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    def run(plugin: QuantizedPrecision, steps: int, ckpt: Any = None) -> tuple[Any, Any]:
        model = llama_factory(vocab_size=1000, num_hidden_layers=1)
        trainer = trainer_factory(max_steps=steps, plugins=[plugin], callbacks=[LoRA(r=4)])
        trainer.fit(model, datamodule_factory(train_samples=16), ckpt_path=ckpt)
        return model, trainer

    _, wide = run(QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=False), 1)
    wide.save_checkpoint(tmp_path / "wide.ckpt")
    _, narrow = run(QuantizedPrecision("nf4-dq", dtype="float32"), 1)
    narrow.save_checkpoint(tmp_path / "int8.ckpt")
    plugin = QuantizedPrecision("nf4-dq", dtype="float32")  # the default, reused by the two resumes below
    with pytest.warns(UserWarning, match="the checkpoint being resumed was saved with them so"):
        model, _ = run(plugin, 1, tmp_path / "wide.ckpt")
    assert type(model.model.get_input_embeddings()) is nn.Embedding
    model, trainer = run(plugin, 1, tmp_path / "int8.ckpt")  # was: ValueError naming quantize_embeddings
    assert trainer.global_step == 1 and isinstance(model.model.get_input_embeddings(), QuantizedEmbedding)
