"""``TargetListing``: the layers one ``Quantization`` quantizes and the ones it leaves alone (with why), listed once per surgery.

The rule of a surgery (:class:`~lightning_hbm.precision.targets.TargetRule`: the settings and the modules the
Trainer's callbacks train in full, :func:`modules_to_save`) and its :class:`~lightning_hbm.precision.targets.Listing`
of the model, cached until the model, those modules, the strategy or the checkpoint being resumed change. Its
embedding rules, each said at fit start: under FSDP an input embedding tied to a head in another unit (refused when
asked for, kept wide by the default), a resume of a run that kept them wide
(:func:`resumed_with_wide_embeddings`) or that did not record which small tables it kept wide
(:func:`kept_under_unrecorded`, :data:`KEPT_UNDER`); the embeddings ``quantize_embeddings`` keeps in the compute dtype.
The checkpoint's settings are read once a listing, from what resume hands over, and handed to each rule; the saved
settings (:mod:`~lightning_hbm.precision.saved_settings`) apply the same rules to the run a resume compares.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional, cast

from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_hbm import record, resume
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.layers.embedding import is_plain_embedding
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.targets import SMALL_EMBEDDING_VALUES, Listing, TargetRule

#: the settings key recording which input embeddings were kept wide while the others were converted (session 32)
KEPT_UNDER = "embeddings_kept_under"


def sharding_strategy(trainer: Any) -> Optional[str]:
    """The name of ``trainer``'s strategy if it shards parameters with FSDP (Lightning's ``FSDPStrategy`` or
    ``ModelParallelStrategy``, ``QuantizedFSDPStrategy`` included), else ``None``."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or not any(c.__name__ in ("FSDPStrategy", "ModelParallelStrategy") for c in type(strategy).__mro__):
        return None
    return type(strategy).__name__


def resumed_with_wide_embeddings(saved: Optional[dict[str, Any]]) -> bool:
    """Whether the settings ``saved`` with the checkpoint being resumed (``None``: none) do not list
    ``quantize_embeddings``: saved with the embeddings kept wide (the default before session 30, or kept under FSDP).
    The default (``quantize_embeddings="auto"``) resuming it keeps them wide (was: refused, "quantize_embeddings"
    differs, for every run saved before the default changed)."""
    return isinstance(saved, dict) and "quantize_embeddings" not in saved


def kept_under_unrecorded(saved: Optional[dict[str, Any]]) -> bool:
    """Whether the checkpoint being resumed (``saved``: its settings, ``None``: none) converted its embeddings without
    recording which tables it kept wide (saved before session 32: ``"auto"`` and an explicit ``"int8"`` saved the same
    settings, though the first kept the tables under :data:`SMALL_EMBEDDING_VALUES` values wide and the second
    converted them)."""
    return isinstance(saved, dict) and bool(saved.get("quantize_embeddings")) and KEPT_UNDER not in saved


def modules_to_save(module: nn.Module, trainer: Any) -> list[str]:
    """The modules the Trainer's callbacks train in full (``LoRA``'s ``modules_to_save``): they stay unquantized.

    Those of the callbacks of ``trainer`` (the Trainer ``module`` is attached to), read by duck typing (any callback with the
    attribute: the precision level sits below the callbacks, ``tests/test_layering.py``), then, without a Trainer
    (the planner's surgery), those :func:`~lightning_hbm.surgery.run_surgery` recorded from its transforms.
    """
    names = [name for cb in getattr(trainer, "callbacks", []) for name in getattr(cb, "modules_to_save", None) or ()]
    return names + [n for n in record.modules_to_save(module) if n not in names]


def linear_names(targets: list[tuple[str, nn.Module]]) -> list[str]:
    """The ``nn.Linear`` targets, measured per layer (other kinds, e.g. Conv1D or the projections a MultiheadAttention
    becomes, use ``mode``)."""
    return [name for name, layer in targets if isinstance(layer, nn.Linear)]


