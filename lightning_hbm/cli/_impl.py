"""``lightning-hbm``: Lightning's CLI, with lightning_hbm's names understood everywhere.

What it adds to :class:`~lightning.pytorch.cli.LightningCLI` (nothing is removed):

* ``--trainer.precision nf4-dq`` (``precision: nf4-dq`` in YAML) for every name in
  :func:`lightning_hbm.available_precisions` becomes ``plugins=[QuantizedPrecision("nf4-dq")]``.
  Lightning's own names (``bf16-true``, ``16-mixed``, ``32``, ...) keep working; any other value is
  a ``ValueError`` listing both sets, raised before anything is built.
* Short class names for lightning_hbm's callbacks, strategies and plugins
  (``- class_path: LoRA``): every module of the package is imported, so jsonargparse knows the
  subclasses.
* Defaults needing no download: ``lightning_hbm.models.LlamaLM`` on
  ``lightning_hbm.data.ByteTextDataModule``; any ``--model``/``--data`` class can replace them.
* Two subcommands besides ``fit``/``validate``/``test``/``predict`` (see :func:`main`):
  ``plan`` (the memory planner) and ``report`` (re-render a finished run's profiler report).

Example::

    lightning-hbm fit -c examples/qlora.yaml
    lightning-hbm fit --trainer.precision nf4-dq --trainer.max_steps 20
    lightning-hbm fit -c examples/qlora.yaml --print_config
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import linecache
import os
import pkgutil
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union, cast, get_args

import torch
import yaml  # jsonargparse's own dependency
from jsonargparse import ActionSubCommands, ArgumentParser, Namespace
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

import lightning_hbm
from lightning_hbm._compat import _PRECISION_INPUT_STR
from lightning_hbm.cli import _DESCRIPTION, _EXTRA_SUBCOMMANDS  # shared with the fast top-level --help
from lightning_hbm.display import default_model_summary, default_progress_bar
from lightning_hbm.memory.report import find_report, render_report
from lightning_hbm.naming import did_you_mean
from lightning_hbm.planner import Candidate, default_candidates
from lightning_hbm.planner.candidates import PLANNED_LIGHTNING_PRECISIONS
from lightning_hbm.planner.config import max_context_from_config, plan_from_config, print_max_context, print_plan
from lightning_hbm.precision import QuantizedPrecision, available_precisions
from lightning_hbm.precision.registry import get_format
from lightning_hbm.profiling.figure import redraw
from lightning_hbm.surgery import SurgeryCallback

# Every value Lightning's Trainer accepts for ``precision`` (ints, their string forms, the long names).
LIGHTNING_PRECISIONS: tuple[Union[int, str], ...] = (*get_args(_PRECISION_INPUT_STR), "bf16", "64", "32", "16", 64, 32, 16)

_PACKAGE_DIR = Path(lightning_hbm.__file__).resolve().parent

DEFAULT_MODEL = "lightning_hbm.models.LlamaLM"
DEFAULT_DATA = "lightning_hbm.data.ByteTextDataModule"


def import_all_classes() -> list[str]:
    """Import every module of lightning_hbm, so jsonargparse resolves short class names.

    jsonargparse turns ``class_path: LoRA`` into a class by searching the *imported* subclasses of
    the expected base (``Callback``, ``Strategy``, ``Precision``). Features live in their own
    modules (in the package of their job) and are not all imported by ``lightning_hbm/__init__.py``.
    Returns the module names imported.
    """
    names = []
    for info in pkgutil.walk_packages(lightning_hbm.__path__, prefix="lightning_hbm."):
        if info.name == __name__:
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names


class ConfigError(ValueError):
    """A configuration the CLI cannot parse, said in one line (what is wrong, close matches, what is accepted)."""


class UnknownPrecisionError(ValueError):
    """``trainer.precision`` names neither a lightning_hbm mode nor a Lightning precision."""


def resolve_precision(precision: Optional[Union[int, str]]) -> tuple[Optional[Union[int, str]], Optional[QuantizedPrecision]]:
    """Split a ``trainer.precision`` value into (Lightning's precision, lightning_hbm plugin).

    ``"nf4-dq"`` -> ``(None, QuantizedPrecision("nf4-dq"))``; ``"bf16-true"`` -> ``("bf16-true", None)``.
    Anything else raises a ``ValueError`` that lists both sets of valid names.
    """
    if precision is None:
        return None, None
    if isinstance(precision, str) and precision in available_precisions():
        return None, QuantizedPrecision(precision)
    if precision in LIGHTNING_PRECISIONS:
        return precision, None
    lightning_names = ", ".join(dict.fromkeys(str(p) for p in LIGHTNING_PRECISIONS))  # "32" and 32: once
    hint = did_you_mean(str(precision), [*available_precisions(), *map(str, LIGHTNING_PRECISIONS)])
    raise UnknownPrecisionError(
        f"Unknown trainer.precision {precision!r}.{hint} lightning_hbm's quantized modes: "
        f"{', '.join(available_precisions())} (compute dtype bfloat16; for another dtype use "
        "`plugins: [{class_path: QuantizedPrecision, init_args: {mode: nf4-dq, dtype: float32}}]`). "
        f"Lightning's precisions: {lightning_names}."
    )


class HBMArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose errors are one line with close matches instead of a usage dump.

    jsonargparse's message for ``init_args: {rank: 16}`` is ~45 lines (every Union subtype it tried, the
    usage) with ``Option 'rank' is not accepted`` inside; this parser raises :class:`ConfigError` with
    ``trainer.callbacks: LoRA has no option 'rank'. Did you mean 'r'? ...`` instead. Parsers built
    with ``exit_on_error=False`` (jsonargparse's internal ones, which catch the error) are left alone.
    """

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> Any:
        if not self.exit_on_error:
            return super().error(message, ex)
        raise ConfigError(one_line_error(message, self))

    @override
    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        # jsonargparse's messages name neither the file nor the line: remember which files were read
        _CONFIG_FILES.append((str(path), os.path.abspath(path)))  # absolute: jsonargparse chdirs into its folder
        return super().parse_path(path, *args, **kwargs)


#: ``(as given, absolute)`` of each config file read by the current CLI (:meth:`HBMArgumentParser.parse_path`).
_CONFIG_FILES: list[tuple[str, str]] = []


def one_line_error(message: str, parser: Optional[ArgumentParser] = None) -> str:
    """jsonargparse's multi-line ``message`` as one line: the file and line, the key, what is wrong, close matches,
    what is accepted."""
    if message.startswith("Problems parsing config"):
        return _yaml_syntax_error(message)
    key = re.search(r'Parser key "([^"]+)"', message)
    where = f"{key.group(1)}: " if key else ""
    field = re.search(r"Problem with given class_path '([^']+)':\s*Parser key \"([^\"]+)\":\s*(.+)", message)
    if field:  # a wrong value in init_args: name the class, the field and the line it is on
        class_path, name, reason = field.groups()
        value = re.search(r"Got value: (.+)", reason)
        reason = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", reason.strip())
        reason = re.sub(r"\ba ([aeiou])", r"an \1", reason)
        place = _field_location(key.group(1) if key else "", name, value.group(1).strip() if value else None)
        return f"{place}{where}{class_path.rsplit('.', 1)[-1]} init_args.{name}: {reason}"
    option = re.search(r"Problem with given class_path '([^']+)':\s*Option '([^']+)' is not accepted", message)
    if option:  # a typo in init_args: the class's own parameters are the valid names
        class_path, name = option.groups()
        accepted = _init_parameters(class_path)
        short = class_path.rsplit(".", 1)[-1]
        return f"{where}{short} has no option {name!r}.{did_you_mean(name, accepted)} Its options: {', '.join(accepted)}."
    path = re.search(r"Expected a dot import path string: (\S+)|Import path (\S+) does not correspond", message)
    if path:  # a typo in a short class name
        name = path.group(1) or path.group(2)
        ours = sorted(n for n in lightning_hbm.__all__ if isinstance(getattr(lightning_hbm, n), type))
        return (f"{where}no class named {name!r}.{did_you_mean(name, _known_class_names())} Give a full class path "
                f"(my.module.MyCallback), one of Lightning's or one of lightning_hbm's: {', '.join(ours)}.")  # fmt: skip
    unknown = re.search(r"does not accept option '([^']+)'|Option '([^']+)' is not accepted|Key \"?'?([\w.]+)'?\"? is not expected|unrecognized arguments: (\S+)", message)
    if unknown:  # a top-level key typo (trainer.max_step in YAML)
        name = next(g for g in unknown.groups() if g).lstrip("-").split("=")[0]
        keys = _parser_keys(parser) if parser is not None else []
        return f"{where}unknown option {name!r}.{did_you_mean(name, keys)} See `lightning-hbm fit --help` for every option."
    # anything else: jsonargparse's most specific reason, without the Union subtypes it tried and failed
    lines = [ln.strip().lstrip("- ") for ln in message.splitlines() if ln.strip()]
    noise = r"(Parser key|Does not validate|Subtypes:|Errors:|Given value|Subclass types expect|a class path|a dict |Not a valid subclass|Expected a <class 'NoneType'>|Import path \S+ does not correspond)"
    reasons = [ln for ln in lines if not re.match(noise, ln)]
    return where + (reasons[0] if reasons else lines[0] if lines else message)


def _yaml_syntax_error(message: str) -> str:
    """``Problems parsing config: while parsing ... in "<unicode string>", line 3, column 15 ...`` as
    ``file.yaml:4:1: did not find expected ',' or '}' (while parsing a flow mapping that starts at line 3, column 15)``."""
    body = re.sub(r"^Problems parsing config(?: '[^']*')?:\s*", "", message).split("\n")
    mark = r'\s*in "[^"]*", line (\d+), column (\d+)'
    texts = [ln.strip() for ln in body if ln.strip() and not re.match(mark, ln)]
    marks = [re.match(mark, ln).groups() for ln in body if re.match(mark, ln)]  # type: ignore[union-attr]
    name = _CONFIG_FILES[-1][0] if _CONFIG_FILES else "the config"  # the file being read when parsing failed
    if not marks:
        return f"{name}: {' '.join(texts) or message}"
    line, column = marks[-1]  # the problem's mark comes last; the first is where the enclosing context starts
    problem = texts[-1] if texts else "cannot be read"
    context = f" ({texts[0]} that starts at line {marks[0][0]}, column {marks[0][1]})" if len(texts) > 1 and len(marks) > 1 else ""
    return f"{name}:{line}:{column}: {problem}{context}. Fix the YAML syntax there."


def _field_location(section: str, name: str, value: Optional[str]) -> str:
    """``"file.yaml:6: "``: where key ``name`` (given ``value``) sits under ``section`` in a config file read, or ``""``."""

    for shown, path in reversed(_CONFIG_FILES):
        try:
            with open(path) as handle:
                root = yaml.compose(handle)
        except (OSError, yaml.YAMLError):
            continue
        node = root
        for part in section.split(".") if section else []:  # down to the section, e.g. trainer -> callbacks
            children = dict((k.value, v) for k, v in node.value) if isinstance(node, yaml.MappingNode) else {}
            node = children.get(part, node)
        found = _find_key(node, name, value) or _find_key(node, name, None)
        if found is not None:
            return f"{shown}:{found.start_mark.line + 1}: "
    return ""


def _find_key(node: Any, name: str, value: Optional[str]) -> Any:
    """The first key node ``name`` (whose scalar value is ``value``, unless None) in the YAML tree under ``node``."""

    if isinstance(node, yaml.MappingNode):
        for key, child in node.value:
            if key.value == name and (value is None or (isinstance(child, yaml.ScalarNode) and child.value == value)):
                return key
    children = node.value if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) else []
    for child in children:
        for item in child if isinstance(child, tuple) else (child,):
            found = _find_key(item, name, value)
            if found is not None:
                return found
    return None


