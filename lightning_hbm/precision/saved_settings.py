"""``SavedSettings``: what a ``Quantization`` saves with each checkpoint and compares at a resume.

The settings a resume must share (:meth:`SavedSettings.settings`, as this run will have them:
:meth:`SavedSettings.run_settings`, by the listing's embedding rules: a checkpoint saved with its input embeddings
wide, or without recording which small tables it kept wide, :mod:`~lightning_hbm.precision.target_listing`) and the
layer modes taken back from the checkpoint being resumed (:meth:`SavedSettings.saved_layer_modes`). The checkpoint is
read from what resume hands over (:func:`saved_meta`), never from the file. Holds the settings, their owner's name and
which run's surgery took the layer modes (:meth:`SavedSettings.taken_by`): what a surgery decided (the layer modes, the
embeddings kept) is handed in.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from lightning_hbm import resume
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.target_listing import KEPT_UNDER, kept_under_unrecorded, resumed_with_wide_embeddings, sharding_strategy
from lightning_hbm.precision.targets import SMALL_EMBEDDING_VALUES


def saved_meta(trainer: Any) -> dict[str, Any]:
    """The lightning_hbm part of the checkpoint ``trainer`` is resuming (empty when none), as resume hands it over:
    verified once by resume, never read from the file here.

    Raises:
        ValueError: the checkpoint's structure, version or CRCs are wrong (:func:`lightning_hbm.resume.saved_part`).
    """
    return resume.saved_part(trainer)


class SavedSettings:
    """The saved and compared settings of one ``Quantization`` (module docstring).

    Args:
        config: the settings (the plugin's arguments, checked).
        owner: the name the settings are saved under in a checkpoint's ``configs`` (the plugin's class name).
    """

    def __init__(self, config: QuantizationConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        # the Trainer whose surgery measured or took the layer modes (weakly): a plugin reused by another Trainer compares
        # that run's layer modes at its resume, not the last fit's (session 32: a sweep's plugin refused its own checkpoint)
        self._modes_run: Optional[weakref.ref] = None

    def taken_by(self, trainer: Any) -> None:
        """The layer modes of the surgery under way are ``trainer``'s run's (``None``: a surgery of no run)."""
        self._modes_run = weakref.ref(trainer) if trainer is not None else None

    def _modes_are_of(self, trainer: Any) -> bool:
        """Whether the layer modes are ``trainer``'s run's (its surgery measured or took them): a reused plugin's resume
        check runs before that run's surgery, when they are still the last fit's (another model's)."""
        return trainer is None or (self._modes_run is not None and self._modes_run() is trainer)

    def __getstate__(self) -> dict[str, Any]:
        # the weak reference to this run's Trainer is this process's, not the plugin's settings: a Trainer pickled or
        # deep-copied after fit failed with "cannot pickle 'weakref.ReferenceType' object" (session 32); the copy then
        # compares the checkpoint's layer modes at a resume, as a plugin of no run does
        return {**self.__dict__, "_modes_run": None}

    def saved(self, trainer: Any) -> Optional[dict[str, Any]]:
        """This owner's settings in the checkpoint ``trainer`` is resuming (``None``: no Trainer, no checkpoint or none saved)."""
        return saved_meta(trainer).get("configs", {}).get(self.owner) if trainer is not None else None

    def settings(self, embeddings_kept: bool) -> dict[str, Any]:
        """The settings a resume compares (an option at its default is left out: older checkpoints keep matching).
        ``embeddings_kept``: the last listing kept the default's int8 embeddings wide (then saved as they are)."""
        config = self.config
        saved: dict[str, Any] = {"mode": config.format.name, "dtype": str(config.torch_dtype), "ignore_modules": config.ignore_list(), "quantize_head": config.quantize_head}
        targets = {"max_bytes_per_param": config.max_bytes_per_param, "min_cosine": config.min_cosine}
        if any(value is not None for value in targets.values()):
            saved.update(targets, sensitive_mode=config.sensitive_argument())
        if config.layer_modes is not None:  # layer modes the user gave: a setting like the others
            saved["layer_modes"] = dict(config.layer_modes)
        if config.quantize_embeddings and not embeddings_kept:  # absent before this option existed, and when kept
            saved["quantize_embeddings"] = config.quantize_embeddings
            saved[KEPT_UNDER] = self.kept_under()
        if config.rounding != "nearest":  # absent before this option existed
            saved["rounding"] = config.rounding
        if config.smoothing is not None:
            saved["smoothing"] = config.smoothing
        if config.correction_rank:  # absent before this option existed
            saved["correction_rank"] = config.correction_rank
        return saved

    def run_settings(self, trainer: Any, settings: dict[str, Any]) -> dict[str, Any]:
        """``settings`` (:meth:`settings`) as this run will have them when it resumes the checkpoint of ``trainer``
        (compared before its surgery, so not read from the last one)."""
        config = dict(settings)
        if trainer is None or not saved_meta(trainer):
            return config
        # resuming, compared before this run's surgery lists them: kept or not as THIS run will (its strategy, the
        # checkpoint), not as the last surgery did (a plugin reused by another Trainer: was read stale, session 31)
        saved = self.saved(trainer)
        kept = self.config.embeddings_by_default and (sharding_strategy(trainer) is not None or resumed_with_wide_embeddings(saved))
        config.pop("quantize_embeddings", None)
        config.pop(KEPT_UNDER, None)
        if self.config.quantize_embeddings and not kept:
            config["quantize_embeddings"] = self.config.quantize_embeddings
            if not kept_under_unrecorded(saved):
                config[KEPT_UNDER] = self.kept_under()
        return config

    def saved_layer_modes(self, trainer: Any, settings: dict[str, Any]) -> Optional[dict[str, str]]:
        """The layer modes in the checkpoint ``trainer`` is resuming, if it was saved with these settings (``settings``:
        :meth:`settings`; else ``None``)."""
        if trainer is None:
            return None
        saved = self.saved(trainer) or {}
        if any(saved.get(key) != value for key, value in self.run_settings(trainer, settings).items()):
            return None  # other settings: measure, and the resume check lists every difference
        return saved.get("layer_modes")

    def resume_config(self, trainer: Any, settings: dict[str, Any], layer_modes: Optional[dict[str, str]]) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint (``trainer``: the run's, or ``None``).
        ``layer_modes``: the modes the last surgery chose (taken where they are this run's: pinned, or
        :meth:`taken_by` ``trainer``)."""
        config = self.run_settings(trainer, settings)
        modes = layer_modes if self.config.layer_modes is not None or self._modes_are_of(trainer) else None
        if modes is None and self.config.layer_modes is None:
            # compared before the surgery measures the modes (the load hook, before Lightning's restore): with the same
            # settings they will be the checkpoint's own (the mode choice takes them), so those are this run's
            modes = self.saved_layer_modes(trainer, settings)
        if modes is not None:
            config["layer_modes"] = dict(modes)
        return config

    def kept_under(self) -> int:
        """The tables of fewer values kept wide while the others are converted: ``"auto"``'s
        :data:`SMALL_EMBEDDING_VALUES`, 0 for an explicit setting (it converts every one)."""
        return SMALL_EMBEDDING_VALUES if self.config.embeddings_by_default else 0
