"""``plan()`` on three more transformers families, as a user configures them, against torch's MemTracker (session 35).

Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``), Falcon (new decoder architecture: parallel attention and MLP, grouped
KV heads) and T5 (encoder-decoder, relative position bias, gated-GELU, a loss on ``labels.view(-1)``), each from its
config, under the library's default recipe: ``QuantizedPrecision("nf4-dq")`` (fp32 compute on this CPU), ``LoRA(r=8)``,
``ActivationCheckpointing()``, ``FusedLoss()``. The batch is ``synthetic_batch``'s views of one tensor: the planner lays
it out as the step holds it (tests/planner/test_batch_layout_s35.py). Before, the plan read 16 B over on Phi-3 and
Falcon (the views' larger storages) and refused T5: "Cannot view a tensor with shape torch.Size([2, 64]) and strides
(65, 1) as a tensor with shape (128,)", a view the step on the moved batch makes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from planner_families import HFCausalLM

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner import plan
from lightning_hbm.planner.reference import memtracker_peak

VOCAB = 512
BATCH = synthetic_batch(2, 32, vocab_size=VOCAB)


class HFSeq2SeqLM(pl.LightningModule):
    """A transformers encoder-decoder LM from its config class, loss from ``labels=`` (the decoder's inputs shifted
    from them by the model)."""

    def __init__(self, config: str, **fields: Any) -> None:
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForSeq2SeqLM.from_config(getattr(transformers, config)(**fields))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        return self.model(input_ids=input_ids, labels=targets, use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


TOKENS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
FAMILIES = {
    "phi3": partial(HFCausalLM, "Phi3Config", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    **TOKENS),
    "falcon": partial(HFCausalLM, "FalconConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2, **TOKENS),
    "t5": partial(HFSeq2SeqLM, "T5Config", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                  num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                  pad_token_id=0, eos_token_id=1),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_default_recipe_plans_to_the_byte(name: str) -> None:
    pytest.importorskip("transformers")
    factory = FAMILIES[name]
    planned = plan(factory, BATCH, plugin=QuantizedPrecision("nf4-dq", dtype="float32"),
                   callbacks=[LoRA(r=8), ActivationCheckpointing(), FusedLoss()])
    assert len(planned.predictions) == 1 and not planned.failures
    predicted = planned.chosen
    assert predicted.fallbacks == () and predicted.uncut == ""
    measured = memtracker_peak(factory, BATCH, predicted.candidate)
    print(f"{name}: predicted {predicted.peak:,} B, MemTracker {measured:,} B")
    assert predicted.peak == pytest.approx(measured, rel=0.03)
    assert abs(predicted.peak - measured) <= 8, (predicted.peak, measured)
