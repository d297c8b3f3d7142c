#!/usr/bin/env bash
# Every GPU check of lightning_hbm in one run, for a session lent a GPU machine (device tool).
# Nothing here has run yet: the session that wrote the project had no GPU. Budget: ~8 minutes on one H200.
#
# Prepare here (once): echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2
# Run there:  run(command="bash benchmarks/gpu_checks.sh", carry=[".whl"], timeout_s=600)
# Results land in $OUT (pytest log + one log per benchmark); copy the figures into benchmarks/README.md.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, bitsandbytes; print(torch.__version__, torch.version.cuda, bitsandbytes.__version__)" | tee -a "$OUT/gpu.txt"

# 1. the marked GPU tests (precision, profiler, LoRA, activations, optimizer, int8-dynamic, planner, FSDP)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

# 2. the benchmarks on CUDA (each bounded; figures go to benchmarks/README.md)
run() { local name=$1; shift; echo "== $name: $*"; timeout 90 python3 "$@" 2>&1 | tee "$OUT/$name.log" | tail -12; }
run precision   benchmarks/precision_memory.py --device cuda --modes nf4-dq int8 int8-dynamic
run activations benchmarks/activation_memory.py --device cuda
run optimizer   benchmarks/optimizer_memory.py --device cuda
run quality     benchmarks/quantization_quality.py --device cuda
run planner     benchmarks/planner.py --gpu-check  # predicted peak vs torch.cuda.max_memory_allocated (~1B Llama)
run fsdp        benchmarks/fsdp_qlora.py --strategy fsdp_qlora --devices 1 --size tiny
run profiler    benchmarks/profiler_overhead.py --accelerator cuda
run lora        benchmarks/lora_memory.py --accelerator cuda
# ActivationCheckpointing(offload=True): step time with and without (side-stream copies, backward prefetch; untested on
# GPU), then max_context's 8B answer for this device and 70 % of the free host RAM trained for 2 steps (predicted vs
# max_memory_allocated; pinned bytes, each block input in power-of-two pieces, vs host_memory_stats: not yet run on GPU;
# the marked test test_offload_on_cuda_pins_the_block_inputs_in_pieces_without_rounding in step 1 checks the same)
run offload_cost benchmarks/max_context.py --offload-cost
timeout 240 python3 benchmarks/max_context.py --gpu-check 2>&1 | tee "$OUT/max_context.log" | tail -4
# FusedLoss vs the Hugging Face QLoRA recipe (random-weight Llama saved once; 3 stacks in one process).
# 1b fits the budget; 8b (run by hand when time allows): benchmarks/peer_qlora.py --device cuda --preset 8b --rounds 2
# lhbm+fused-mlp2: ActivationCheckpointing(mlp_chunks=2), the MLPs' recompute in token chunks (CPU, 100M: 1.14x the floor)
echo "== peer_qlora: benchmarks/peer_qlora.py --device cuda --preset 1b"
timeout 240 python3 benchmarks/peer_qlora.py --device cuda --preset 1b --rounds 3 \
  --stacks hf,lhbm,lhbm+fused,lhbm+fused+attn,lhbm+fused-mlp2,lhbm+fused-noac,torchtune,litgpt,litgpt+ac 2>&1 | tee "$OUT/peer_qlora_1b.log" | tail -10
