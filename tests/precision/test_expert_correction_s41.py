"""The calibrated correction on the experts of a mixture of experts (issue 52 item 1, session 41).

Was: the experts' Linears (``LinearExperts``, made after the probe forward) got no statistics, so no correction ("the
probe batch did not reach it", warned): 77 % of a Mixtral's weights kept their plain 4-bit error. Now each expert's
projections are fitted on the inputs of the tokens its router sent it on the probe (recorded by running the model as
built), an expert no probe token reached is named with the count, and the factors are counted, saved and resumed
like a Linear's. Real transformers Qwen3-MoE from a tiny config, real bitsandbytes and peft; nothing mocked.
"""

from __future__ import annotations

import re
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planner"))
from planner_families import HFCausalLM  # noqa: E402

from lightning_hbm import LoRA, QuantizedPrecision  # noqa: E402
from lightning_hbm.layers import coverage  # noqa: E402
from lightning_hbm.layers.correction import correction_of  # noqa: E402
from lightning_hbm.layers.experts import LinearExperts, convertible_experts, expert_names  # noqa: E402
from lightning_hbm.memory import parameter_bytes  # noqa: E402
from lightning_hbm.precision.correction import corrected_layers  # noqa: E402
from lightning_hbm.precision.gptq import input_statistics  # noqa: E402

VOCAB = 256
QWEN3_MOE = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                 moe_intermediate_size=16, head_dim=16)  # fmt: skip
PROBE = torch.randint(1, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
HELD_OUT = torch.randint(1, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))


