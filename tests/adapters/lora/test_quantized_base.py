"""The export for the quantized base (issue 52): the base it fits recorded in the folder, and checked before loading.

Session 38: ``save_adapter(with_correction=True)`` of a GPTQ run reloaded by plain peft onto a GPTQ base rounded from
another probe was off by 0.078 on the logits, onto bitsandbytes' own nearest rounding by 0.091, and only an info line
said the adapter needs the run's own quantized base. ``LoRA.check_quantized_base(base, folder)`` now refuses such a
base by name before anything loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.adapters.lora.folder import MANIFEST
from lightning_hbm.adapters.lora.quantized_base import BASE_RECORD
from lightning_hbm.data import synthetic_batch
from lightning_hbm.surgery import run_surgery

_LAYER = r"model\.layers\.0\.self_attn\.q_proj"  # the first quantized layer of the tiny Llama's record


@pytest.fixture(scope="module")
def probe() -> torch.Tensor:
    return synthetic_batch(4, 64, seed=2)[0]


def _export(llama_factory: Callable, probe: torch.Tensor, folder: Path, device: str = "cpu") -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A GPTQ run with a rank-4 correction, lora_B random as if trained, exported for the quantized base; returns the
    folder, the tokens and the run's logits on them."""
    idx, _ = synthetic_batch(2, 16, seed=1)
    idx, probe, model = idx.to(device), probe.to(device), llama_factory().to(device)
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, rounding="gptq", correction_rank=4)
    run_surgery(model, plugin, [LoRA(r=4, alpha=8, target_modules=["q_proj", "v_proj"])])
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            param.data.normal_(0, 0.05)
    with torch.no_grad():
        want = model.eval()(idx)
    return LoRA.save_adapter(model, folder, with_correction=True), idx, want


def _base(llama_factory: Callable, mode: str = "nf4-dq", device: str = "cpu", **settings: Any) -> torch.nn.Module:
    base = llama_factory().to(device)
    QuantizedPrecision(mode, dtype="float32", **settings).convert_module(base)
    return base.model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_same_quantized_base_passes_and_loads_with_the_runs_outputs(
    llama_factory: Callable, probe: torch.Tensor, tmp_path: Path, device: str
) -> None:
    """The run and the base each quantized on ``device`` (cuda: not yet run on GPU)."""
    from peft import PeftModel

    folder, idx, want = _export(llama_factory, probe, tmp_path / "adapter", device)
    saved = json.loads((folder / BASE_RECORD).read_text())
    assert BASE_RECORD in json.loads((folder / MANIFEST).read_text())["files"]  # the manifest lists it: checked complete
    q_proj = saved["layers"]["model.layers.0.self_attn.q_proj"]
    assert (q_proj["mode"], q_proj["rounding"], q_proj["correction_rank"], saved["correction_rank"]) == ("nf4-dq", "gptq", 4, 4)
    assert len(q_proj["storage"]) == 16 and q_proj["layout"][0] == "uint8[2048, 1]"
    base = _base(llama_factory, device=device, rounding="gptq", probe_batch=probe.to(device))
    assert LoRA.check_quantized_base(base, folder) == folder
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(base, str(folder)).eval()  # plain peft
        got = loaded(input_ids=idx, use_cache=False).logits
    # fp32 rounding only: the reload adds the (fp32) factors inside peft's LoRA term, the run as a term of its own, so
    # the sums round in another order (max 3e-7 on logits of ~0.3 since the factors are fp32 again, session 42)
    assert (got - want).abs().max() <= (1e-6 if device == "cpu" else 1e-5)
    assert LoRA.check_quantized_base(loaded, folder) == folder  # names under peft's base_model.model. and base_layer
    module = llama_factory().to(device)
    QuantizedPrecision("nf4-dq", dtype="float32", rounding="gptq", probe_batch=probe.to(device)).convert_module(module)
    assert LoRA.check_quantized_base(module, str(folder)) == folder  # the LightningModule holding it: under model.
    with pytest.raises(ValueError, match=r"rounded 'nearest' in this base, the adapter needs rounding='gptq'"):
        LoRA.check_quantized_base(_base(llama_factory, device=device), folder)


def test_a_gptq_base_from_another_probe_is_refused_by_name(llama_factory: Callable, probe: torch.Tensor, tmp_path: Path) -> None:
    folder, _, _ = _export(llama_factory, probe, tmp_path / "adapter")
    other = synthetic_batch(4, 64, seed=3)[0]
    base = _base(llama_factory, rounding="gptq", probe_batch=other)
    with pytest.raises(ValueError, match=rf"First differing layer: {_LAYER}: its quantized weight differs from the run's "
                       r"\(GPTQ-rounded from another probe batch.*more layer\(s\) differ. Fix: quantize the base exactly as "
                       r"the run did \(QuantizedPrecision\('nf4-dq', rounding='gptq', probe_batch=<the run's probe batch>\)"):
        LoRA.check_quantized_base(base, folder)


def test_bitsandbytes_own_rounding_and_another_block_layout_are_refused(llama_factory: Callable, probe: torch.Tensor, tmp_path: Path) -> None:
    folder, _, _ = _export(llama_factory, probe, tmp_path / "adapter")
    nearest = _base(llama_factory)  # bitsandbytes' quantize_4bit: the Hugging Face QLoRA base
    with pytest.raises(ValueError, match=rf"{_LAYER}: rounded 'nearest' in this base, the adapter needs rounding='gptq'"):
        LoRA.check_quantized_base(nearest, folder)
    # the same base copied (a plain copy carries no lightning_hbm record: how it was rounded is unknown) is refused too
    with pytest.raises(ValueError, match=rf"{_LAYER}: its quantized weight differs .*bitsandbytes' own nearest rounding"):
        LoRA.check_quantized_base(copy.deepcopy(nearest), folder)
    with pytest.raises(ValueError, match=rf"{_LAYER}: stored as 'nf4' rounded 'gptq' \(uint8\[2048, 1\], float32\[64\].*the adapter needs 'nf4-dq'"):
        LoRA.check_quantized_base(_base(llama_factory, "nf4", rounding="gptq", probe_batch=probe), folder)
    # the unquantized base: its first quantized layer in the run was the input embedding (int8, the default's)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.quantized: not quantized in this base \(the adapter needs it "
                       r"stored as 'int8' rounded 'nearest'\); 14 more .*layer modes: nf4-dq 14, int8 1\).*Nothing was loaded"):
        LoRA.check_quantized_base(llama_factory().model, folder)


def test_a_folder_without_the_record_is_said_not_checked(llama_factory: Callable, probe: torch.Tensor, tmp_path: Path) -> None:
    """A folder of an older lightning_hbm (no record, a manifest without it): a warning naming why, no crash."""
    folder, _, _ = _export(llama_factory, probe, tmp_path / "adapter")
    (folder / BASE_RECORD).unlink()
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"][BASE_RECORD]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=rf"has no {BASE_RECORD}, so which quantized base its adapter fits cannot be checked"):
        assert LoRA.check_quantized_base(_base(llama_factory), folder) == folder
    (folder / BASE_RECORD).write_text("{not json")
    manifest["files"][BASE_RECORD] = (folder / BASE_RECORD).stat().st_size
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"{BASE_RECORD} cannot be read \(JSONDecodeError"):
        LoRA.check_quantized_base(_base(llama_factory), folder)
