"""lightning_hbm._compat.transformers against the installed transformers: each test fails when it changes the internal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from lightning_hbm._compat import transformers as compat

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=64)


def test_from_config_builds_with_from_pretrained_options() -> None:
    model = compat.from_config(LlamaForCausalLM, LlamaConfig(**TINY), dtype=torch.bfloat16)
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.bfloat16


def test_replaced_from_pretrained_reaches_auto_and_model_classes(tmp_path: Path) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)  # a config, no weights
    calls: list[tuple[type, Any]] = []

    def replacement(cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((cls, path))
        return compat.from_config(cls, transformers.AutoConfig.from_pretrained(path))

    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    with compat.replaced_from_pretrained(transformers, replacement):
        auto = AutoModelForCausalLM.from_pretrained(tmp_path)
        direct = LlamaForCausalLM.from_pretrained(tmp_path)
    assert isinstance(auto, LlamaForCausalLM) and isinstance(direct, LlamaForCausalLM)
    assert [c for c, _ in calls] == [LlamaForCausalLM, LlamaForCausalLM]
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
    with pytest.raises(OSError):  # the real one again: it wants weights
        LlamaForCausalLM.from_pretrained(tmp_path)


def test_default_gate_is_what_mixtral_experts_route_with() -> None:
    assert compat._default_gate() is not None
    model = MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=2, num_experts_per_tok=1))
    experts = model.model.layers[0].mlp.experts
    assert compat.uses_default_gate(experts)
    assert not compat.uses_default_gate(torch.nn.Linear(2, 2))
