#!/usr/bin/env bash
# Every GPU check of lightning_hbm, in two calls that fit a lease of 15 minutes of device time (device tool).
#
# Prepare here (once): echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 --platform any \
#     -d .whl bitsandbytes==0.50.2 torchao==0.18.0 jsonargparse docstring-parser typeshed-client
# Run there:  run(command="bash benchmarks/gpu_checks.sh memory", carry=[".whl"], timeout_s=420)
#             run(command="bash benchmarks/gpu_checks.sh time", carry=[".whl"], timeout_s=300)
# memory: the marked GPU tests and every memory figure, side by side (each process's own max_memory_allocated: the
#         CUDA allocator's statistics are per process, so the processes sharing the card do not mix their figures).
# time:   the step-time ratios, one process at a time (ratios interleaved inside each process).
# Results land in $OUT (pytest log + one log per benchmark); copy the figures into benchmarks/README.md.
set -uo pipefail
PART=${1:-memory}
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# the package itself, so that its entry point (lightning.pytorch.callbacks_factory) is registered as after a pip install
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 \
  && export PYTHONPATH=/tmp/site:$PWD || echo "package install failed: lightning_hbm from the checkout, no entry point"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, bitsandbytes, lightning, peft, transformers; print(torch.__version__, torch.version.cuda, 'bnb',
bitsandbytes.__version__, 'lightning', lightning.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
run() { local limit=$1 name=$2; shift 2; echo "== $name: $*" >> "$OUT/$name.log"; timeout "$limit" python3 "$@" >> "$OUT/$name.log" 2>&1; echo "== $name rc=$?" >> "$OUT/$name.log"; }

if [ "$PART" = memory ]; then
  # 1. the marked GPU tests (precision, profiler, LoRA, activations, optimizer, int8-dynamic, planner, FSDP)
  # (only the files that hold one: collecting the whole suite in 4 workers takes minutes of the lease)
  run 300 pytest_gpu -m pytest -q -m gpu -p no:cacheprovider -n 4 --durations=10 $(grep -rl "mark.gpu" tests | sort) &
  # 2. max_context's answer for the 8B shape at 8 GiB (Unsloth's 8 GB row: 2,972 tokens), trained 2 steps there:
  #    each step's max_memory_allocated against the prediction, the pinned host bytes against the planned host bytes
  run 330 max_context -u benchmarks/max_context.py --gpu-check --gpu-budget 8 &
  # 3. the planner's predicted peak vs max_memory_allocated of a real step (~1B Llama, bf16 + full AC, QLoRA)
  run 240 planner benchmarks/planner.py --gpu-check &
  # 4. the memory benchmarks on CUDA
  (run 90 precision benchmarks/precision_memory.py --device cuda --modes nf4-dq int8 int8-dynamic
   run 90 activations benchmarks/activation_memory.py --device cuda
   run 90 optimizer benchmarks/optimizer_memory.py --device cuda
   run 90 lora benchmarks/lora_memory.py --accelerator cuda) &
  wait
else
  # 5. step time: FusedLoss and the stacks against the Hugging Face QLoRA recipe (random-weight 1B Llama saved once,
  #    every stack in one process, rounds interleaved); then the activation offload's cost
  run 200 peer_qlora benchmarks/peer_qlora.py --device cuda --preset 1b --rounds 3 \
    --stacks hf,lhbm,lhbm+fused,lhbm+fused+attn,lhbm+fused-mlp2,torchtune,litgpt,litgpt+ac
  run 80 offload_cost benchmarks/max_context.py --offload-cost
fi
for f in "$OUT"/*.log; do echo "#### $f"; tail -12 "$f"; done