def _init_parameters(class_path: str) -> list[str]:
    try:
        module, name = class_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _known_class_names() -> list[str]:
    """Short names of the imported callbacks, strategies, plugins, modules and datamodules (what ``class_path`` takes)."""
    classes = _subclasses(Callback, Precision, Strategy, LightningModule, LightningDataModule)
    return list(dict.fromkeys(c.__name__ for c in classes if not c.__name__.startswith("_")))


def _subclasses(*bases: type) -> list[type]:
    found: list[type] = []
    stack = list(bases)
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def _is_precision_plugin(class_path: str) -> bool:
    known = {c.__name__: c for c in _subclasses(Precision)}
    if class_path in known:
        return True
    try:
        module, name = class_path.rsplit(".", 1)
        return issubclass(getattr(importlib.import_module(module), name), Precision)
    except (ImportError, AttributeError, ValueError, TypeError):
        return False


def _parser_keys(parser: ArgumentParser) -> list[str]:
    """Every option key the parser (and its subcommands' parsers) knows: ``trainer.max_steps``, ``model``, ..."""
    keys: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                keys += _parser_keys(sub)
        elif action.dest not in ("help", "config", argparse.SUPPRESS):
            keys.append(action.dest)
    return keys


class HBMCLI(LightningCLI):
    """``LightningCLI`` that accepts lightning_hbm precision names and short class names.

    Args:
        model_class, datamodule_class: as in ``LightningCLI``; ``None`` (the default) accepts any
            ``LightningModule``/``LightningDataModule`` by class path and defaults to
            ``LlamaLM``/``ByteTextDataModule``.
        **kwargs: every other ``LightningCLI`` argument (``args``, ``run``, ``trainer_defaults``, ...).

    It logs nothing itself; what is logged comes from the model and the callbacks configured.

    Example::

        HBMCLI(args=["fit", "--trainer.precision", "nf4-dq", "--trainer.max_steps", "10"])
    """

    def __init__(self, model_class: Any = None, datamodule_class: Any = None, **kwargs: Any) -> None:
        import_all_classes()
        _CONFIG_FILES.clear()  # error messages name this run's config files only
        kwargs.setdefault("parser_class", HBMArgumentParser)
        self._quantized_precision: Optional[QuantizedPrecision] = None
        parser_kwargs = kwargs.setdefault("parser_kwargs", {})
        parser_kwargs.setdefault("description", _DESCRIPTION)
        super().__init__(model_class=model_class, datamodule_class=datamodule_class, **kwargs)

    @override
    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Lightning's core arguments, with ``trainer.precision`` widened to any name (checked later)."""
        # Same as LightningCLI's, except that Trainer's Literal type for `precision` would reject
        # "nf4-dq" while parsing: the argument is re-added as a plain value, validated by
        # resolve_precision before anything is instantiated.
        parser.add_class_arguments(
            self.trainer_class, "trainer", fail_untyped=False, instantiate=False, sub_configs=True, skip={"precision"}
        )
        parser.add_argument(
            "--trainer.precision",
            type=Optional[Union[int, str]],
            default=None,
            help=f"Lightning's precision ({', '.join(dict.fromkeys(map(str, LIGHTNING_PRECISIONS)))}) or a lightning_hbm "
            f"quantized mode ({', '.join(available_precisions())}).",
        )
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(
            self._datamodule_class, "data", subclass_mode=self.subclass_mode_data, required=self.datamodule_class is not None
        )
        if self.model_class is None:
            parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})
        if self.datamodule_class is None:
            parser.set_defaults({"data": {"class_path": DEFAULT_DATA}})

    @override
    def before_instantiate_classes(self) -> None:
        """Validate ``trainer.precision`` (and build its plugin) before any class is instantiated."""
        trainer_config = self._get(self.config, "trainer")
        precision = trainer_config.get("precision")
        _, self._quantized_precision = resolve_precision(precision)
        for plugin in _as_list(trainer_config.get("plugins")):
            class_path = plugin.get("class_path") if isinstance(plugin, (dict, Namespace)) else plugin  # a config entry, or a name
            if not isinstance(class_path, str) or not _is_precision_plugin(class_path):
                continue
            if precision is not None:  # Lightning would raise a MisconfigurationException from deep inside Trainer
                raise ConfigError(
                    f"trainer.precision={precision!r} and the plugin {class_path.rsplit('.', 1)[-1]} both set the precision: keep one. "
                    "For a quantized mode with another compute dtype drop `precision` and give the plugin "
                    "`init_args: {mode: nf4-dq, dtype: float32}`; otherwise drop the plugin."
                )
            if class_path.rsplit(".", 1)[-1] == "QuantizedPrecision":  # checked here: jsonargparse would bury it in 60 lines
                get_format(plugin.get("init_args", {}).get("mode", "nf4-dq"))

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, with a lightning_hbm precision name turned into its plugin.

        Lightning's default progress bar and model summary are replaced by :mod:`lightning_hbm.display`'s (no
        "Epoch 0/-2" when only ``max_steps`` is set, a resumed bar's right total, 4-bit weights counted
        unpacked, no FLOPs column of zeros); a progress bar or model summary you configure is kept as it is.
        """
        config = self._get(self.config_init, "trainer")
        if self._quantized_precision is not None:
            kwargs["plugins"] = [*_as_list(config.get("plugins")), self._quantized_precision]
            kwargs["precision"] = None
        quiet = _quiet_console_callbacks(config)
        if quiet:
            kwargs["callbacks"] = [*_as_list(config.get("callbacks")), *quiet]
        if any(isinstance(c, ModelSummary) for c in quiet):
            # the callback runs either way; the flag only stops Lightning from adding (and announcing) its own
            kwargs["enable_model_summary"] = False
        return super().instantiate_trainer(**kwargs)

    @override
    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """Lightning's subcommands, plus ``plan`` and ``report`` listed in ``--help`` (:func:`main` runs them)."""
        super()._add_subcommands(parser, **kwargs)
        for name, description in _EXTRA_SUBCOMMANDS.items():
            sub = LightningArgumentParser(description=f"{description} See `lightning-hbm {name} --help`.")
            cast(ActionSubCommands, parser._subcommands_action).add_subcommand(name, sub, help=description)  # set by super()


