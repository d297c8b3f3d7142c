"""The fit-start accuracy check with the model as built's selections followed (session 28).

The quantized forward of the check is given the model as built's picks wherever it picks otherwise (a kNN graph's
neighbours, a detector's boxes and labels; ``probe.following``), so its output is compared on the same routes. Models,
each through ``QuantizedPrecision(...).convert_module`` on its probe:

- ``TopK``, ``PerClass``, ``PostProcessed`` (NMS, threshold 0.7): the YOLO-style detectors of the tests
  (``tests/precision/test_accuracy_selected.py``, ``test_quant_attack_s28.py``, ``test_accuracy_postprocessed.py``);
- ``DGCNN``: ``tests/precision/dgcnn.py`` (kNN by ``topk`` in each of 4 EdgeConvs, BatchNorm calibrated), 4 clouds of
  256 points.

Arms: ``int8`` in bf16 and fp32, every convolution pinned to ``nf4-dq`` (wrecked). Per arm: the figure, where it was
measured, the selections followed (differed / recorded), the output figure on the routes followed, whether it warned.
``--moe``: instead, a tiny Mixtral and Qwen2-MoE (random init, 4 layers, 8 experts, top-2; no download) in bf16 against
fp32 through ``probe.following`` (the conv check does not run on them: no convolutions): logits cosine as computed and
with the experts followed. ``--overhead``: one forward of each model under ``recording_selections`` without and with a
budget for the copies (what the reference forward now keeps), median of 7.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/followed_selections.py [--moe] [--overhead]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "layers"), str(ROOT / "tests" / "precision")]
from conv_models import calibrate, images  # noqa: E402
from dgcnn import clouds, dgcnn  # noqa: E402
from test_accuracy_postprocessed import detector  # noqa: E402
from test_accuracy_selected import TopK  # noqa: E402
from test_quant_attack_s28 import PerClass  # noqa: E402

from lightning_hbm import QuantizedPrecision  # noqa: E402
from lightning_hbm.probe import recording_selections  # noqa: E402


def _calibrated(make: Callable[[], Any]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        net = make()
        calibrate(net.model, images(8, seed=10, batches=4))
        return net.eval()

    return build


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "TopK": (_calibrated(TopK), lambda: images(4, seed=2)),
    "PerClass": (_calibrated(PerClass), lambda: images(4, seed=2)),
    "PostProcessed": (lambda: detector(0, 0.7), lambda: images(4, seed=2)),
    "DGCNN": (dgcnn, lambda: clouds(4, 2)),
}


def checks() -> None:
    for name, (make, probe) in MODELS.items():
        net = make()
        for mode, dtype in [("int8", "bfloat16"), ("int8", "float32"), ("nf4-dq", "float32")]:
            pinned = {n: "nf4-dq" for n, layer in net.named_modules() if isinstance(layer, (nn.Conv1d, nn.Conv2d))}
            plugin = QuantizedPrecision(mode, dtype=dtype, probe_batch=probe(), **({"layer_modes": pinned} if mode == "nf4-dq" else {}))
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                plugin.convert_module(copy.deepcopy(net))
            m = plugin.quantization.conv_accuracy
            assert m is not None
            warned = any("lightning_hbm" in str(w.message) for w in seen)
            routed = "-" if getattr(m, "routed", None) is None else f"{m.routed:.4f}"  # getattr: the script runs before session 28 too
            followed = f"{getattr(m, 'followed', '-')}/{getattr(m, 'selections', '-')}"
            print(f"| {name} | {mode}, {dtype} | {m.cosine:.4f} at {m.measured_at or 'every output'} | {followed} | {routed} | {warned} |")


def moe() -> None:
    import transformers

    from lightning_hbm.probe import following

    configs = {
        "Mixtral": transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                              num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),  # fmt: skip
        "Qwen2-MoE": transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                                                 shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                                 num_experts_per_tok=2),  # fmt: skip
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), recording_selections([], budget=1 << 24) as reference:
            want = model(input_ids=ids).logits
        low = copy.deepcopy(model).to(torch.bfloat16)
        with torch.no_grad():
            natural = low(input_ids=ids).logits
        with torch.no_grad(), following([], reference) as followed:
            got = low(input_ids=ids).logits
        print(f"| {name} | {_cos(natural, want):.5f} | {_cos(got, want):.5f} | {followed.differed}/{len(reference)} | {followed.stopped} |")


def _cos(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().flatten(), want.double().flatten()
    return float(nn.functional.cosine_similarity(got - want.mean(), want - want.mean(), dim=0))


def overhead() -> None:
    for name, (make, probe) in MODELS.items():
        net, x = make(), probe()
        times: dict[int, list[float]] = {0: [], 1 << 27: []}
        with torch.no_grad():
            for _ in range(7):
                for budget, kept in times.items():
                    start = time.perf_counter()
                    with recording_selections([], budget=budget):
                        net(x)
                    kept.append(time.perf_counter() - start)
        print(f"| {name} | {1e3 * statistics.median(times[0]):.1f} ms | {1e3 * statistics.median(times[1 << 27]):.1f} ms |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    moe() if "--moe" in sys.argv else overhead() if "--overhead" in sys.argv else checks()
