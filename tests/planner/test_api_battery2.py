"""The planner attacked from outside (session 26): an example batch in transformers' ``BatchEncoding`` (what a tokenizer
and ``DataCollatorWithPadding`` give) was refused with "The example batch holds no tensor (got BatchEncoding)": torch's
pytree takes the mapping as one leaf, so its tensors were neither seen, faked, nor counted."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import LoRA
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.checkpointing import ActivationCheckpointing
from lightning_hbm.planner import Candidate, predict


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=2, num_key_value_heads=2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch, labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters())


def test_a_batch_encoding_is_planned_as_the_dict_it_holds() -> None:
    from transformers import BatchEncoding

    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    plain = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    candidate = Candidate.from_trainer(None, [LoRA(r=4), ActivationCheckpointing()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = predict(_Tiny, plain, candidate, device="cuda")
        got = predict(_Tiny, BatchEncoding(plain), candidate, device="cuda")
    assert (got.categories, got.side) == (want.categories, want.side)


def test_map_tensors_opens_the_mappings_pytree_takes_as_leaves() -> None:
    from collections import UserDict

    from transformers import BatchEncoding, BatchFeature

    x = torch.ones(2)
    for kind in (BatchEncoding, BatchFeature, UserDict):
        tree = ({"a": kind({"x": x, "n": 3})}, [kind({"y": x})])
        mapped = torch_compat.map_tensors(lambda t: t * 2, tree)
        assert type(mapped[0]["a"]) is kind and mapped[0]["a"]["n"] == 3 and torch.equal(mapped[1][0]["y"], x * 2)
        assert torch.equal(x, torch.ones(2))  # the input is left as it was
        assert len(torch_compat.tensor_leaves(tree)) == 2