def _instantiate(value: Any) -> Any:
    """A ``{class_path, init_args}`` entry of the config as the object fit would build (other values unchanged)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if not isinstance(value, dict) or "class_path" not in value:
        return value
    module, _, name = value["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module or "lightning_hbm"), name)
    return cls(**(value.get("init_args") or {}))


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _quiet_console_callbacks(config: dict[str, Any]) -> list[Any]:
    """lightning_hbm's progress bar / model summary (:mod:`lightning_hbm.display`), where Lightning would add its own
    defaults: a CLI run without any lightning_hbm plugin or callback gets them too."""
    callbacks = _as_list(config.get("callbacks"))
    quiet: list[Any] = []
    if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
        quiet.append(default_progress_bar())
    if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in callbacks):
        quiet.append(default_model_summary())
    return quiet


class PlanCLI(HBMCLI):
    """``lightning-hbm plan``: the same model/data configuration as ``fit``, planned, not trained.

    Parsing is ``fit``'s (config files, overrides, defaults, short names); the planning is the planner
    engineer's :func:`lightning_hbm.planner.config.plan_from_config`: the model is built under
    ``FakeTensorMode`` (nothing allocated), each candidate is traced for two steps on the
    datamodule's first batch. ``--budget`` picks the fastest candidate that fits.

    Args: those of :class:`HBMCLI` (use ``run=False``). Logs nothing; :attr:`plan` holds the
    :class:`~lightning_hbm.planner.Plan`.

    Example::

        PlanCLI(args=["-c", "examples/qlora.yaml", "--budget", "24GiB"], run=False).plan.chosen

    ``--max-context`` (with ``--budget``, several sizes comma-separated: ``--budget 24GiB,48GiB``): the longest
    sequence per sample that fits each budget with the recipe's precision and adapters
    (:func:`lightning_hbm.planner.max_context`); :attr:`contexts` holds the results. ``--host-budget 64GiB``: the
    host RAM its offloaded activations may pin. ``--max-regenerate n`` (with ``--host-budget``): where the offloaded
    inputs overflow the host, only one block input in at most ``n`` is kept, the others remade in the backward
    (``ActivationCheckpointing(regenerate=...)``: ``(n-1)/2`` more block forwards per block; default 1, off).
    """

    def __init__(self, *args: Any, max_context: bool = False, **kwargs: Any) -> None:
        self.max_context = max_context
        self.contexts: list[Any] = []
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """The planner's arguments, next to the usual ``trainer``/``model``/``data`` groups."""
        parser.add_argument("--budget", type=Optional[str], default=None, help="device memory to fit in, e.g. 24GiB")
        parser.add_argument(
            "--host-budget", type=Optional[str], default=None,
            help="with --max-context: host RAM the offloaded activations may pin, e.g. 64GiB (default: no limit)",
        )
        parser.add_argument(
            "--max-regenerate", type=int, default=1,
            help="with --max-context and --host-budget: keep one block input in at most n where the offloaded inputs "
                 "overflow the host, the others remade in the backward ((n-1)/2 more block forwards per block; default 1: off)",
        )
        parser.add_argument(
            "--device", type=Optional[Literal["cpu", "cuda"]], default=None, help="where training runs (default: cuda if available)"
        )
        # the candidate grid: default_candidates' own arguments, so its defaults stay in one place
        parser.add_function_arguments(default_candidates, "candidates")

    @override
    def instantiate_classes(self) -> None:
        """Plan instead of building: the model is only ever built fake, inside the planner."""
        self.model, self.datamodule, self.trainer = None, None, None  # type: ignore[assignment]  # plan builds no Trainer: LightningCLI declares it set
        config = {"model": self.config.model.as_dict(), "data": self.config.data.as_dict()}
        device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        regenerate = _checked_regenerate(self.config.max_regenerate, self.max_context, self.config.host_budget)
        if self.max_context:
            if not self.config.budget:
                raise ValueError("lightning-hbm plan --max-context needs --budget, e.g. --budget 24GiB (or 24GiB,48GiB).")
            budgets = [b.strip() for b in str(self.config.budget).split(",") if b.strip()]
            plugin, callbacks, strategy = self._trainer_objects()
            self.contexts = max_context_from_config(config, budgets, device, plugin, callbacks, strategy,
                                                    host_budget=self.config.host_budget, max_regenerate=regenerate)
            return
        configured = self._configured_candidate()
        # a trainer section that sets a lightning_hbm plugin, callback or strategy is what fit would run: planned alone
        candidates = [configured] if configured is not None else default_candidates(**self.config.candidates.as_dict())
        self.plan = plan_from_config(config, self.config.budget, device, candidates=candidates)

    def _trainer_objects(self) -> tuple[Any, list[Any], Any]:
        """The trainer section's precision plugin (or None), callbacks and strategy, built."""
        trainer = self._get(self.config, "trainer")
        plugins = [_instantiate(p) for p in _as_list(trainer.get("plugins"))]
        callbacks = [_instantiate(c) for c in _as_list(trainer.get("callbacks"))]
        strategy = trainer.get("strategy")
        plugin = self._quantized_precision or next((p for p in plugins if isinstance(p, Precision)), None)
        precision = trainer.get("precision")
        if plugin is None and precision is not None and str(precision) in PLANNED_LIGHTNING_PRECISIONS:
            plugin = Candidate(str(precision)).precision_plugin()
        return plugin, callbacks, strategy

    def _configured_candidate(self) -> Any:
        """The trainer section's precision/plugins, lightning_hbm callbacks and strategy as one candidate, or None."""
        plugin, callbacks, strategy = self._trainer_objects()
        if any(type(c).__name__ == "AutoFit" for c in callbacks):
            return None  # AutoFit chooses among the grid at fit: plan the grid
        if plugin is None and not any(isinstance(c, SurgeryCallback) for c in callbacks) and strategy != "cpu_offload":
            return None
        return Candidate.from_trainer(plugin, callbacks, strategy)


