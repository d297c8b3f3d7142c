"""The registry drives its consumers: a term's measurement and advice live in its entry, and a toy term added with
one ``register_term`` call shows in the planner's ``Prediction.terms`` and table, the report, and the profiler."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import HBMProfiler
from lightning_hbm.memory import (
    CATEGORIES,
    TERMS,
    Category,
    MemoryBreakdown,
    MemoryTerm,
    RunFacts,
    category_terms,
    memory_scope,
    owned_tensors,
    register_term,
    scope_terms,
    side_terms,
    term,
    unregister_term,
)
from lightning_hbm.memory.report import REMEDIES, MemoryReport, advice
from lightning_hbm.memory.terms import created_term, rest_term
from lightning_hbm.planner import Candidate, Plan, Prediction, predict
from lightning_hbm.profiling.run_facts import run_facts

ROOT = Path(__file__).resolve().parents[2]
TOY = "toy"
WIDE = 4096  # the toy scope's tensor: [rows, WIDE] fp32, saved for backward
ROWS = 64


# -- the categories: MemoryBreakdown, the Category literal and owned_tensors agree with the registry -------------
def test_breakdown_fields_and_literal_are_the_category_terms() -> None:
    names = tuple(t.name for t in category_terms())
    assert tuple(f.name for f in fields(MemoryBreakdown)) == names == CATEGORIES == get_args(Category)


def test_owned_tensors_and_classification_follow_the_entries() -> None:
    module = nn.Linear(3, 2)
    module.register_buffer("running", torch.zeros(5))
    optimizer = torch.optim.SGD(module.parameters(), momentum=0.9)
    owned = owned_tensors(module, optimizer)
    assert list(owned) == [t.name for t in category_terms() if t.owns is not None]  # registry order, no activations
    assert [t.shape for t in owned["other"]] == [torch.Size([5])]
    assert (created_term("forward"), created_term("backward"), rest_term()) == ("activations", "other", "other")


def test_register_term_refuses_a_category_a_duplicate_and_a_builtin_removal() -> None:
    with pytest.raises(ValueError, match="is a category; the categories are the fixed sum"):
        register_term(MemoryTerm("sixth", "category", "o", "a", "split", "r", "g.md", rest=True))
    with pytest.raises(ValueError, match="a memory term 'loss' exists already"):
        register_term(MemoryTerm("loss", "scope", "o", "a", "per-rank", "r", "g.md"))
    with pytest.raises(ValueError, match="built-in"):
        unregister_term("loss")
    with pytest.raises(ValueError, match="a host term, and only a host term"):
        MemoryTerm("h", "host", "o", "a", "host", "r", "g.md")


# -- advice reads typed facts, filled by the caller ---------------------------------------------------------------
def test_every_term_advises_its_remedy_on_a_plain_run_but_other() -> None:
    plain = RunFacts()
    assert {t.name: advice(t.name, plain) for t in TERMS if t.name != "other"} == {
        t.name: REMEDIES[t.name] for t in TERMS if t.name != "other"
    }
    assert "FusedLoss" in advice("other", plain)


def test_bits_per_weight_not_the_name_decide_an_8bit_base() -> None:
    # a format named without a "4" that stores 4 bits is 4-bit; the old rule ("4" not in the name) called it 8-bit
    assert "what is left" in advice("parameters", RunFacts(precision="qlow", bits_per_weight=4.5))
    assert "halves it again" in advice("parameters", RunFacts(precision="int8", bits_per_weight=8.03))
    with pytest.raises(ValueError, match="go together"):
        RunFacts(precision="nf4")


def test_facts_survive_the_report_json(tmp_path: Path) -> None:
    facts = RunFacts(precision="nf4-dq", bits_per_weight=4.13, lora=True, optimizers=("AdamW8bit",), compact_states=True)
    row = {"step": 0, "mode": "light", **dict.fromkeys(CATEGORIES, 1), "total": 5}
    paths = MemoryReport([row], used={"facts": facts.as_dict()}).write(tmp_path, "hbm_profile")
    assert MemoryReport.load(paths["json"]).facts == facts
    assert MemoryReport([row]).facts == RunFacts()  # a report written before facts were kept: a plain run


def test_run_facts_reads_the_trainer_and_the_model() -> None:
    from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA

    model = nn.Sequential(nn.Linear(4, 4))
    trainer = SimpleNamespace(
        precision_plugin=None,
        callbacks=[LoRA(r=2), ActivationCheckpointing(), FusedLoss()],
        optimizers=[torch.optim.AdamW(model.parameters())],
    )
    facts = run_facts(trainer, model)  # type: ignore[arg-type]  # what run_facts reads of a Trainer
    assert facts == RunFacts(lora=True, checkpointing=True, fused_loss=True, optimizers=("AdamW",))


def test_run_facts_measures_the_bits_of_a_quantized_base() -> None:
    pytest.importorskip("bitsandbytes")
    from lightning_hbm.precision import QuantizedPrecision, quantize_model

    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    quantize_model(model, "nf4-dq", "float32")
    plain = SimpleNamespace(precision_plugin=None, callbacks=[], optimizers=[])
    facts = run_facts(plain, model)  # type: ignore[arg-type]
    assert facts.precision == "nf4" and 4.0 < facts.bits_per_weight < 4.6, facts  # the layer class: nf4 or nf4-dq
    configured = SimpleNamespace(precision_plugin=QuantizedPrecision("nf4-dq", dtype="float32"), callbacks=[], optimizers=[])
    assert run_facts(configured, model).precision == "nf4-dq"  # type: ignore[arg-type]
    int8 = nn.Sequential(nn.Linear(256, 256))
    quantize_model(int8, "int8", "float32")
    assert 8.0 <= run_facts(plain, int8).bits_per_weight < 8.5  # type: ignore[arg-type]
    assert run_facts(plain, nn.Linear(4, 4)) == RunFacts()  # type: ignore[arg-type]


# -- a toy term: one register_term call, seen by the planner, the report and the profiler -------------------------
@pytest.fixture
def toy_term() -> Iterator[MemoryTerm]:
    entry = register_term(MemoryTerm(
        TOY, "scope",
        owner="what the toy block allocates inside memory_scope('toy')",
        alive="the toy block's forward and backward",
        sharding="per-rank",
        remedy="shrink the toy block",
        guide="extending.md#a-memory-term",
    ))  # fmt: skip
    try:
        yield entry
    finally:
        unregister_term(TOY)


class ToyScoped(pl.LightningModule):
    """A linear layer whose widened output, made inside ``memory_scope("toy")``, is saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.ones(WIDE))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch if isinstance(batch, (list, tuple)) else (batch,)
        with memory_scope(TOY):
            wide = self.layer(x).repeat(1, WIDE // 64)  # [ROWS, WIDE] fp32: 1 MiB, saved by the multiplication below
        return (wide * self.scale).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_registered_term_is_in_the_registry_helpers(toy_term: MemoryTerm) -> None:
    assert term(TOY) is toy_term and toy_term in scope_terms() and side_terms()[-1] == TOY
    assert advice(TOY, RunFacts()) == "shrink the toy block"


def test_toy_term_shows_in_the_planners_terms_and_table(toy_term: MemoryTerm) -> None:
    prediction = predict(ToyScoped, (torch.randn(ROWS, 64),), Candidate("32-true"))
    assert list(prediction.terms) == [t.name for t in TERMS] and prediction.terms[TOY] == prediction.side[TOY]
    # the scope's output, alive at the forward's peak (its repeat's input too, maybe): 1 MiB, inside the sum
    assert ROWS * WIDE * 4 <= prediction.terms[TOY] <= prediction.peak
    plan = Plan([prediction])
    assert TOY in plan.header() and plan.header().index(TOY) == 1 + len(CATEGORIES)
    assert TOY in str(plan).splitlines()[0]
    assert TOY not in Plan([Prediction(Candidate("32-true"), dict.fromkeys(CATEGORIES, 1))]).header()  # none held


def test_toy_term_shows_in_the_report(toy_term: MemoryTerm) -> None:
    row = {"step": 1, "mode": "detailed", **dict.fromkeys(CATEGORIES, 2**20), "total": 5 * 2**20, TOY: 2**20}
    report = MemoryReport([row], columns=("step", "mode", *CATEGORIES, "total", "tracked_peak", *side_terms()))
    assert [line[0] for line in report.summary_lines()[1]][-1] == TOY
    assert advice(TOY, report.facts) == toy_term.remedy


def test_toy_term_shows_in_the_profilers_rows(toy_term: MemoryTerm, tmp_path: Path) -> None:
    profiler = HBMProfiler(every_n_steps=1, detailed_steps=[1], summary=False, dirpath=str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[profiler])  # fmt: skip
    trainer.fit(ToyScoped(), DataLoader([(torch.randn(64),) for _ in range(2 * ROWS)], batch_size=ROWS))
    detailed = next(r for r in profiler.rows if r["mode"] == "detailed")
    assert detailed[TOY] >= ROWS * WIDE * 4
    assert TOY in [line[0] for line in profiler.report().summary_lines()[1]]


# -- docs/extending.md says what a term touches; the toy term above proves the scope count ---------------------------
def test_docs_state_what_adding_a_term_touches() -> None:
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("## A memory term") : text.index("## Project layout")]
    bullets = {m.group(1): m.group(0) for m in re.finditer(r"^- a `(\w+)` term[^\n]*(?:\n  [^\n]*)*", section, re.M)}
    touched = {kind: set(re.findall(r"`(lightning_hbm/[\w/]+\.py)`", bullet)) for kind, bullet in bullets.items()}
    assert touched == {
        "scope": {"lightning_hbm/memory/terms.py"},
        "host": {"lightning_hbm/memory/terms.py"},
        "category": {"lightning_hbm/memory/terms.py", "lightning_hbm/memory/categories.py"},
    }, touched