class MoeLM(HFCausalLM):
    """The tiny Qwen3-MoE with a forward (the probe and the held-out logits call it)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _moe(seed: int = 0, **fields: Any) -> MoeLM:
    torch.manual_seed(seed)
    return MoeLM("Qwen3MoeConfig", **{**QWEN3_MOE, **fields}).eval()


def _expert_linears(model: torch.nn.Module) -> list[str]:
    return [f"{name}.{linear}" for name, sub in model.named_modules() if isinstance(sub, LinearExperts)
            for linear, _ in sub.named_children() if linear != "act_fn" for linear in
            [f"{linear}.{e}" for e in range(sub.num_experts)]]  # fmt: skip


def _quantize(model: torch.nn.Module, **settings: Any) -> tuple[QuantizedPrecision, list[str]]:
    plugin = QuantizedPrecision(**{"mode": "nf4-dq", "dtype": "float32", "probe_batch": PROBE, "quantize_embeddings": False, **settings})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.convert_module(model)
    return plugin, [str(w.message) for w in caught if "correction" in str(w.message)]


def test_each_expert_is_measured_on_the_tokens_routed_to_it() -> None:
    """The statistics recorded on the model as built are those its ``LinearExperts`` Linears see when run."""
    model = _moe()
    experts = convertible_experts(model)
    assert list(experts) == ["model.model.layers.0.mlp.experts"]
    hessians, rows = input_statistics(model, [], PROBE, experts)
    # the same model with its experts converted by hand, each expert Linear hooked as any Linear
    converted = _moe()
    block = converted.model.model.layers[0].mlp
    block.experts = LinearExperts.from_transformers(block.experts)
    names = expert_names("model.model.layers.0.mlp.experts", experts["model.model.layers.0.mlp.experts"])
    want, want_rows = input_statistics(converted, names, PROBE)
    assert sorted(hessians) == sorted(names) and sum(rows[n] for n in names if "gate_up" in n) == 2 * PROBE.numel()  # top-2
    for name in names:
        assert rows[name] == want_rows[name], name
        torch.testing.assert_close(hessians[name], want[name], rtol=1e-5, atol=1e-6)
    # gate_up and down of an expert see other inputs (the layer's hidden states are not what an expert sees)
    assert not torch.equal(hessians[names[0]][:16, :16], hessians[names[4]])


def test_every_expert_gets_its_correction_counted_in_the_bytes_and_the_error_drops() -> None:
    plain, corrected = _moe(), _moe()
    _quantize(plain)
    plugin, said = _quantize(corrected, correction_rank=4)
    experts = _expert_linears(corrected)
    assert len(experts) == 8 and set(experts) <= set(corrected_layers(corrected))  # was: none of them
    assert not said  # nothing left uncorrected: no warning
    factors = 0
    for name in corrected_layers(corrected):
        correction = correction_of(corrected.get_submodule(name))
        assert correction is not None and correction.rank == 4 and not correction.left.requires_grad
        factors += correction.right.numel() * correction.right.element_size() + correction.left.numel() * correction.left.element_size()
    assert parameter_bytes(corrected) - parameter_bytes(plain) == factors == plugin.correction_report.bytes
    # the coverage table counts an expert's factors in the experts' row
    rows = {row.kind: row for row in coverage(corrected, quantizing=True, adapting=False)}
    plain_rows = {row.kind: row for row in coverage(plain, quantizing=True, adapting=False)}
    kind = next(k for k in rows if k.startswith("Experts"))
    expert_factors = sum((c.right.numel() + c.left.numel()) * c.right.element_size() for n in experts if (c := correction_of(corrected.get_submodule(n))) is not None)
    assert rows[kind].bytes - plain_rows[kind].bytes == expert_factors > 0
    # held-out logits with the experts alone quantized: their correction lowers the error on tokens it never saw
    reference = _moe()
    with torch.no_grad():
        want = reference(HELD_OUT)
    errors = []
    for rank in (0, 4):
        model = _moe()
        _quantize(model, correction_rank=rank, ignore_modules=["self_attn"])
        with torch.no_grad():
            errors.append(float((model(HELD_OUT) - want).norm() / want.norm()))
    assert errors[1] < 0.8 * errors[0], errors


def _routed_counts(model: torch.nn.Module, probe: torch.Tensor) -> list[int]:
    """Tokens the router of the one MoE layer sends each expert on ``probe`` (read off the router's output)."""
    chosen: list[torch.Tensor] = []
    router = model.model.model.layers[0].mlp.gate
    handle = router.register_forward_hook(lambda module, args, output: chosen.append(output[2]))
    with torch.no_grad():
        model(probe)
    handle.remove()
    return torch.bincount(chosen[0].flatten(), minlength=router.weight.shape[0]).tolist()


@pytest.mark.parametrize("rank", [1, 2])
def test_an_expert_the_probe_reaches_with_too_few_tokens_is_named_with_the_count(rank: int) -> None:
    """Eight experts, top-1, a probe of eight tokens: the router leaves some experts without a token, others with one.
    A probe too small for the rank is an error for a layer every token reaches; an expert's tokens are the router's
    choice: it gets no correction, said with the count, and the surgery goes on."""
    probe = PROBE[:1, :8]
    model = _moe(num_experts=8, num_experts_per_tok=1)
    counts = _routed_counts(model, probe)
    assert 0 in counts and 1 in counts  # with this seed
    _, said = _quantize(model, probe_batch=probe, correction_rank=rank)
    few = {e for e, n in enumerate(counts) if n < rank}
    without = {f"model.model.layers.0.mlp.experts.{p}.{e}" for p in ("gate_up_proj", "down_proj") for e in few}
    assert set(_expert_linears(model)) - set(corrected_layers(model)) == without
    assert "model.model.layers.0.self_attn.q_proj" in corrected_layers(model)
    assert len(said) == 1
    unreached = 2 * counts.count(0)
    assert re.search(rf"{len(without)} quantized layer\(s\) get no calibrated correction .*\({unreached} in all, e\.g\. .*\): "
                     r"an expert the probe batch routed no token to: a larger probe_batch reaches it", said[0]), said
    assert (rank == 2) == (f"an expert the probe batch routed fewer tokens to than the rank ({rank})" in said[0])


def _fit(root: Path, max_steps: int, probe: torch.Tensor, ckpt_path: Any = None) -> tuple[Any, QuantizedPrecision, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hbm.data import ByteTextDataModule

    model = _moe().train()
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, correction_rank=4, quantize_embeddings=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root, plugins=[plugin],
        callbacks=[LoRA(r=2), ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = ByteTextDataModule(seq_len=16, batch_size=2, train_samples=16, val_samples=4, max_bytes=100_000)
        trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, plugin, trainer


def test_the_experts_factors_resume_bit_for_bit_and_a_flipped_bit_is_refused(tmp_path: Path) -> None:
    straight, _, _ = _fit(tmp_path / "straight", 4, PROBE)
    checkpoint = torch.load(tmp_path / "straight" / "step=2.ckpt", weights_only=False)
    saved = [k for k in checkpoint["lightning_hbm"]["state_dict"] if ".lowrank_correction." in k]
    assert any(".experts.gate_up_proj.3." in k for k in saved) and len(saved) == 2 * len(corrected_layers(straight))
    # another probe would fit other factors: the resume takes the file's
    resumed, plugin, _ = _fit(tmp_path / "resumed", 4, HELD_OUT, ckpt_path=tmp_path / "straight" / "step=2.ckpt")
    assert plugin.correction_report is not None and plugin.correction_report.resumed
    want, got = straight.state_dict(), resumed.state_dict()
    keys = [k for k in want if ".lora_" in k or ".lowrank_correction." in k]
    assert any(".experts." in k and ".lowrank_correction." in k for k in keys)
    for key in keys:
        assert torch.equal(want[key], got[key]), key
    key = next(k for k in saved if ".experts.down_proj." in k and k.endswith(".left"))
    checkpoint["lightning_hbm"]["state_dict"][key].reshape(-1)[:1].view(torch.uint8)[0] ^= 0x40  # one bit
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=rf"bad.ckpt is damaged: tensor '.*{re.escape(key)}' does not match the checksum"):
        _fit(tmp_path / "bad", 4, PROBE, ckpt_path=tmp_path / "bad.ckpt")


def test_the_planner_plans_the_experts_factors_the_run_stores() -> None:
    """On fake tensors every expert gets zero factors of its shapes: the bytes the run stores where the probe reaches
    every expert (was: left out of both)."""
    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.planner import plan

    batch = tuple(t.contiguous() for t in synthetic_batch(2, 32, vocab_size=VOCAB))
    planned = {rank: plan(partial(_moe, 0), batch, plugin=QuantizedPrecision("nf4-dq", dtype="float32", correction_rank=rank,
                                                                             probe_batch=batch[0], quantize_embeddings=False),
                          callbacks=[LoRA(r=2)]).chosen.categories["parameters"] for rank in (0, 4)}  # fmt: skip
    plugin, said = _quantize(_moe(), probe_batch=batch[0], correction_rank=4)
    report = plugin.correction_report
    assert report is not None and len(report.corrected) == 8 + 4 and not said  # the experts and the attention
    assert planned[4] - planned[0] == report.bytes


def test_both_exports_treat_the_experts_factors_as_a_linears(tmp_path: Path) -> None:
    """``save_adapter(with_correction=True)`` folds each expert's factors into its adapter (the quantized base's);
    without it they are left out (the full-precision base's), as a Linear's."""
    from safetensors.torch import load_file

    from lightning_hbm.surgery import run_surgery

    model = _moe()
    run_surgery(model, QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=PROBE, correction_rank=4, quantize_embeddings=False),
                [LoRA(r=2, target_modules=["q_proj", "v_proj"])])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = load_file(LoRA.save_adapter(model, tmp_path / "full") / "adapter_model.safetensors")
        folded = load_file(LoRA.save_adapter(model, tmp_path / "quantized", with_correction=True) / "adapter_model.safetensors")
    assert not any(".experts." in k for k in plain)
    expert = "model.layers.0.mlp.experts.down_proj.1"
    correction = correction_of(model.get_submodule(f"model.{expert}"))
    assert correction is not None
    a = next(v for k, v in folded.items() if k.endswith(f"{expert}.lora_A.weight"))
    b = next(v for k, v in folded.items() if k.endswith(f"{expert}.lora_B.weight"))
    torch.testing.assert_close(b @ a, correction.weight())
