"""Planning a LightningCLI configuration: what ``lightning-hbm plan`` (alias ``python -m lightning_hbm.planner``) runs.

:func:`plan_from_config` reads the ``model`` and ``data`` sections (``class_path`` + ``init_args``),
builds the model under ``FakeTensorMode`` (nothing allocated: an 8B model plans on a laptop), takes one
batch from the datamodule (or a synthetic token batch with ``batch_size``/``seq_len``) and plans it;
:func:`print_plan` prints the table (rich) and the YAML snippet of the chosen candidate. The command line
itself (parsing, overrides, exit status 2 when nothing fits) is ``lightning_hbm.cli.PlanCLI``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence, cast

import lightning.pytorch as pl

from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner.api import Plan, plan
from lightning_hbm.planner.candidates import PLANNED_LIGHTNING_PRECISIONS, Candidate, default_candidates, format_bytes
from lightning_hbm.planner.context import ContextResult, max_context
from lightning_hbm.planner.realvalues import MAX_TWIN_ELEMENTS


def _class(path: str, section: str) -> type:
    module_name, _, name = path.rpartition(".")
    if not module_name:
        module_name, name = "lightning_hbm.models", path  # short names: the package's own test models
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{section}.class_path {path!r} cannot be imported ({err}). Use 'package.module.Class'.") from err


def _section(config: dict[str, Any], name: str) -> Optional[tuple[type, dict[str, Any]]]:
    section = config.get(name)
    if section is None:
        return None
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(f"The config's {name!r} section needs a class_path (and optional init_args), got {section!r}.")
    return _class(section["class_path"], name), dict(section.get("init_args") or {})


def plan_from_config(
    config: dict[str, Any],
    budget: Optional[str] = None,
    device: str = "cpu",
    batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    candidates: Optional[Sequence[Candidate]] = None,
) -> Plan:
    """Plan a LightningCLI config dict (``model``/``data``/``trainer`` sections), allocating no weights."""
    model_section = _section(config, "model")
    if model_section is None:
        raise ValueError("The config has no 'model' section (model: {class_path: ..., init_args: {...}}).")
    model_cls, model_args = model_section
    factory: Callable[[], pl.LightningModule] = lambda: model_cls(**model_args)  # noqa: E731  (built fake)
    data_section = _section(config, "data")
    if data_section is not None and batch_size is None and seq_len is None:
        data_cls, data_args = data_section
        batch: Any = data_cls(**data_args)
    else:
        batch = _synthetic_batch(8 if batch_size is None else batch_size, 256 if seq_len is None else seq_len, model_args)
    if candidates is None:
        precision = str((config.get("trainer") or {}).get("precision", "bf16-true"))
        precision = precision if precision in PLANNED_LIGHTNING_PRECISIONS else "bf16-true"
        candidates = default_candidates(precisions=(precision, "nf4-dq"))
    return plan(factory, batch, budget=budget, candidates=candidates, device=device)  # type: ignore[arg-type]


def _synthetic_batch(batch_size: int, seq_len: int, model_args: dict[str, Any]) -> Any:
    """The token batch to plan: sizes checked first (meta, nothing allocated); real only while small enough to be
    its own twin (its values make data-dependent reads exact), shapes only above (batch_size=10**6 plans too)."""
    vocab = int(model_args.get("vocab_size", 256))
    batch = synthetic_batch(batch_size, seq_len, vocab_size=vocab, device="meta")
    if batch_size * (seq_len + 1) <= MAX_TWIN_ELEMENTS:
        batch = synthetic_batch(batch_size, seq_len, vocab_size=vocab)
    return batch


def print_plan(result: Plan) -> None:
    """The table (rich when available) and the YAML of the chosen candidate, on stdout."""
    try:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # piped: do not squeeze ten columns into 80 characters
            console = Console(width=200)
        console.print(result.table())
    except ImportError:
        print(result)
    chosen = result.chosen
    if chosen is None:
        print(f"Nothing fits {format_bytes(result.budget or 0)}. Closest:")
        for prediction in result.closest(3):
            print(f"  {prediction.candidate.name}: {format_bytes(prediction.total)}")
        return
    print(f"\nChosen: {chosen.candidate.name}, predicted peak {format_bytes(chosen.total)}, step time {chosen.cost:.2f}x")
    print(chosen.candidate.yaml(), end="")
    for note in result.notes():
        print(f"({note})")


def max_context_from_config(
    config: dict[str, Any], budgets: Sequence[str], device: str, plugin: Any = None, callbacks: Sequence[Any] = (),
    strategy: Any = None, host_budget: Optional[str] = None, max_regenerate: int = 1,
) -> list[ContextResult]:
    """:func:`~lightning_hbm.planner.max_context` of a LightningCLI config's model, one result per budget (and the
    ``host_budget`` its offloaded activations may pin, if given; ``max_regenerate``: at most one block input in that
    many kept where the offloaded inputs overflow it).

    The batch size is the data section's ``batch_size`` (1 without one); the trainer section's plugin, callbacks and
    strategy are the fixed configuration (its ``ActivationCheckpointing``/``FusedLoss`` replaced by max_context's).
    """
    model_section = _section(config, "model")
    if model_section is None:
        raise ValueError("The config has no 'model' section (model: {class_path: ..., init_args: {...}}).")
    model_cls, model_args = model_section
    factory: Callable[[], pl.LightningModule] = lambda: model_cls(**model_args)  # noqa: E731  (built fake)
    data = (config.get("data") or {}).get("init_args") or {}
    batch_size = 1 if data.get("batch_size") is None else data["batch_size"]  # none given: one sample
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        # was int(batch_size or 1): a recipe's batch_size 0 was answered for batch 1, 2.5 for 2, with no word
        raise ValueError(
            f"The config's data.init_args.batch_size is {batch_size!r}: the longest context is per sample of a batch "
            "of batch_size samples, so it must be an int >= 1 (e.g. batch_size: 4). Fix the data section."
        )
    results = max_context(factory, list(budgets), plugin=plugin, callbacks=list(callbacks), strategy=strategy,
                          batch_size=batch_size, device=device,  # type: ignore[arg-type]  # "cpu" or "cuda", checked there
                          host_budget=host_budget, max_regenerate=max_regenerate)
    return cast(list[ContextResult], results)


def print_max_context(results: Sequence[ContextResult]) -> None:
    """The longest context per budget as a table: tokens, device total, host RAM needed, offload and the loss chunk
    chosen, what holds it; then what max_context set the same for every budget, and each answer's notes
    (:meth:`~lightning_hbm.planner.context.ContextResult.notes`)."""
    rows = [("budget", "longest context (tokens)", "device total", "host RAM (pinned)", "offload", "loss chunk",
             "what holds it")]
    for r in results:
        rows.append((format_bytes(r.budget), f"{r.tokens:,}", format_bytes(r.prediction.total), format_bytes(r.host),
                     _offload_cell(r.choices.get("offload"), r.choices.get("regenerate")),
                     f"{r.choices.get('loss_chunk_tokens') or '-'}", r.limit))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if results:
        common = {k: v for k, v in results[0].choices.items() if k not in ("offload", "loss_chunk_tokens", "regenerate")}
        print(f"set by max_context: {common} (predicted by the planner, not measured)")
    for r in results:  # what an answer assumes (a MoE model's worst routing load, with its bytes)
        for note in r.notes():
            print(f"({note})")


def _offload_cell(offload: object, regenerate: object = None) -> str:
    """``yes``, ``no``, or ``first k blocks`` (a partial offload a host budget chose); ``, 1 in n kept`` where only one
    block input in ``n`` is kept, the others remade (``--max-regenerate``; chosen per budget)."""
    cell = ("yes" if offload else "no") if isinstance(offload, bool) or offload is None else f"first {offload} blocks"
    return cell + (f", 1 in {regenerate} kept" if isinstance(regenerate, int) and regenerate > 1 else "")


__all__ = ["max_context_from_config", "plan_from_config", "print_max_context", "print_plan"]