def _checked_regenerate(value: Any, max_context: bool, host_budget: Optional[str]) -> int:
    """``--max-regenerate``: an int >= 1; above 1 only with ``--max-context`` and ``--host-budget`` (remade inputs are
    chosen only where the offloaded inputs overflow the host), refused before anything is built."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"lightning-hbm plan --max-regenerate {value!r}: must be an int >= 1 (1: every block keeps its "
                         "input; n: one in at most n kept, the others remade in the backward), e.g. --max-regenerate 4.")
    if value > 1 and not (max_context and host_budget):
        raise ValueError(f"lightning-hbm plan --max-regenerate {value} needs --max-context and --host-budget (e.g. "
                         "--host-budget 64GiB): inputs are remade only where the offloaded ones overflow the host RAM.")
    return value


def main(args: Optional[list[str]] = None) -> int:
    """Console script ``lightning-hbm``; returns the exit status.

    ``fit``/``validate``/``test``/``predict``: :class:`HBMCLI`. ``plan [options]``: :class:`PlanCLI`
    (``fit``'s options plus ``--budget``; status 2 when nothing fits). ``report RUN_DIR [--out DIR]``:
    :func:`render_report`.
    """
    argv = list(sys.argv[1:] if args is None else args)
    with warnings.catch_warnings():
        # main() hands LightningCLI the console's own arguments: Lightning's warning about args and sys.argv
        # both being set is about a different mistake (a script passing args while run from a command line)
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        try:
            return _run(argv)
        except (ValueError, TypeError) as err:
            user_error: Union[BaseException, str, None] = _user_error(err)
            if user_error is None and "Does not validate against any of the Union subtypes" in str(err):
                user_error = one_line_error(str(err))  # jsonargparse building a class from the config failed
            if user_error is None:  # not a message written for the user: a bug, keep the traceback
                raise
            print(f"lightning-hbm: error: {user_error}", file=sys.stderr)
            return 2


def _user_error(err: BaseException) -> Optional[BaseException]:
    """The ValueError/TypeError a lightning_hbm ``raise`` statement wrote for the user, behind ``err``, if any.

    jsonargparse wraps an error raised by a class's ``__init__`` (``LoRA(r=-1)``) into its own
    ValueError listing every type it tried: the original is its ``__cause__``.
    """
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ValueError, TypeError)) and _raised_by_package(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def _raised_by_package(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = Path(tb.tb_frame.f_code.co_filename).resolve()
    # an explicit `raise` in lightning_hbm: a TypeError from a wrong call inside the package is a bug
    return filename.is_relative_to(_PACKAGE_DIR) and linecache.getline(str(filename), tb.tb_lineno).strip().startswith("raise")


def _run(argv: list[str]) -> int:
    """Run one console command (see :func:`main`); errors propagate to :func:`main`."""
    if argv[:1] == ["plan"] and "--max-context" in argv:
        contexts = PlanCLI(args=[a for a in argv[1:] if a != "--max-context"], run=False, max_context=True).contexts
        print_max_context(contexts)
        return 0 if all(c.tokens > 0 for c in contexts) else 2
    if argv[:1] == ["plan"]:
        result = PlanCLI(args=argv[1:], run=False).plan
        print_plan(result)
        return 0 if result.budget is None or result.chosen is not None else 2
    elif argv[:1] == ["report"]:
        parser = argparse.ArgumentParser(prog="lightning-hbm report", description=cast(str, render_report.__doc__).splitlines()[0])
        parser.add_argument("path", help="run directory (searched for hbm_profile*.json) or the JSON file")
        parser.add_argument("--out", default=None, help="directory to write to (default: next to the JSON)")
        options = parser.parse_args(argv[1:])
        paths = render_report(options.path, options.out)
        if "png" in paths:  # the step's picture, from its data beside the report (HBMProfiler's detailed step)
            redraw(find_report(options.path), paths["png"])
    else:
        HBMCLI(args=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
