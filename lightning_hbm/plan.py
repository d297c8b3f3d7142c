"""``python -m lightning_hbm.plan --config my.yaml --budget 24GiB``: print the memory plan of a LightningCLI config.

Reads the ``model`` and ``data`` sections of a LightningCLI YAML (``class_path`` + ``init_args``), builds
the model under ``FakeTensorMode`` (nothing allocated, an 8B model plans on a laptop), takes one batch
from the datamodule (or a synthetic token batch with ``--batch-size``/``--seq-len``), and prints the
table of candidates (rich) and the YAML snippet of the chosen one. Exit status 0 when a candidate fits
(or no budget was given), 2 when none fits.

The CLI of :mod:`lightning_hbm` (``lightning-hbm plan``) calls :func:`plan_from_config` and :func:`main`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl

from lightning_hbm import planner
from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner import LIGHTNING_PRECISIONS, Plan, default_candidates, format_bytes


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
    candidates: Optional[Sequence[planner.Candidate]] = None,
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
        vocab = int(model_args.get("vocab_size", 256))
        batch = synthetic_batch(batch_size or 8, seq_len or 256, vocab_size=vocab)
    if candidates is None:
        precision = str((config.get("trainer") or {}).get("precision", "bf16-true"))
        precision = precision if precision in LIGHTNING_PRECISIONS else "bf16-true"
        candidates = default_candidates(precisions=(precision, "nf4-dq"))
    return planner.plan(factory, batch, budget=budget, candidates=candidates, device=device)  # type: ignore[arg-type]


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
    for candidate, reason in result.failures:
        print(f"(not planned: {candidate.name}: {reason})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hbm.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="LightningCLI YAML with model (and data) sections")
    parser.add_argument("--budget", default=None, help="device memory to fit in, e.g. 24GiB")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where training will run")
    parser.add_argument("--batch-size", type=int, default=None, help="synthetic batch instead of the datamodule's")
    parser.add_argument("--seq-len", type=int, default=None, help="synthetic sequence length")
    parser.add_argument("--precisions", nargs="+", default=None, help="default: the config's and nf4-dq")
    parser.add_argument("--lora-ranks", nargs="+", type=int, default=[0, 16])
    parser.add_argument("--checkpointing", nargs="+", default=["none", "selective", "full"])
    parser.add_argument("--optimizers", nargs="+", default=["user", "adamw8bit"])
    args = parser.parse_args(argv)
    import yaml

    with open(args.config) as file:
        config = yaml.safe_load(file) or {}
    precision = str((config.get("trainer") or {}).get("precision", "bf16-true"))
    precisions = args.precisions or [precision if precision in LIGHTNING_PRECISIONS else "bf16-true", "nf4-dq"]
    candidates = default_candidates(precisions, args.lora_ranks, args.checkpointing, args.optimizers)
    result = plan_from_config(config, args.budget, args.device, args.batch_size, args.seq_len, candidates)
    print_plan(result)
    return 0 if result.budget is None or result.chosen is not None else 2


class _CallablePlanModule(types.ModuleType):
    """``lightning_hbm.plan`` is both this module and the function :func:`lightning_hbm.planner.plan`.

    Importing a submodule rebinds the package attribute of the same name to the module, which would
    shadow the exported ``lightning_hbm.plan(...)`` function: calling the module calls the function.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return planner.plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePlanModule

if __name__ == "__main__":
    raise SystemExit(main())
