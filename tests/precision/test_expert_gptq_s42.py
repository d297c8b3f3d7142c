"""GPTQ rounding of each MoE expert on the tokens its router sent it (issue 52, session 42).

Was: ``rounding="gptq"`` rounded the experts' Linears (``LinearExperts``, made after the probe forward) to nearest,
and, without ``correction_rank``, named every one of them "the probe forward never ran it". Now each expert is
rounded by GPTQ on the Hessian of its routed probe tokens (the statistics the correction fits on), and an expert
routed fewer than ``EXPERT_MIN_TOKENS`` keeps nearest rounding, named with why. Real transformers Qwen3-MoE from a
tiny config (the session-41 test's), real bitsandbytes; nothing mocked.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_expert_correction_s41 import HELD_OUT, PROBE, _expert_linears, _moe, _routed_counts  # noqa: E402

from lightning_hbm import QuantizedPrecision, record  # noqa: E402
from lightning_hbm.layers.experts import LinearExperts, expert_names  # noqa: E402
from lightning_hbm.precision.gptq import EXPERT_MIN_TOKENS, gptq_round_, grid_of, input_statistics  # noqa: E402
from lightning_hbm.precision.registry import RoundingGrid, get_format  # noqa: E402

EXPERTS = "model.model.layers.0.mlp.experts"


def _quantize(model: torch.nn.Module, **settings: Any) -> list[str]:
    plugin = QuantizedPrecision(**{"mode": "nf4-dq", "dtype": "float32", "probe_batch": PROBE, "quantize_embeddings": False, **settings})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.convert_module(model)
    return [str(w.message) for w in caught if "nearest rounding" in str(w.message)]


def _trained(steps: int = 20, seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen3-MoE 64 wide (experts too), trained ``steps`` AdamW steps on byte text: data-like statistics (an
    untrained one's inputs are isotropic noise, on which GPTQ has nothing to gain, on any layer)."""
    from lightning_hbm.data import ByteTextDataModule

    model = _moe(seed, hidden_size=64, moe_intermediate_size=64, head_dim=32).train()
    data = ByteTextDataModule(seq_len=32, batch_size=8, train_samples=8 * steps + 16, val_samples=2, max_bytes=200_000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [x for x, _ in data.train_dataloader()]
    for x in batches[2 : 2 + steps]:  # the first two are the probe
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.probe = torch.cat(batches[:2])  # type: ignore[assignment]
    return model.eval()


def _block_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The MoE block's relative output error on the held-out tokens' block inputs (the reference model's): the same
    routing, the experts' weights alone differ."""
    inputs: list[tuple] = []
    block = reference.model.model.layers[0].mlp
    handle = block.register_forward_hook(lambda module, args, output: inputs.append(args))
    with torch.no_grad():
        reference(HELD_OUT)
        handle.remove()
        want, got = block(*inputs[0]), model.model.model.layers[0].mlp(*inputs[0])
    return float((got - want).norm() / want.norm())


def test_each_expert_is_gptq_rounded_on_the_hessian_of_its_routed_tokens() -> None:
    model = _moe()
    said = _quantize(model, rounding="gptq")
    experts = _expert_linears(model)
    assert len(experts) == 8
    for name in experts:  # was: ("nf4-dq", "nearest"), and named in the warning
        assert record.quantized_as(model.get_submodule(name)) == ("nf4-dq", "gptq"), name
    assert not said, said
    # the bytes are GPTQ's on the expert's own Hessian, measured independently: the experts converted by hand, each
    # expert Linear hooked as any Linear on the probe, one quantized and rounded with its matrix
    converted = _moe()
    mlp = converted.model.model.layers[0].mlp
    mlp.experts = LinearExperts.from_transformers(mlp.experts)
    names = expert_names(EXPERTS, _moe().get_submodule(EXPERTS))
    hessians, rows = input_statistics(converted, names, PROBE)
    assert all(rows[name] >= EXPERT_MIN_TOKENS for name in names)
    fmt = get_format("nf4-dq")
    for name in (f"{EXPERTS}.gate_up_proj.1", f"{EXPERTS}.down_proj.3"):
        linear = converted.get_submodule(name)
        want = fmt.replace(linear, torch.float32, None)
        gptq_round_(want, linear.weight, hessians[name])
        got = grid_of(model.get_submodule(name))
        assert got is not None and torch.equal(got.packed, cast(RoundingGrid, grid_of(want)).packed), name


def test_gptq_lowers_the_experts_held_out_error_below_nearest_and_with_the_correction() -> None:
    """The experts alone quantized (attention kept): the MoE block's output error on tokens the probe never saw
    (measured 0.056 nearest, 0.005 GPTQ)."""
    reference = _trained()
    errors = {}
    for arm, settings in {"nearest": {}, "gptq": dict(rounding="gptq"), "gptq+c4": dict(rounding="gptq", correction_rank=4)}.items():
        model = copy.deepcopy(reference)
        _quantize(model, ignore_modules=["self_attn"], probe_batch=reference.probe, **settings)
        errors[arm] = _block_error(model, reference)
    assert errors["gptq"] < 0.5 * errors["nearest"], errors  # was: equal (the experts rounded to nearest)
    assert errors["gptq+c4"] < errors["gptq"], errors  # the correction is fitted to the GPTQ-rounded expert


def test_an_expert_routed_too_few_tokens_keeps_nearest_rounding_and_is_named() -> None:
    """Eight experts, top-1, a probe of 16 tokens: some experts get no token, some fewer than ``EXPERT_MIN_TOKENS``,
    some more. Those under it keep nearest rounding, each named with why (never an error); the rest are rounded."""
    probe = PROBE[:1, :16]
    model = _moe(num_experts=8, num_experts_per_tok=1)
    counts = _routed_counts(model, probe)
    few = {e for e, n in enumerate(counts) if n < EXPERT_MIN_TOKENS}
    assert 0 in counts and any(0 < n < EXPERT_MIN_TOKENS for n in counts) and len(few) < 8  # with this seed
    said = _quantize(model, probe_batch=probe, rounding="gptq")
    nearest = {f"{EXPERTS}.{p}.{e}" for p in ("gate_up_proj", "down_proj") for e in few}
    for name in _expert_linears(model):
        assert record.quantized_as(model.get_submodule(name)) == ("nf4-dq", "nearest" if name in nearest else "gptq"), name
    assert len(said) == 1
    unreached = 2 * counts.count(0)
    assert re.search(rf"{len(nearest)} quantized layer\(s\) keep nearest rounding .*\({unreached} in all, e\.g\. .*\): "
                     r"an expert the probe batch routed no token to \(fix: a larger probe_batch reaches it\)", said[0]), said
    assert f"an expert the probe batch routed fewer than {EXPERT_MIN_TOKENS} tokens to (too few to round against)" in said[0]
    assert "the probe forward never ran it" not in said[0]  # was: every expert, the probe "never ran" them


def _fit(root: Path, probe: torch.Tensor, ckpt_path: Any = None) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hbm import LoRA
    from lightning_hbm.data import ByteTextDataModule

    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, rounding="gptq", quantize_embeddings=False, ignore_modules=["self_attn"])
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root, plugins=[plugin],
        callbacks=[LoRA(r=2), ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = ByteTextDataModule(seq_len=16, batch_size=2, train_samples=8, val_samples=4, max_bytes=100_000)
        trainer.fit(_moe().train(), data, ckpt_path=ckpt_path)


def test_a_resume_rebuilds_the_experts_gptq_rounding_and_refuses_another_probe(tmp_path: Path) -> None:
    """The experts alone quantized: the checkpoint's GPTQ CRC covers their rounding (was: no layer rounded, so any
    probe passed), a resume with the same probe rebuilds it, one with another probe is refused before training."""
    _fit(tmp_path / "run", PROBE)
    _fit(tmp_path / "same", PROBE, ckpt_path=tmp_path / "run" / "step=1.ckpt")
    with pytest.raises(ValueError, match=r"The GPTQ rounding rebuilt for this resume \(CRC \w+\) differs from the one the checkpoint was trained with"):
        _fit(tmp_path / "other", HELD_OUT, ckpt_path=tmp_path / "run" / "step=1.ckpt")