class TargetListing:
    """The targets of one ``Quantization``'s surgeries (module docstring).

    Args:
        config: the settings (the plugin's arguments, checked).
        owner: the name the settings are saved under in a checkpoint's ``configs`` (the embedding rules read them).
    """

    def __init__(self, config: QuantizationConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        #: the last listing kept the default's int8 embeddings wide (FSDP with a tied head in another unit, a wide
        #: resume): the settings saved say so
        self.embeddings_kept = False
        # (model, (the rule asked, the sharding strategy, resumed wide), the rule, its listing): the targets of the surgery under way
        self._cache: Optional[tuple[weakref.ref, tuple[TargetRule, Optional[str], bool], TargetRule, Listing]] = None

    def reset(self) -> None:
        """Forget the listing: the next call lists the model as it is then (a new surgery, or the model changed)."""
        self._cache = None

    def __getstate__(self) -> dict[str, Any]:
        # the weak reference to the model is this process's (session 32: a pickled Trainer failed on it)
        return {**self.__dict__, "_cache": None}

    def listing(self, module: nn.Module) -> Listing:
        """The targets of ``module`` and the layers left alone with (reason, deliberate), listed once per surgery."""
        return self.listed(module, lightning_compat.attached_trainer(module))[1]

    def listed(self, module: nn.Module, trainer: Any) -> tuple[TargetRule, Listing]:
        """The rule of this surgery (settings and the modules trained in full) and its listing of ``module``: listed
        again only when the model, the modules trained in full, the strategy or the checkpoint being resumed changed
        since. One pass over the model's embeddings: the FSDP units check reads the tied heads the listing found."""
        embeddings, by_default = self.config.quantize_embeddings, self.config.embeddings_by_default
        sharding = sharding_strategy(trainer)
        # the checkpoint's settings, read once and handed to its rules (under the default, which never raises below)
        saved = self._saved(trainer) if by_default else None
        resumed = resumed_with_wide_embeddings(saved)
        small = SMALL_EMBEDDING_VALUES if by_default else 0  # "auto" alone keeps tiny tables wide
        asked = TargetRule(self.config.ignore_modules, self.config.quantize_head, tuple(modules_to_save(module, trainer)), embeddings, small)
        cached = self._cache
        if cached is None or cached[0]() is not module or cached[1] != (asked, sharding, resumed):
            units = sharding is not None and bool(embeddings)  # a head tied in another FSDP unit: asked of the model
            # the run being resumed kept them wide (the default before session 30): it goes on so
            first: TargetRule = asked if units or not resumed else dataclasses.replace(asked, quantize_embeddings=False)
            listing = first.listing(module)
            apart = {n: [h for h in heads if h.split(".")[0] != n.split(".")[0]] for n, heads in listing.tied.items()} if units else {}
            apart = {n: heads for n, heads in apart.items() if heads}
            if apart and not self.config.embeddings_by_default:
                raise ValueError(
                    f"quantize_embeddings={embeddings!r} under {sharding}: the input embedding(s) {sorted(apart)} are tied to "
                    f"head(s) {sorted(h for heads in apart.values() for h in heads)} in another top-level submodule, another "
                    "FSDP unit, where the head would read a shard of the quantized table. Hold both in one submodule (as a "
                    "causal LM's model does), or pass quantize_embeddings=False to keep the tied table wide."
                )
            rule: TargetRule = dataclasses.replace(asked, quantize_embeddings=False) if apart or resumed else asked  # the default keeps them wide
            if rule != first:  # listed as asked to see the units, kept wide: its embeddings' part dropped (the rest does not depend on it)
                chosen, left = {n for n, _ in listing.embeddings[0]}, listing.embeddings[1]
                listing = listing._replace(
                    targets=[(n, m) for n, m in listing.targets if n not in chosen], skipped={n: r for n, r in listing.skipped.items() if n not in left},
                    embeddings=([], {}), tied={},
                )
            self._say_kept_wide(module, sharding, apart, resumed)
            cached = (weakref.ref(module), (asked, sharding, resumed), rule, listing)
            self._cache = cached
            if embeddings and kept_under_unrecorded(saved if by_default else self._saved(trainer)):
                self._say_small_tables_unrecorded(cached[3])
        self.embeddings_kept = cached[2].quantize_embeddings is False and self.config.embeddings_by_default  # saved as they are: kept
        return cached[2], cached[3]

    def _saved(self, trainer: Any) -> Optional[dict[str, Any]]:
        """The settings saved under this owner in the checkpoint ``trainer`` is resuming, as resume hands them over
        (``None``: no Trainer, no checkpoint or none saved)."""
        return resume.saved_part(trainer).get("configs", {}).get(self.owner) if trainer is not None else None

    def _say_kept_wide(self, module: nn.Module, sharding: Optional[str], apart: dict[str, list[str]], resumed: bool) -> None:
        """Warn, once per listing, that the default keeps the input embeddings wide: a head tied to one in another FSDP
        unit (``apart``), or a resume of a run that kept them wide."""
        if apart:
            rank_zero_warn(
                f"lightning_hbm: QuantizedPrecision keeps the input embeddings in {self.config.torch_dtype} under {sharding}: "
                f"{sorted(apart)} are tied to the head(s) {sorted(h for heads in apart.values() for h in heads)} in another "
                "top-level submodule of the LightningModule, which FSDP2 shards as another unit: the head would read a "
                "shard of the int8 table (quantize_embeddings='auto'). Hold both in one submodule (as a causal LM's "
                "model does) to store them in int8, or pass quantize_embeddings=False to keep them wide without this warning."
            )
        if resumed and any(is_plain_embedding(m) for m in module.modules()):
            rank_zero_warn(
                f"lightning_hbm: QuantizedPrecision keeps the input embeddings in {self.config.torch_dtype}: the checkpoint "
                "being resumed was saved with them so (quantize_embeddings=False, the default before lightning_hbm "
                "stored them in int8 by default), and a resume goes on as that run was. A new run stores them in int8; "
                "pass quantize_embeddings=False to keep them wide without this warning."
            )

    def _say_small_tables_unrecorded(self, listing: Listing) -> None:
        """The checkpoint being resumed does not say whether its tables under :data:`SMALL_EMBEDDING_VALUES` values were
        converted (:func:`kept_under_unrecorded`): said, with what this run does and the other way, where the model has
        such a table (session 32: a resume that changed it went on silently on another frozen table)."""
        chosen, skipped = listing.embeddings
        small = [n for n, t in chosen if cast(Tensor, t.weight).numel() < SMALL_EMBEDDING_VALUES]
        small += [n for n, (why, _) in skipped.items() if why.startswith("too small to gain")]
        if not small:
            return
        now, other = ("keeps them wide", "quantize_embeddings='int8'") if self.config.embeddings_by_default else ("stores them in int8", "the default (quantize_embeddings='auto')")
        rank_zero_warn(
            f"lightning_hbm: the checkpoint being resumed does not record whether its input embeddings under "
            f"{SMALL_EMBEDDING_VALUES:,} values ({', '.join(sorted(small))}) were stored in int8 (saved before lightning_hbm "
            "recorded it: 'auto' kept them wide, an explicit setting and lightning_hbm before session 31 converted them). "
            f"This run {now}, as its setting does; if the run that saved it did otherwise, resume with {other} to go on "
            "on the same frozen tables."
        )

    def say_embeddings_kept(self, module: nn.Module) -> None:
        """Warn (names, reasons) about input embeddings ``quantize_embeddings`` keeps in the compute dtype; a model with
        none to store is said only when the user asked for them (the default leaves such a model as it was)."""
        targets, skipped = self.listing(module)[:2]
        kept = {n: why for n, (why, deliberate) in skipped.items() if not deliberate and is_plain_embedding(module.get_submodule(n))}
        setting = f"quantize_embeddings={self.config.quantize_embeddings!r}" + (" (the default, 'auto')" if self.config.embeddings_by_default else "")
        if kept:
            rank_zero_warn(
                f"lightning_hbm: QuantizedPrecision({setting}) keeps {len(kept)} input embedding(s) in "
                f"{self.config.torch_dtype}: " + "; ".join(f"{n}: {why}" for n, why in kept.items()) + "."
            )
        elif not self.config.embeddings_by_default and not any(isinstance(layer, nn.Embedding) for _, layer in targets):
            rank_zero_warn(
                f"lightning_hbm: QuantizedPrecision({setting}): {type(module).__name__} has no nn.Embedding "
                "to store quantized; the option changes nothing for this model."
            )
