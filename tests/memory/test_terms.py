"""The registry of memory terms: what reads it (profiler, planner, report, docs) and the one peak classifier."""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_hbm.memory import CATEGORIES, TERMS, classify_records, term, terms_table
from lightning_hbm.memory.report import REMEDIES, MemoryReport
from lightning_hbm.memory.storage import storage_key
from lightning_hbm.memory.terms import SIDE_TERMS, MemoryTerm, split_terms
from lightning_hbm.memory.tracker import StorageRecord
from lightning_hbm.planner import Candidate, Plan, Prediction, shard_categories, tracing
from lightning_hbm.profiling import steps as profiler  # the step measurement: StepMemory (HBMProfiler is its face)
from lightning_hbm.profiling.profiler import COLUMNS

ROOT = Path(__file__).resolve().parents[2]


def test_categories_are_the_registry_category_terms_in_order() -> None:
    assert CATEGORIES == tuple(t.name for t in TERMS if t.kind == "category")
    assert SIDE_TERMS == ("loss", "host_offload", "host_activations")
    assert len({t.name for t in TERMS}) == len(TERMS)


def test_profiler_columns_and_remedies_come_from_the_registry() -> None:
    assert COLUMNS[3 : 3 + len(CATEGORIES) + 2 + len(SIDE_TERMS)] == (*CATEGORIES, "total", "tracked_peak", *SIDE_TERMS)
    assert REMEDIES == {t.name: t.remedy for t in TERMS}


def test_unknown_term_and_bad_sharding_are_clear_errors() -> None:
    with pytest.raises(KeyError, match=r"'gradient' is not a memory term; the terms are \['parameters'"):
        term("gradient")
    with pytest.raises(ValueError, match=r"MemoryTerm 'x': sharding 'sharded' is not one of \['gathered', 'host'"):
        MemoryTerm("x", "category", "owner", "alive", "sharded", "remedy", "guide.md")


def test_docs_terms_table_is_the_generated_one() -> None:
    text = (ROOT / "docs" / "extending.md").read_text()
    found = re.search(r"<!-- generated: lightning_hbm.memory.terms.terms_table\(\) -->\n(.*?)<!-- end generated -->", text, re.S)
    assert found, "docs/extending.md lost its generated terms table"
    assert found.group(1) == terms_table(), "paste lightning_hbm.memory.terms.terms_table() into docs/extending.md"
    assert terms_table().count("\n| `") == len(TERMS)


def test_shard_categories_splits_the_split_terms() -> None:
    categories = dict.fromkeys(CATEGORIES, 100)
    per_rank = shard_categories(categories, world_size=4, gathered_bytes=10)
    assert split_terms() == ("parameters", "gradients", "optimizer_states")
    assert per_rank == {"parameters": 25, "gradients": 25, "optimizer_states": 25, "activations": 100, "other": 110}


def test_prediction_terms_are_every_registry_term() -> None:
    categories = {c: i + 1 for i, c in enumerate(CATEGORIES)}
    prediction = Prediction(Candidate("32-true"), categories, host_bytes=7, loss=3)
    assert prediction.terms == {**categories, "loss": 3, "host_offload": 7, "host_activations": 0}
    assert list(prediction.terms) == [t.name for t in TERMS]


def test_plan_names_the_host_term_of_an_offloaded_candidate() -> None:
    categories = dict.fromkeys(CATEGORIES, 2**20)
    plain, offloaded = Candidate("32-true"), Candidate("32-true", offload=True)
    text = str(Plan([Prediction(plain, categories), Prediction(offloaded, categories, host_bytes=3 * 2**20)]))
    assert f"{offloaded.name}: host_offload 3.00 MiB in host memory, beside the peak" in text
    assert f"{plain.name}: host_offload" not in text


def _row(step: int, host: int) -> dict:
    return {"step": step, "mode": "light", **dict.fromkeys(CATEGORIES, 2**20), "total": 5 * 2**20, "host_offload": host}


def test_summary_shows_host_offload_only_when_memory_moved_there() -> None:
    def names(rows: list) -> list[str]:
        return [line[0] for line in MemoryReport(rows).summary_lines()[1]]

    assert "host_offload" not in names([_row(0, 0)])
    assert "host_offload" in names([_row(0, 3 * 2**20)])


# -- the one peak classifier ---------------------------------------------------------------------------------------
def _record(tensor: torch.Tensor, phase: str) -> tuple[tuple, StorageRecord]:
    storage = tensor.untyped_storage()
    return storage_key(storage), StorageRecord(weakref.ref(storage), storage.nbytes(), phase, "")


def test_classify_records_by_owner_then_seeded_phase_then_forward() -> None:
    grad, old_grad, saved, temp = torch.zeros(4), torch.zeros(8), torch.zeros(16), torch.zeros(32)
    records = dict([_record(grad, "backward"), _record(old_grad, "gradients"), _record(saved, "forward"), _record(temp, "setup")])
    owned = {next(iter(records)): ("gradients", 16)}  # the backward output that became .grad
    assert classify_records(records, owned) == {
        "parameters": 0, "gradients": 16 + 32, "optimizer_states": 0, "activations": 64, "other": 128
    }  # fmt: skip
    assert classify_records(records, owned, device="meta") == dict.fromkeys(CATEGORIES, 0)
    assert classify_records(records, owned, device="cpu") == classify_records(records, owned)


def test_classify_records_ignores_an_owner_of_a_reused_address() -> None:
    tensor = torch.zeros(4)
    key, record = _record(tensor, "forward")
    dead = record._replace(ref=lambda: None)  # the storage died; its address now belongs to a parameter
    assert classify_records({key: dead}, {key: ("parameters", 16)})["activations"] == 16


def test_profiler_and_planner_share_the_classifier() -> None:
    # no private copy left in either: both name the memory package's function
    assert profiler.classify_records is classify_records and tracing.classify_records is classify_records
    assert not hasattr(profiler, "_classify_peak") and not hasattr(tracing, "_classify")


def test_host_activations_reads_the_offload_hooks_of_checkpointed_blocks(gpt_factory: Callable) -> None:
    from lightning_hbm.activations.checkpointing import ActivationCheckpointing

    model = gpt_factory()
    callback = ActivationCheckpointing(offload=True)
    callback.transform_model(model)
    assert callback.offload is not None
    callback.offload.host_bytes = 1234  # what a CUDA step leaves (pinned copies); 0 on a CPU run
    assert term("host_activations").host(model, []) == 1234
    assert term("host_activations").host(gpt_factory(), []) == 0
