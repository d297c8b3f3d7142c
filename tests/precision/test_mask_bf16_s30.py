"""A mask of -1e9 as built that bfloat16 rounds to -998,244,352 (just above -1e9) is the same mask: the accuracy check's
centred cosine and the probe's metrics leave it out, so the real outputs are measured (session 30 review: session 29
read a mask as one only where the computed value was at most -1e9 or the dtype's lowest, which bfloat16's rounding of
-1e9 is not; the mask then dominated the figure, ~1.0 whatever the quantization did)."""

from __future__ import annotations

import torch

from lightning_hbm.precision.accuracy import centred_cosine, overflowed
from lightning_hbm.probe import PREFIX, compare_outputs


def _masked() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    reference = torch.randn(4, 10, 32)
    reference[..., :5] = -1e9
    broken = -reference  # every real output wrong (the sign flipped); the mask kept, in bfloat16
    broken[..., :5] = -1e9
    return reference, broken.bfloat16()


def test_a_bfloat16_rounded_mask_is_left_out_of_the_accuracy_figure() -> None:
    reference, broken = _masked()
    assert broken.float()[0, 0, 0].item() > -1e9  # -998244352: bfloat16's nearest
    limit = torch.finfo(torch.bfloat16).max
    assert bool(overflowed(broken.float(), reference, limit)[..., :5].all())
    assert centred_cosine(broken.float(), reference, limit) < -0.9  # was 1.0000: the broken model passed
    healthy = (reference + 0.01 * torch.randn_like(reference)).bfloat16().float()
    assert 0.999 < centred_cosine(healthy, reference, limit) <= 1.0


def test_a_bfloat16_rounded_mask_is_left_out_of_the_probe_metrics() -> None:
    reference, broken = _masked()
    got = compare_outputs(broken, reference, lm=False)
    assert got[PREFIX + "cosine_similarity"] < -0.9  # was ~1.0
    healthy = compare_outputs((reference + 0.01 * torch.randn_like(reference)).bfloat16(), reference, lm=False)
    assert 0.999 < healthy[PREFIX + "cosine_similarity"] <= 1.0 and healthy[PREFIX + "relative_error"] < 0.05


def test_a_large_value_of_the_outputs_own_is_still_no_mask() -> None:
    # -1e5 as built is the output's own value, compared as one (not a mask); -6e8 where the reference masks is no mask
    reference, _ = _masked()
    assert not bool(overflowed(torch.full((3,), -1e5), torch.full((3,), -1e5), torch.finfo(torch.bfloat16).max).any())
    assert not bool(overflowed(torch.full((3,), -6e8), torch.full((3,), -1e9), torch.finfo(torch.bfloat16).max).any())
