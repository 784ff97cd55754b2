#!/usr/bin/env bash
# Issue 53's figures on one GPU in one call: `bash bench/nvfp4_gpu.sh OUT_DIR`.
#
# Runs `pdmesh bench --suite nvfp4` on the Llama-3-8B shape, then on Llama-3.2-1B's, each
# under a time budget (phases that would not fit are skipped and named in the JSON), so
# the whole run ends within about 550 s. Writes five files under OUT_DIR:
#   nvfp4-8b.json nvfp4-8b.md nvfp4-1b.json nvfp4-1b.md   the figures and their tables
#   nvfp4-gpu.log                                         everything printed, mesh log
#                                                         tails of any failed phase
# Expects python3 with torch, triton and CUDA, pdmesh importable (PYTHONPATH), NIXL, and
# PDMESH_TOKENIZER (a tokenizer directory: the random specs' router tokenizes with it).
set -u
out=${1:?usage: bash bench/nvfp4_gpu.sh OUT_DIR}
mkdir -p "$out"
log="$out/nvfp4-gpu.log"
total=${NVFP4_TOTAL_S:-550}  # seconds for the whole script
budget_8b=${NVFP4_8B_S:-335}
device=${NVFP4_DEVICE:-cuda}  # cpu: a plumbing check of this script without a GPU
exec > >(tee -a "$log") 2>&1

echo "== $(date -u +%FT%TZ) host $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name(0))'
echo "PDMESH_TOKENIZER=${PDMESH_TOKENIZER:-unset}"

suite() {  # model tag budget [extra flags]
    local model=$1 tag=$2 budget=$3
    shift 3
    echo "== $(date -u +%T) $model: budget ${budget}s"
    timeout --signal=TERM --kill-after=15 $((budget + 30)) \
        python3 -m pdmesh.cli bench --suite nvfp4 --device "$device" --model "$model" \
        --dtype bfloat16 --time-budget "$budget" --reps 2 --out "$out/nvfp4-$tag.json" "$@"
    local rc=$?
    echo "== $(date -u +%T) $model: exit $rc"
    cat "$out/nvfp4-$tag.md" 2>/dev/null || echo "(no table for $model)"
}

suite random:llama3-8b 8b "$budget_8b"
left=$((total - SECONDS - 30))
if [ "$left" -gt 60 ]; then
    # the KV rows are the 8B's; five reps, as a 1B step is about 1 ms and one host stall
    # moves a two-rep figure by tens of per cent
    suite random:llama3-1b 1b "$left" --skip-kv --reps 5
else
    echo "== no time left for random:llama3-1b (${left}s)"
fi
left=$((total - SECONDS - 10))
if [ "$left" -gt 45 ]; then  # the GPU tests of the Llama-3 shapes, if time is left
    echo "== $(date -u +%T) GPU tests (${left}s)"
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/engine/test_large_specs_gpu.py
fi
echo "== $(date -u +%T) done in ${SECONDS}s"
sleep 1  # let tee write the last lines of the log
