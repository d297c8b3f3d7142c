"""Embeddings and head stored small (issue 51 item 1): the 8B Llama-3 shape planned for CUDA at 2 x 2048.

QLoRA r=16 (LoRA's default targets), full checkpointing, FusedLoss, as ``benchmarks/planner.py``'s 8B line; then the
head quantized (``quantize_head=True``: FusedLoss unpacks it a vocabulary slice at a time), the input embedding too
(``quantize_embeddings=True``), the checkpointed blocks' inputs offloaded to host memory, and the token-wise layers
recomputed in 16 token chunks (``mlp_chunks=16``, as ``max_context`` chooses: the MLP, and the RMSNorms that compute
in fp32). Predictions of the
planner on this CPU (fake tensors), with the CUDA context it counts; not GPU measurements.

    python benchmarks/embedding_head.py            # every arm; or arms whose names hold a given part: ... "int8"
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import LLAMA_8B  # noqa: E402  (benchmarks/planner.py: the 8B shape)

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision  # noqa: E402
from lightning_hbm.data import synthetic_batch  # noqa: E402
from lightning_hbm.models import LlamaLM  # noqa: E402
from lightning_hbm.planner import format_bytes, plan  # noqa: E402

EMB8 = {"model.model.embed_tokens": "int8"}  # the embedding's name inside LlamaLM
ARMS = {
    # quantize_embeddings=False: the bf16 embedding of these rows (int8 is the default since session 30: the "int8" rows)
    "nf4-dq, bf16 embedding and head": ({"quantize_embeddings": False}, False),
    "+ quantize_head": ({"quantize_head": True, "quantize_embeddings": False}, False),
    "+ quantize_embeddings": ({"quantize_head": True, "quantize_embeddings": True}, False),
    "+ offload": ({"quantize_head": True, "quantize_embeddings": True}, True),
    "+ mlp_chunks=16 (the MLP and the fp32 norms in token chunks)": ({"quantize_head": True, "quantize_embeddings": True}, 16),
    # the embedding in int8 (a per-layer mode), the head and the Linears in NF4
    "+ quantize_embeddings, embedding int8": ({"quantize_head": True, "quantize_embeddings": True, "layer_modes": EMB8}, False),
    "+ mlp_chunks=16, embedding int8": ({"quantize_head": True, "quantize_embeddings": True, "layer_modes": EMB8}, 16),
}


def main() -> None:
    chosen = [name for name in ARMS if not sys.argv[1:] or any(part in name for part in sys.argv[1:])]  # substrings
    batch = synthetic_batch(2, 2048, vocab_size=LLAMA_8B["vocab_size"])
    print("| configuration | device peak | + CUDA context | parameters | activations | loss | host (pinned) | planned in |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in chosen:
        options, offload = ARMS[name]
        start = time.perf_counter()
        plugin = QuantizedPrecision("nf4-dq", dtype="bfloat16", **options)
        chunks = offload if offload > 1 else 1  # an int above 1: offload too, and that many token chunks
        callbacks = [LoRA(r=16), ActivationCheckpointing("full", offload=bool(offload), mlp_chunks=chunks), FusedLoss()]
        result = plan(partial(LlamaLM, **LLAMA_8B), batch, device="cuda", plugin=plugin, callbacks=callbacks).predictions[0]
        seconds = time.perf_counter() - start
        print(f"| {name} | {format_bytes(result.peak)} | {format_bytes(result.total)} | {format_bytes(result.categories['parameters'])} | "
              f"{format_bytes(result.categories['activations'])} | {format_bytes(result.loss)} | {format_bytes(result.host)} "
              f"| {seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
