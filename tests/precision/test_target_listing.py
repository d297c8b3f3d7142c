"""The listing's resume embedding rules, read on the checkpoint's settings as handed down (read once a listing)."""

from __future__ import annotations

from lightning_hbm.precision.target_listing import KEPT_UNDER, kept_under_unrecorded, resumed_with_wide_embeddings


def test_resume_rules_read_the_settings_handed_down() -> None:
    wide = {"mode": "nf4", "dtype": "torch.bfloat16"}  # saved with the embeddings kept wide: no quantize_embeddings
    unrecorded = {**wide, "quantize_embeddings": "int8"}  # converted, before the small tables kept were recorded
    recorded = {**unrecorded, KEPT_UNDER: 8192}
    assert resumed_with_wide_embeddings(wide) and not resumed_with_wide_embeddings(unrecorded)
    assert kept_under_unrecorded(unrecorded) and not kept_under_unrecorded(recorded) and not kept_under_unrecorded(wide)
    assert not resumed_with_wide_embeddings(None) and not kept_under_unrecorded(None)  # no checkpoint, or none saved
