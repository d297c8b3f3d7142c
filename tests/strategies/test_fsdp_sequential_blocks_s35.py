"""FSDP2 units and the per-rank plan for blocks held in an ``nn.Sequential`` (session 35, issue 51).

``QuantizedFSDPStrategy`` made units only of the members of an ``nn.ModuleList``: a LightningModule holding its blocks
in ``self.blocks = nn.Sequential(*blocks)`` had one unit for the whole stack (every block gathered at once), while the
planner, like ``ActivationCheckpointing`` (both through ``find_blocks``), plans one unit per block. One rule now holds on
both sides: the repeated blocks held in an ``nn.Sequential`` (``find_blocks``) are units, one each, as a list's members
are (``sequential_blocks``); the ``nn.Sequential`` itself, called by the LightningModule, is the unit around them (the
root that prefetches one block's all-gather in the backward of the other: the planner's ``_model_holding``). Its output
is the last block's, so the backward has no region "after block -1" before that block (``_PeakPoints``: the block's
backward was named so, planned one gathered block short). A LightningModule that iterates the ``nn.Sequential``
(``for block in self.blocks``) never runs its forward: each block is then an FSDP2 root of its own (the trace says so:
the holder's forward did not run), and before session 35 the fit failed at the first block ("aten.native_layer_norm
got mixed torch.Tensor and DTensor": the stack's one unit was never gathered).

The gradients in the backward, per rank (``fsdp2_gradient_bytes``): the trace keeps every gradient the backward made,
whole; FSDP2 keeps a shard of each block's once its backward ends, and the reduce-scatter's input (that block's
gradients, whole) until the next reduce-scatter of the same root, or to the backward's end when each block is a root of
its own. Six checkpointed blocks with LoRA r=128 put the rank's peak in the backward, late, where that counts: called,
planned 10.1 % over before; iterated, 11.7 % under. Also: the last block of the backward (``block 0``) has no block to
prefetch (one block gathered, not two).

One 2-rank gloo run (this file run as a script, as in test_fsdp_remainder_units_s34.py) fits the models of ``MODELS``
for one epoch each with the ``HBMProfiler`` in detailed mode (the per-rank peak, max over ranks); session 37 added the
partial offload, and ``ActivationCheckpointing(regenerate=2)`` beside ``regenerate=1`` on three stacks (each rank's
trained weights saved, compared bit for bit). Session 38 added two steps each of the 8-block stack in the user's own
units (``IN_UNITS``: pairs of blocks, or one unit around the stack), for what ``regenerate`` says at fit start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fsdp_qlora import DATA, GLOBAL_BATCH, _datamodule, run_script_on_two_ranks  # noqa: E402
from test_fsdp_remainder_units_s34 import fit_profiled, measured_peak, plan_matches, profiler_for  # noqa: E402

HIDDEN = 256


def _sequential_stack(iterated: bool = False, depth: int = 2, pairs: bool = False) -> Any:
    """An embedding, two residual MLP blocks in ``self.blocks = nn.Sequential(...)``, a norm and an untied head, each a
    child of the LightningModule; the stack called (``self.blocks(x)``) or iterated (``for block in self.blocks``).
    ``pairs``: the stack holds ``depth // 2`` modules of two blocks each (``Pair``: a user's unit of two blocks)."""
    from torch import nn

    from lightning_hbm.models import _CausalLMModule

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(HIDDEN)
            self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down = nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    class SequentialStack(_CausalLMModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, HIDDEN)
            self.blocks = nn.Sequential(*(Pair() if pairs else Block() for _ in range(depth // 2 if pairs else depth)))
            self.norm = nn.LayerNorm(HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, 256, bias=False)

        def logits(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            if iterated:
                for block in self.blocks:
                    x = block(x)
            else:
                x = self.blocks(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(0)
    return SequentialStack()


def _called() -> Any:
    return _sequential_stack()


def _iterated() -> Any:
    return _sequential_stack(iterated=True)


def _called_deep() -> Any:
    return _sequential_stack(depth=6)


def _iterated_deep() -> Any:
    return _sequential_stack(iterated=True, depth=6)


def _called_long() -> Any:
    return _sequential_stack(depth=8)


def _iterated_long() -> Any:
    return _sequential_stack(iterated=True, depth=8)


MODELS = {"called": _called, "iterated": _iterated, "called_deep": _called_deep, "iterated_deep": _iterated_deep,
          "called_deep_offload4": _called_deep, "called_deep_remade": _called_deep,
          "called_long": _called_long, "called_long_remade": _called_long, "iterated_long": _iterated_long,
          "iterated_long_remade": _iterated_long, "called_long_remade3": _called_long}
# the deep stacks: LoRA r=128 and every block checkpointed, so the gradients grow through the backward past the forward
DEEP = dict(lora_r=128, checkpointing="full")
# session 37: the deep stack called, the inputs of its first 4 blocks offloaded (a partial offload: the regions of the
# blocks 2 and 3 are "block offloading -2" and "-1"), or one block input in 2 remade (regenerate=2, remade through FSDP2's
# pre-forward function since session 37; none was before)
CHECKPOINTING = {"called_deep_offload4": dict(offload=4), "called_deep_remade": dict(regenerate=2),
                 "called_long_remade": dict(regenerate=2), "iterated_long_remade": dict(regenerate=2),
                 "called_long_remade3": dict(regenerate=3)}
# the long stacks: 8 checkpointed blocks, LoRA r=4: the block inputs, not the gradients, make the peak (session 37)
LONG = dict(lora_r=4, checkpointing="full")


def _setting(name: str) -> dict[str, Any]:
    return DEEP if "_deep" in name else LONG if "_long" in name else dict(lora_r=4, checkpointing="none")


def _callbacks_of(name: str) -> list[Any]:
    """The callbacks that change the model: LoRA and, for the deep stacks, ``ActivationCheckpointing``."""
    from lightning_hbm import ActivationCheckpointing
    from lightning_hbm.adapters.lora import LoRA

    setting = _setting(name)
    checkpointing = [] if setting["checkpointing"] == "none" else [
        ActivationCheckpointing(policy=setting["checkpointing"], **CHECKPOINTING.get(name, {}))]
    return [LoRA(r=setting["lora_r"], alpha=8, dropout=0.0), *checkpointing]


def _fit(name: str, out: Path) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    callbacks, model = _callbacks_of(name), MODELS[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = fit_profiled(model, [*callbacks, profiler_for(out, name)], out, name)
    record["warnings"] = [str(w.message) for w in caught if "lightning_hbm" in str(w.message)]
    remade = next((c.remade for c in callbacks if getattr(c, "regenerate", 1) > 1), None)
    record["unmatched"] = sorted(remade.unmatched) if remade is not None else []
    record["made"] = sorted(remade.made) if remade is not None else []
    record["inputs_remade"] = remade.inputs if remade is not None else 0  # in the last step's backward
    # this rank's shard of the trained weights after the epoch: regenerate=2 against regenerate=1, bit for bit
    trained = {n: p.detach().to_local() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(trained, out / f"{name}.rank{dist.get_rank()}.pt")
    return record


# session 38: ``regenerate=n`` with the blocks inside larger FSDP2 units, the user's (``shard_modules``): two blocks per
# unit (``Pair``), or one unit around the whole stack; (model, shard_modules, regenerate)
IN_UNITS = {"pairs_remade3": ("pairs", ["Pair"], 3), "pairs_remade2": ("pairs", ["Pair"], 2),
            "stack_remade3": ("stack", ["Sequential"], 3)}


def _fit_in_units(name: str, out: Path) -> dict[str, Any]:
    """Two steps of the 8-block stack (LoRA r=4, every block checkpointed, ``regenerate=n``) with the user's units."""
    import warnings

    import lightning.pytorch as pl

    from lightning_hbm import ActivationCheckpointing, QuantizedFSDPStrategy, QuantizedPrecision
    from lightning_hbm.adapters.lora import LoRA

    layout, shard_modules, regenerate = IN_UNITS[name]
    checkpointing = ActivationCheckpointing(blocks=["Block"], regenerate=regenerate)
    said: list[str] = []

    class SaidBeforeTraining(pl.Callback):
        """Holds the lightning_hbm warnings given before the first training batch (fit start: the units exist)."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            said.extend(str(w.message) for w in caught if "lightning_hbm" in str(w.message))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = SaidBeforeTraining()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=QuantizedFSDPStrategy(shard_modules=shard_modules), max_epochs=1,
            limit_train_batches=2, logger=False, plugins=[QuantizedPrecision("nf4", dtype="float32")],
            callbacks=[LoRA(r=4, alpha=8, dropout=0.0), checkpointing, probe], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            use_distributed_sampler=False, default_root_dir=str(out / name),
        )  # fmt: skip
        trainer.fit(_sequential_stack(depth=8, pairs=layout == "pairs"), datamodule=_datamodule(2))
    remade = checkpointing.remade
    return {"said_at_start": said, "warnings": [str(w.message) for w in caught if "lightning_hbm" in str(w.message)],
            "made": sorted(remade.made), "kept": sorted(remade.kept), "unmatched": sorted(remade.unmatched)}


def worker(out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    record = {name: _fit(name, out) for name in MODELS}
    record.update({name: _fit_in_units(name, out) for name in IN_UNITS})
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_script_on_two_ranks(__file__, tmp_path_factory.mktemp("fsdp_sequential_blocks"), timeout=300)




def _planned(name: str) -> Any:
    from lightning_hbm import QuantizedPrecision
    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.planner import Candidate, predict

    batch = synthetic_batch(GLOBAL_BATCH // 2, DATA["seq_len"])  # what one rank computes on
    candidate = Candidate.from_trainer(QuantizedPrecision("nf4", dtype="float32"), _callbacks_of(name)) if (
        name in CHECKPOINTING) else Candidate("nf4", "float32", **_setting(name))
    return predict(MODELS[name], batch, candidate)


def _units(name: str) -> list[str]:
    depth = 6 if "_deep" in name else 8 if "_long" in name else 2
    return sorted(["blocks", *(f"blocks.{i}" for i in range(depth)), "embed", "lm_head", "norm"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_per_rank_plan_of_blocks_in_a_sequential(two_rank_run: Path, name: str) -> None:
    """The planned per-rank step peak within 0.1 % of the measured one (4 B under or less, Dec 6 2026: called 3,111,212
    planned for 3,111,216 measured, iterated 2,950,444 for 2,950,448, called_deep 14,252,908 for 14,252,912,
    iterated_deep 16,737,132 for 16,737,136). Before session 35: called planned 2,805,056 (-9.8 %: the stack one unit,
    the blocks planned as roots); iterated did not fit (the stack's unit never gathered); with the units right,
    called_deep 15,693,676 (+10.1 %) and iterated_deep 14,771,052 (-11.7 %): the backward's gradients counted whole.
    called_deep_offload4 (session 37): 14,515,052 for 14,515,056 measured; 14,646,124 before (+0.90 %: the gradients of
    the blocks done left as traced in the regions "block offloading -2" and "-1", the rank's peak then in the backward
    of block 1 with one block's gradient shard too many)."""
    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0][name]["units"] == ranks[1][name]["units"] == _units(name)  # each block a unit, as the plan has it
    measured = measured_peak(two_rank_run, name)
    prediction = _planned(name)
    planned = sum(prediction.per_rank(2).values())
    print(name, "measured", measured, "planned", planned, f"{(planned - measured) / measured:+.4%}")
    assert plan_matches(prediction, measured)  # the rooted ones: one block more accepted (see plan_matches)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["called_deep", "called_long", "iterated_long"])
def test_remade_inputs_under_fsdp2(two_rank_run: Path, name: str) -> None:
    """``ActivationCheckpointing(regenerate=2)`` under ``QuantizedFSDPStrategy`` remakes one block input in two (session
    37): the link to the block before goes through the function FSDP2 hands each unit its input by (the same data),
    and the block run again in the backward is gathered first. Every block after the first is linked (none unmatched:
    before, blocks 1 to 5 all were), blocks 1, 3, 5 (, 7) remake theirs in the last step's backward, the fit does not
    warn, each rank's trained weights after the epoch are those of ``regenerate=1`` bit for bit, and the plan is the
    rank's (Dec 6 2026: called_deep 14,252,908 planned for 14,252,912 measured, the peak late in the backward as with
    regenerate=1; called_long, eight blocks with LoRA r=4 whose inputs make the peak, 3,704,972 for 3,704,976 against
    regenerate=1's 4,098,192: -393,216 B, three block inputs of 131,072 B; iterated_long, each block an FSDP2 root of
    its own, gathered for the remake and resharded after it, 3,544,204 for 3,544,208 against 3,937,424). Before, no
    input was remade (every block after the first "unmatched") and ``per_rank`` refused the plan."""
    remade = f"{name}_remade"
    depth = 6 if name == "called_deep" else 8
    for rank in (0, 1):
        record = json.loads((two_rank_run / f"rank{rank}.json").read_text())[remade]
        assert record["unmatched"] == [], record["unmatched"]
        assert record["made"] == [f"blocks.{i}" for i in range(1, depth, 2)]
        assert record["inputs_remade"] == depth // 2
        assert not [w for w in record["warnings"] if "regenerate" in w], record["warnings"]
        once, twice = (torch.load(two_rank_run / f"{n}.rank{rank}.pt") for n in (name, remade))
        assert once.keys() == twice.keys() and all(torch.equal(once[k], twice[k]) for k in once)
    measured = measured_peak(two_rank_run, remade)
    assert plan_matches(_planned(remade), measured)
    if name != "called_deep":  # the inputs make the peak: one in two not kept
        assert measured_peak(two_rank_run, name) - measured == 3 * 4 * DATA["seq_len"] * HIDDEN * 4


@pytest.mark.slow
def test_inputs_remade_from_remade_ones_under_fsdp2(two_rank_run: Path) -> None:
    """``regenerate=3``: a remade input made from one remade in turn (two units gathered, one inside the other's remake)
    under FSDP2: blocks 1, 2, 4, 5, 7 remake theirs (seven remakes in the backward: blocks 2 and 5, the third of their unit, twice),
    the trained weights are ``regenerate=1``'s bit for bit, and the plan is the rank's (Dec 6 2026: 3,573,900 planned for
    3,573,904 measured, against 4,098,192 with regenerate=1 and 3,704,976 with 2)."""
    for rank in (0, 1):
        record = json.loads((two_rank_run / f"rank{rank}.json").read_text())["called_long_remade3"]
        assert record["unmatched"] == [] and record["made"] == [f"blocks.{i}" for i in (1, 2, 4, 5, 7)]
        assert record["inputs_remade"] == 7
        once, thrice = (torch.load(two_rank_run / f"{n}.rank{rank}.pt") for n in ("called_long", "called_long_remade3"))
        assert all(torch.equal(once[k], thrice[k]) for k in once)
    measured = measured_peak(two_rank_run, "called_long_remade3")
    assert measured < measured_peak(two_rank_run, "called_long_remade")
    assert plan_matches(_planned("called_long_remade3"), measured)


@pytest.mark.slow
def test_remade_inputs_in_the_users_units_said_at_fit_start(two_rank_run: Path) -> None:
    """``regenerate=n`` with the user's FSDP2 units (session 38): the 8-block stack held as four ``Pair`` modules of two
    blocks, ``shard_modules=["Pair"]``. FSDP2 hands each pair its input through the pair's pre-forward function, and
    the block before (the last of the pair before) is no unit of its own (the remake could not gather it), so the first
    block of pairs 1 to 3 keeps its input and starts a new chain: with ``regenerate=3``, 4 of 8 inputs kept where 3
    would be. Said at fit start (before the first batch), naming FSDP2, the blocks, their units, the count and the fix
    (``regenerate=2``: the pairs' first blocks keep theirs anyway); not said again after the first step. Before session
    38 it was said only after the first step, as blocks "fed something else" (FSDP2 unnamed). With ``regenerate=2``
    nothing is lost (4 kept as with every block linked): no warning at all (before: the same warning after the step).
    One unit around the whole stack: the blocks feed each other directly, every input linked, nothing said."""
    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in ranks:  # what each rank's callback did: the first block of pairs 1 to 3 keeps its input
        assert record["pairs_remade3"]["unmatched"] == ["blocks.1.a", "blocks.2.a", "blocks.3.a"]
        assert record["pairs_remade3"]["made"] == [f"blocks.{i}.b" for i in range(4)]
        assert record["stack_remade3"]["unmatched"] == []
        assert record["stack_remade3"]["made"] == [f"blocks.{i}" for i in (1, 2, 4, 5, 7)]
    said = [w for w in ranks[0]["pairs_remade3"]["said_at_start"] if "regenerate" in w]
    assert len(said) == 1, ranks[0]["pairs_remade3"]["said_at_start"]
    for words in ("under FSDP2", "blocks.1.a (in unit blocks.1, fed by blocks.0.b, in unit blocks.0)",
                  "4 of 8 block inputs kept, where 3 would be with every block linked", "shard_modules=['Block']",
                  "or regenerate=2"):
        assert words in said[0], said[0]
    assert [w for w in ranks[0]["pairs_remade3"]["warnings"] if "regenerate" in w] == said  # not again after the step
    for quiet in ("pairs_remade2", "stack_remade3"):
        assert not [w for w in ranks[0][quiet]["warnings"] if "regenerate" in w], ranks[0][quiet]["warnings"]


def test_regions_of_offloading_and_remade_blocks() -> None:
    """The block a region names, as the planner names it: from the start, from the end, by units of ``regenerate=n``
    blocks, by the offloading part of a partial offload; the gradients of the blocks done follow it (``block
    offloading -2`` of six blocks keeping from the fifth is block 2: three done)."""
    from lightning_hbm.planner.api import fsdp2_gathered_bytes, fsdp2_gradient_bytes
    from lightning_hbm.planner.peaks import block_index

    names = ["block 0", "block 1", "block -1", "block -3", "after block 0", "block stages.1.layers.1", "unit lm_head"]
    assert [block_index(name, 6) for name in names] == [0, 1, 5, 3, None, None, None]
    remade = [f"block {b} of unit {u}" for u in (0, 1, -1) for b in (0, 1)]
    assert [block_index(name, 6, unit=2) for name in remade] == [0, 1, 2, 3, 4, 5]
    assert [block_index(f"block {b} of unit -1", 7, unit=2) for b in (0, 1)] == [6, 7]  # 4 units, the last of 1 block
    offloading = ["block offloading -1", "block offloading -2", "block 1", "block -2"]
    assert [block_index(name, 6, kept_from=4) for name in offloading] == [3, 2, 1, 4]
    assert block_index("block offloading -1", 6) is None  # no partial offload: not a name it gives
    g = 1000
    assert fsdp2_gradient_bytes("backward", "block offloading -2", g, 6, 2, kept_from=4) == 3 * 500 - 1000
    assert fsdp2_gradient_bytes("backward", "block 1 of unit 0", g, 6, 2, unit=2) == 4 * 500 - 1000
    assert fsdp2_gathered_bytes("backward", "block 0 of unit 0", 10, 100) == 110  # the last: nothing to prefetch
    prediction = _planned("called_deep_offload4")
    assert prediction.kept_from == 4 and prediction.remade_unit == 1
    assert {"block offloading -1", "block offloading -2"} <= set(prediction.regions["backward (offloaded blocks)"])
    assert _planned("called_deep_remade").remade_unit == 2


def test_blocks_in_a_sequential_are_units() -> None:
    """The strategy's default units: each block of the ``nn.Sequential`` (innermost first), not the stack whole; the
    stack (the unit around them) and the other children are the remainder units."""
    from lightning_hbm.strategies.fsdp_qlora import _choose_units, remainder_units, sequential_blocks

    model = _called()
    units = _choose_units(model, None)
    assert units == [model.blocks[0], model.blocks[1]]
    assert [name for name, _ in sequential_blocks(model)] == ["blocks.0", "blocks.1"]
    assert [name for name, _ in remainder_units(model, units)] == ["embed", "blocks", "norm", "lm_head"]


def test_plan_of_blocks_in_a_sequential() -> None:
    """Called, the stack is the unit around the blocks (not rooted, not a unit apart) and the last block's backward is
    its own region ("block 1", where the rank peaks); iterated, each block is a root of its own."""
    called = _planned("called")
    assert not called.rooted_blocks and called.remainder_bytes == 0
    assert called.units == {"embed": 256 * HIDDEN, "norm": 2 * HIDDEN * 4, "lm_head": 256 * HIDDEN * 4}
    backward = called.regions["backward"]
    assert "after block -1" not in backward and max(backward, key=backward.__getitem__) == "block 1"
    assert _planned("iterated").rooted_blocks


def test_gradients_of_the_blocks_done_per_rank() -> None:
    """In a block's backward region, with k blocks done after it (k gradients whole in the trace): k shards and one
    whole reduce-scatter input under a unit around the blocks; k shards and k whole inputs, each block a root."""
    from lightning_hbm.planner.api import fsdp2_gradient_bytes

    g = 1000
    assert fsdp2_gradient_bytes("backward", "block -1", g, 6, 2) == 0  # the first block of the backward: none done
    assert fsdp2_gradient_bytes("backward", "block -2", g, 6, 2) == 500 - 1000  # one shard and its input: more
    assert fsdp2_gradient_bytes("backward", "block 0", g, 6, 2) == 5 * 500 - 1000
    assert fsdp2_gradient_bytes("backward", "block 1", g, 6, 2) == 4 * 500 - 1000
    assert fsdp2_gradient_bytes("backward", "block 0", g, 6, 2, rooted_blocks=True) == -5 * 500
    assert fsdp2_gradient_bytes("forward", "block 0", g, 6, 2) == fsdp2_gradient_bytes("backward", "unit lm_head", g, 6, 2) == 0
    assert _planned("called_deep").block_gradient_bytes == 4 * 128 * (256 + 512) * 2  # LoRA A and B of up and down


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        worker(Path(sys.argv[2]))
