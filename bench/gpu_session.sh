#!/usr/bin/env bash
# Every GPU check a device session runs, in order of what the open issues need, each under its
# own time limit, all output kept under $OUT/h200 (steps, rates, packed.json, session.log).
#
# Here, before the session: put optree's wheel for the device's Python 3.12 in .wheels/ (the H200
# image lacks optree; docs/NOTES):
#   pip download optree --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .wheels
# then, with the `run` tool: command "bash bench/gpu_session.sh", carry [".wheels"], timeout_s 600.
# Afterwards copy what came back into bench/data/h200/ and run
#   python bench/cuda_step_kernels.py --compare bench/data/h200/steps-session.json
set -u
out="${OUT:?set OUT to the folder whose files come back}/h200"
mkdir -p "$out"
log="$out/session.log"
python3 -c "import optree" 2>/dev/null || python3 -m pip install --quiet --no-deps .wheels/optree-*.whl
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

check() {  # check SECONDS COMMAND...: run it under a limit; its output to the log and the screen
    local limit="$1"
    shift
    echo "== $* (at most ${limit} s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "== exit ${PIPESTATUS[0]}" | tee -a "$log"
}

# CPU offload on a meta-built model: materialize's placement, clip_grad_norm_ and grad_scaler
check 45 python3 bench/cuda_offload.py
# half of Llama 3 8B on this one GPU: do 8B's shapes run at the rates measured on 1B's? (the
# published 8B rows' 1.6-1.8x; then: python bench/cuda_step_kernels.py --compare .../steps-scale.json)
check 100 python3 bench/cuda_step_kernels.py --out "$out" --tag scale --no-rates --rows llama-3-8b
# torch.compile of each block beside the same rows eager: does compile shorten the matmuls, or only
# the memory-bound work? (then: python bench/cuda_step_kernels.py --compare .../steps-compile.json)
check 120 python3 bench/cuda_step_kernels.py --out "$out" --tag compile --no-rates --rows "llama-1b 8k none" "llama-1b 4k full"
# rates (each SDPA kernel alone, and the host's seconds per op), then every step row again
check 180 python3 bench/cuda_step_kernels.py --out "$out" --tag session
# packed documents: the compiled flex path's parity, padded against packed tokens/s
check 150 python3 bench/cuda_packed.py --out "$out"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee -a "$log"
