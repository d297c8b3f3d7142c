"""The targets of a ``Quantization`` listed in one pass over the model's embeddings (issue 54, session 32).

Under FSDP the default asks of each input embedding whether a head tied to it sits in another top-level submodule
(another FSDP unit). That question was a scan of its own (``_tied_apart``: every embedding's tied heads read, then read
again by the listing); the listing now keeps each embedding's tied heads (``Listing.tied``) and the check reads them
there: the model's embeddings are scanned once, and what is listed, kept and said is as before. Tiny plain models,
each test well under a second.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision import quantization as quantization_module
from lightning_hbm.precision import targets as targets_module
from lightning_hbm.strategies import QuantizedFSDPStrategy


class Tied(nn.Module):
    """A token model whose head is tied to its embedding, the two in different top-level submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight


def _fsdp() -> Any:
    return SimpleNamespace(strategy=QuantizedFSDPStrategy(), callbacks=[])  # what the listing reads of a Trainer


@pytest.mark.parametrize("one_unit", [True, False], ids=["one-unit", "apart"])
def test_under_fsdp_each_embeddings_tied_heads_are_read_once(one_unit: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: twice per embedding under FSDP (the units check, then the listing)."""
    read: list[nn.Module] = []
    real = targets_module.tied_heads

    def counted(module: nn.Module, embedding: nn.Module) -> Any:
        read.append(embedding)
        return real(module, embedding)

    monkeypatch.setattr(targets_module, "tied_heads", counted)
    monkeypatch.setattr(quantization_module, "tied_heads", counted, raising=False)  # where the units check read them
    model = nn.Sequential(Tied()) if one_unit else Tied()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the apart case is said (tests/precision/test_embedding_default_s30.py)
        QuantizedPrecision("nf4-dq", dtype="float32").quantization._listed(model, _fsdp())
    assert len(read) == 1


def test_the_listing_keeps_each_embeddings_tied_heads_and_the_apart_case_lists_as_without_embeddings() -> None:
    model, plugin = Tied(), QuantizedPrecision("nf4-dq", dtype="float32")
    asked = plugin.quantization._listed(model, None)[1]  # no FSDP: the table and its tied head stored int8
    assert dict(asked.tied) == {"emb": ["head"]} and "emb" in dict(asked.targets)
    with pytest.warns(UserWarning, match=r"\['emb'\] are tied to the head\(s\) \['head'\] in another top-level submodule"):
        rule, listing = plugin.quantization._listed(model, _fsdp())
    assert rule.quantize_embeddings is False  # the default keeps them wide there, and saves them so
    plain = dataclasses.replace(rule, quantize_embeddings=False).listing(model)
    assert [n for n, _ in listing.targets] == [n for n, _ in plain.targets] == ["mid"]
    assert listing.skipped == plain.skipped and listing.embeddings == plain.embeddings == ([], {}) and listing.tied == plain.tied
    assert (listing.fp32, listing.ignored, listing.kept, listing.unmatched) == (plain.fp32, plain.ignored, plain.kept, plain.unmatched)
    assert "quantize_embeddings" not in plugin.quantization.settings()


def test_a_listing_under_fsdp_is_not_reused_by_a_call_without_it() -> None:
    """The listing is kept per (settings, strategy, resume): the same plugin and model listed without FSDP store the
    table int8 again, and under FSDP again keep it wide, said once per listing."""
    model, plugin = Tied(), QuantizedPrecision("nf4-dq", dtype="float32")
    with pytest.warns(UserWarning, match="another top-level submodule"):
        assert "emb" not in dict(plugin.quantization._listed(model, _fsdp())[1].targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "emb" not in dict(plugin.quantization._listed(model, _fsdp())[1].targets)  # the same listing: said once
        assert "emb" in dict(plugin.quantization._listed(model, None)[1].targets)
        assert plugin.quantization.settings()["quantize_embeddings"] == "int8"
