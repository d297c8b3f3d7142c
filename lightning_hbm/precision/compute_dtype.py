"""The compute dtype chosen by running: ``QuantizedPrecision(mode, dtype="auto")``.

Whether bfloat16 trains faster than float32 is a property of the machine, not of its flags alone:

- on a GPU with bf16 (``torch.cuda.is_bf16_supported()``), bf16 is the dtype QLoRA is run in; elsewhere on CUDA,
  float32 (float16 would need a loss scaler, which a true-dtype plugin does not have);
- on a CPU it depends on more than the matmul. Two 2-core EPYCs reporting the same ``avx512_bf16`` flag measured
  the same QLoRA step (SmolLM2-135M, ``benchmarks/cpu_dtype.py``) at 1.53x the float32 time in bf16 on one and
  at 0.57x on the other (benchmarks/README.md, "Compute dtype on a CPU"); without bf16 instructions bf16 matmuls are
  several times slower. So the choice times a small transformer block (norm, attention, gated MLP: forward and
  backward, the ops a fine-tune's step is made of) in both dtypes on this CPU, and takes bf16 only when it is
  clearly faster (``BF16_MARGIN``): bf16 keeps 8 bits of mantissa, so it has to earn its place.

The measurement takes a fraction of a second, once, when the plugin is built. It is reported (the figures and the
choice) in the plugin's ``dtype_choice`` and in one log line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

#: bf16 is chosen on a CPU only when its block takes at most this fraction of float32's time
BF16_MARGIN = 0.9
#: the timed block: tokens, width, heads, MLP width (a small decoder block; large enough that the matmuls and the
#: attention kernel, not Python, take most of the time)
_TOKENS, _WIDTH, _HEADS, _MLP = 256, 384, 6, 1024


@dataclass(frozen=True)
class DtypeChoice:
    """What ``dtype="auto"`` chose, on which device, from which figures."""

    dtype: torch.dtype
    device: str  #: "cpu" or "cuda": where the choice was made (a run on the other one must name its dtype)
    seconds: dict[str, float] = field(default_factory=dict)  #: CPU only: best time of the timed block per dtype
    reason: str = ""

    def describe(self) -> str:
        """One line for the log: the choice and why."""
        return f"lightning_hbm: compute dtype {str(self.dtype).removeprefix('torch.')} (dtype='auto' on {self.device}: {self.reason})"


def choose(seconds: dict[str, float], margin: float = BF16_MARGIN) -> torch.dtype:
    """bf16 if its time is at most ``margin`` times float32's, else float32.

    Args:
        seconds: ``{"float32": s, "bfloat16": s}``, each the time of the same work.
        margin: the fraction of float32's time bf16 must beat.

    Raises:
        ValueError: a missing dtype or a time that is not positive.
    """
    if set(seconds) != {"float32", "bfloat16"} or min(seconds.values()) <= 0:
        raise ValueError(f"choose() needs a positive time for float32 and for bfloat16, got {seconds!r}.")
    return torch.bfloat16 if seconds["bfloat16"] <= margin * seconds["float32"] else torch.float32


def block_seconds(dtype: torch.dtype, repeats: int = 3, seed: int = 0) -> float:
    """Best-of-``repeats`` CPU time of one small decoder block's forward + backward in ``dtype`` (after a warm-up).

    Process CPU time, not wall time: what other jobs on a shared machine take does not count.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, grad: bool = False) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype).requires_grad_(grad)

    x = rand(1, _TOKENS, _WIDTH, grad=True)
    qkv, out = rand(3 * _WIDTH, _WIDTH), rand(_WIDTH, _WIDTH)
    gate, up, down = rand(_MLP, _WIDTH), rand(_MLP, _WIDTH), rand(_WIDTH, _MLP)
    norm = torch.ones(_WIDTH, dtype=dtype, requires_grad=True)

    def step() -> None:
        h = F.rms_norm(x, (_WIDTH,), norm)
        q, k, v = F.linear(h, qkv).view(1, _TOKENS, 3, _HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, _TOKENS, _WIDTH)
        h = x + F.linear(a, out)
        m = F.rms_norm(h, (_WIDTH,), norm)
        (h + F.linear(F.silu(F.linear(m, gate)) * F.linear(m, up), down)).float().square().mean().backward()

    return _best(step, repeats)


def _best(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: first-call dispatch and allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        step()
        best = min(best, time.process_time() - start)
    return max(best, 1e-9)


def auto_dtype(device: Optional[str] = None) -> DtypeChoice:
    """The compute dtype for ``dtype="auto"`` on ``device`` (default: "cuda" if CUDA is available, else "cpu")."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, device, reason="the GPU supports bf16")
        return DtypeChoice(torch.float32, device, reason="the GPU has no bf16; float16 would need a loss scaler")
    if device != "cpu":
        raise ValueError(f"dtype='auto' chooses for 'cpu' or 'cuda', not {device!r}: pass dtype='bfloat16' or 'float32'.")
    seconds = {name: block_seconds(getattr(torch, name)) for name in ("float32", "bfloat16")}
    dtype = choose(seconds)
    ratio = seconds["bfloat16"] / seconds["float32"]
    verdict = "bf16 is faster" if dtype == torch.bfloat16 else f"bf16 is not under {BF16_MARGIN:.2f}x"
    reason = (f"a decoder block's forward + backward took {seconds['bfloat16'] * 1e3:.1f} ms in bf16 against "
              f"{seconds['float32'] * 1e3:.1f} ms in float32 on this CPU ({ratio:.2f}x): {verdict}")
    return DtypeChoice(dtype, device, seconds, reason)
