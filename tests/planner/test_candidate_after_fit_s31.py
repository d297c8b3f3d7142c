"""A plugin that already ran its surgery gives the planner the candidate it gave before (session 31).

Was: after the surgery ``plugin.layer_modes`` lists the input embeddings the default stores in int8 (``{"emb":
"int8"}``), and ``Candidate.from_trainer`` read that as a pinned per-layer plan: ``nf4-dq[mixed:1 int8]``, planned
as a fixed plan (no extrapolation), for a run that had none.
"""

from __future__ import annotations

from lightning_hbm import QuantizedPrecision
from lightning_hbm.planner import Candidate
from tests.precision.test_embedding_default_s30 import Tied


def test_the_default_int8_embedding_is_no_plan_of_the_candidate() -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32")
    before = Candidate.from_trainer(plugin)
    plugin.convert_module(Tied())
    assert plugin.layer_modes == {"emb": "int8"}  # what the run stored, as the plugin reports it
    after = Candidate.from_trainer(plugin)
    assert after.name == before.name == "nf4-dq (as configured)" and after.layer_modes is None  # was nf4-dq[mixed:1 int8]
    assert after.quantize_embeddings == "auto"
