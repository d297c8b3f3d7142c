"""The exports of a conv net trained on the corrected 4-bit base, each reloaded by plain peft (issue 52/53, session 42).

Session 41 corrected convolutions (``QuantizedPrecision(correction_rank=r)``) and ``LoRA.save_adapter(...,
with_correction=True)`` reshaped their factors (``[r, in x kernel]``, ``[out, r]``) into peft's conv LoRA shapes (a
rank-r convolution with the layer's kernel, stride and padding, then a 1x1 one), but no test reloaded that folder.
Here a Conv-BN-SiLU net (a strided 3x3, a 1x1, a 3x1 convolution; BatchNorm with data-like statistics), quantized to
nf4-dq with the rank-4 correction, LoRA on two of the convolutions, trained 2 steps by a Trainer, is exported:

- ``with_correction=True`` onto the same quantized base in float32 (every quantized weight dequantized, no
  correction): the run's own outputs;
- ``with_correction=False`` onto the full-precision net: ``LoRA.merge(..., base_state_dict=<the fp32 weights>)``'s.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import stored_in
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.precision.registry import format_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "layers"))
from conv_models import classifier, small_images  # noqa: E402

peft = pytest.importorskip("peft")


class Net(nn.Module):
    """Conv-BN-SiLU stem, a strided 3x3, a 1x1 and a 3x1 convolution (a kernel that is not square), a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 24, 3, padding=1), nn.BatchNorm2d(24)
        self.down = nn.Conv2d(24, 32, 3, stride=2, padding=1, bias=False)
        self.point = nn.Conv2d(32, 40, 1)
        self.tall = nn.Conv2d(40, 32, (3, 1), padding=(1, 0))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn(self.stem(x)))
        x = F.silu(self.point(F.silu(self.down(x))))
        return self.head(F.silu(self.tall(x)).mean((2, 3)))


def _net() -> Net:
    torch.manual_seed(0)
    net = Net()
    net.bn.momentum = None
    with torch.no_grad():  # data-like running statistics (a net at its initial statistics hides the 4-bit error)
        net.train()(small_images(5, 32))
    return net.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The run: nf4-dq with the rank-4 correction, LoRA r=2 on ``down`` and ``point``, 2 steps (BatchNorm trained)."""
    module = classifier(_net())
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=small_images(0), correction_rank=4, min_cosine=0.0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path_factory.mktemp("run"), plugins=[plugin],
        callbacks=[LoRA(r=2, alpha=4, target_modules=["down", "point"], modules_to_save=["head"])],
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    batches = [(small_images(10 + i), torch.randint(0, 10, (8,), generator=g)) for i in range(2)]
    trainer.fit(module.train(), DataLoader(batches, batch_size=None))  # train mode: the BatchNorm's statistics move
    return module.eval()


def _quantized_base(run: nn.Module) -> Net:
    """A fresh full-precision net whose quantized weights are the run's 4-bit weights dequantized to float32 (no
    correction): the plain quantized base, in float32."""
    base = _net()
    for name, sub in run.named_modules():
        storage = stored_in(sub)
        fmt = format_of(storage) if storage is not None else None
        if storage is None or fmt is None or not name.startswith("net."):
            continue
        target = base.get_submodule(name.removeprefix("net.").removesuffix(".base_layer"))
        with torch.no_grad():
            target.weight.copy_(fmt.dequantize(storage, torch.float32).reshape(target.weight.shape))
    return base


def test_the_run_is_what_this_checks(trained: Any) -> None:
    """Every convolution corrected and quantized; ``down`` / ``point`` carry trained adapters (peft's conv LoRA)."""
    for name in ["stem", "down", "point", "tall"]:
        layer = trained.net.get_submodule(name)
        assert correction_of(getattr(layer, "base_layer", layer)) is not None, name
    assert trained.net.bn.num_batches_tracked > 1  # trained: the exports must carry its statistics
    for name in ["down", "point"]:
        assert isinstance(trained.net.get_submodule(name), peft.tuners.lora.Conv2d), name
        assert trained.net.get_submodule(name).lora_B["default"].weight.abs().max() > 0, name  # trained


def test_the_export_with_the_correction_reloads_onto_the_quantized_base_with_the_runs_outputs(trained: Any, tmp_path: Path) -> None:
    x = small_images(1)
    with torch.no_grad():
        want = trained(x)
    folder = LoRA.save_adapter(trained, tmp_path / "for-quantized", submodule="net", with_correction=True)
    config = json.loads((folder / "adapter_config.json").read_text())
    # adapted: r_lora + r = 6; corrected only (stem, tall): rank 4 (the head, trained in full, is not quantized)
    assert config["rank_pattern"] == {"stem": 4, "down": 6, "point": 6, "tall": 4}, config["rank_pattern"]
    reloaded = peft.PeftModel.from_pretrained(_quantized_base(trained), str(folder)).eval()
    for name in ["stem", "down", "point", "tall"]:  # peft's own conv LoRA computes every convolution's term
        assert isinstance(reloaded.base_model.model.get_submodule(name), peft.tuners.lora.Conv2d), name
    with torch.no_grad():
        got = reloaded(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the folded factors mattered: the same base with the full-precision export (no correction) is far off
        without = LoRA.save_adapter(trained, tmp_path / "for-full", submodule="net")
        off = peft.PeftModel.from_pretrained(_quantized_base(trained), str(without)).eval()(x)
    assert (off - want).abs().max() > 100 * (got - want).abs().max(), ((off - want).abs().max(), (got - want).abs().max())


def test_the_full_precision_export_reloads_onto_the_fp32_net_as_merge_computes(trained: Any, tmp_path: Path) -> None:
    x = small_images(1)
    original = _net().state_dict()  # the weights the run was built from (seeded)
    merged = LoRA.merge(trained, dtype="float32", base_state_dict={f"net.{k}": v for k, v in original.items()})
    plain = _net()
    plain.load_state_dict({k.removeprefix("net."): v for k, v in merged.items()})
    folder = LoRA.save_adapter(trained, tmp_path / "for-full-precision", submodule="net")
    assert json.loads((folder / "adapter_config.json").read_text())["rank_pattern"] == {}
    reloaded = peft.PeftModel.from_pretrained(_net(), str(folder)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), plain.eval()(x), rtol=1e-4, atol=1e-4)
        assert (reloaded(x) - copy.deepcopy(_net())(x)).abs().max() > 1e-3  # the adapters and the trained stats are in it
