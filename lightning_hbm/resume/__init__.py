"""What a lightning_hbm checkpoint holds, and how a resume is checked against the run that saved it.

Lightning restores ``checkpoint["state_dict"]`` into the model *as the user built it*, before the
surgery (:mod:`lightning_hbm.surgery`) quantizes and adapts it. So a checkpoint of a changed model
is written in two parts:

* ``checkpoint["state_dict"]``: every tensor that fits the model as built (embeddings, norms,
  buffers, ...) under its own key, plus a *placeholder* for each as-built weight whose changed form
  (a 4-bit weight and its constants, an int8 weight) is kept in the second part. A placeholder is a
  NaN expanded to the weight's shape (stride 0: it costs 4 bytes in the file), so Lightning's strict
  loading accepts the file and a model loaded without lightning_hbm visibly computes NaN instead
  of silently training on wrong weights.
* ``checkpoint["lightning_hbm"]``: the changed tensors (``state_dict``), the as-built keys
  deliberately left out (``omitted``: the frozen base of an adapter-only LoRA checkpoint), a
  fingerprint of each omitted tensor taken before quantization, the configuration of the precision
  plugin and of every transform (``configs``), the format ``version``, a CRC32 of every tensor in
  the whole checkpoint, optimizer states and loops included (``checksums``, by :func:`seal`), a SHA-256
  of every other top-level entry with all its values (``values``: loop progress, epoch, learning rates,
  scheduler and callback states; tensors in it by shape and dtype, their bytes by the CRCs), and a
  SHA-256 ``digest`` of this part itself (so a flipped bit in the tables cannot turn the checks off).

Saves go through :class:`CheckedCheckpointIO`: packed with what the surgery handed down (:class:`Saves`: no call back
up into it), sealed last, refused if a trained tensor is NaN/inf, written atomically beside the target. On resume, before the first change: the structure and version of
the lightning_hbm part, its digest, every other value against its entry's SHA-256, and every tensor against
its CRC (``torch.load`` does not verify the zip CRC of tensor data, so flipped bytes would load silently); the
pickled metadata is bounded in size and must match its zip CRC before torch unpickles it; the configurations must be equal, and the
omitted base must have the fingerprint of the base the adapters were trained on. After the surgery the
changed tensors are loaded and every key of the changed model must come from the checkpoint or from an
omitted (fingerprinted) base weight. Version-1 checkpoints (weights-only CRCs, 64-sample fingerprints,
no digest) and version-2 ones (no ``values``) still load, with a warning.

The package, one job per module (bottom to top; each imports only those above it in this list):

* ``fingerprints``: fingerprints of the frozen base and the record of the model as built;
* ``keys``: which as-built key a changed key is a form of (:class:`KeyMap`);
* ``packing``: the two-part form (:func:`pack`, placeholders, ``META_KEY``, ``FORMAT_VERSION``), and what a run's
  checkpoints are packed with (:class:`Saves`, handed down by the surgery with :func:`expect_saves`; :func:`pack_for`);
* ``sealing``: checksums and digests (:func:`seal`, :func:`verify`, :func:`validate_meta`);
* ``pending``: the checkpoint being resumed (:func:`pending`), verified once by its one owner (:func:`opened`, the
  only caller of :func:`verify`) and handed out verified (:func:`saved_part`: the precision plugin's saved plan);
* ``checks``: the file, its layout and its tensors before anything loads (:func:`check_file`,
  :func:`check_layout`, :func:`check_contents`; the registered marks and checks);
* ``restore``: the checkpoint against this run (:func:`check_settings`; :func:`check_resume` with the run's settings
  the surgery registers, :func:`register_run_settings`) and the changed tensors loaded after the surgery
  (:func:`load_changed`);
* ``io``: atomic saves, :class:`CheckedCheckpointIO` and :func:`read_file` (a strategy that restores its own file):
  with ``checks`` (which reads a file's zip entries before torch does), the only modules of the package that open a
  checkpoint file (``tests/resume/test_resume_owner.py``);
* ``hooks``: the load hooks a Trainer's restore goes through (:func:`add_resume_hooks`: they check with
  :func:`check_resume`).

This module is their face: ``from lightning_hbm import resume; resume.X`` for every name above.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from lightning_hbm.resume import checks as _checks
from lightning_hbm.resume.checks import (
    MAX_PICKLE_BYTES,
    check_contents,
    check_file,
    check_layout,
    register_changed_marks,
    register_meta_check,
    stray_keys,
)
from lightning_hbm.resume.fingerprints import _SAMPLES, as_built_record, fingerprint, fingerprint_v1, spread_indices
from lightning_hbm.resume.hooks import add_resume_hooks, has_resume_hook
from lightning_hbm.resume.io import CheckedCheckpointIO, atomic_save, check_checkpoint_dirs, clean_partials, fsync_dir, read_file
from lightning_hbm.resume.keys import KeyMap, covered
from lightning_hbm.resume.packing import FORMAT_VERSION, META_KEY, Saves, expect_saves, is_placeholder, pack, pack_for
from lightning_hbm.resume.pending import is_verified, opened, pending, saved_part
from lightning_hbm.resume.restore import (
    LOADED_ALREADY,
    RunSettings,
    adapter_misfits,
    check_resume,
    check_settings,
    config_differences,
    fingerprint_differences,
    load_changed,
    register_run_settings,
    unrestored_keys,
)
from lightning_hbm.resume.sealing import checksum, meta_digest, seal, tensor_entries, validate_meta, value_digests, verify

# settings a user may change here (``lightning_hbm.resume.MAX_PICKLE_BYTES = ...``, as the error for an oversized file
# says) that a module of the package reads: a write to the face is forwarded there
_SETTINGS = {"MAX_PICKLE_BYTES": _checks}


class _Face(types.ModuleType):
    """The type of this module: writes of :data:`_SETTINGS` reach the module that reads them (monkeypatch too)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTINGS:
            setattr(_SETTINGS[name], name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
