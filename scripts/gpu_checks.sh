#!/bin/bash
# The GPU checks and benchmarks recorded in benchmarks/RESULTS.md, on a CUDA machine
# whose python3 has torch and triton. Wheels for what it lacks (pyzmq, orjson,
# outlines-core, FastAPI, peft and accelerate (the LoRA tests' and the fuzzer's reference)
# and their needs) may lie in $WHEELS (default: .whl); sprig is
# installed from this checkout into a scratch directory, so nothing global changes.
# Logs go to $OUT (default: ./gpu-logs). $PHASE_TIMEOUT (seconds) bounds each test or
# benchmark command, so that one phase that hangs leaves time for the others.
#
#   usage: bash scripts/gpu_checks.sh PHASE...
#   phases: info, kernels (Triton kernels and backend vs their references), gpumark
#           (tests marked gpu, the MoE experts in CUDA graphs among them), newpaths (speculative decoding, quantized weights and
#           the quantized KV cache on CUDA), suite (runtime, lang and radix tests on CUDA), kbench
#           (bench_kernels), moebench (bench_moe: the experts' Triton path vs torch), obench (bench_offline, 1b bf16, with transformers),
#           obench-eager (bench_offline without CUDA graphs, no transformers), sbench
#           (bench_serving vs the offline engine: bench_offline's workload through a
#           local server on the 1b model), sbench-poisson (random prompts at 32 requests/s),
#           spbench (bench_speculative: each drafter vs off on the demo model, CUDA graphs on),
#           trees (bench_token_trees: 32 samples at T = 0.8, verification free, then measured),
#           servers (real servers on CUDA: the forkserver's children, speculation behind HTTP),
#           fuzz (the engine's differential fuzzer with its engines on CUDA, $FUZZ_MINUTES, default 3;
#           stops at the first failure)
set -u
export PYTHONUNBUFFERED=1
WHEELS=${WHEELS:-.whl}
OUT=${OUT:-gpu-logs}
RUN=()
[ -n "${PHASE_TIMEOUT:-}" ] && RUN=(timeout -k 5 "$PHASE_TIMEOUT")
SITE=$(mktemp -d)
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/deps" "$WHEELS"/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE/sprig" . || exit 1
export PYTHONPATH=$SITE/sprig:$SITE/deps
(cd / && python3 -c "import sprig.runtime, zmq, orjson, outlines_core, fastapi") || exit 1
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    info) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
          python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)";;
    kernels) "${RUN[@]}" python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime/test_triton_backend.py 2>&1 | tee "$OUT/kernels.log" | tail -30;;
    gpumark) "${RUN[@]}" python3 -m pytest -q -p no:cacheprovider tests -m gpu 2>&1 | tee "$OUT/gpumark.log" | tail -30;;
    newpaths) "${RUN[@]}" python3 -m pytest -q -p no:cacheprovider --maxfail 15 tests/runtime/test_quant_linear.py \
                tests/runtime/test_kv_int8.py tests/runtime/test_speculative_draft_model.py \
                tests/runtime/test_quant_parity.py tests/runtime/test_speculative_engine.py \
                tests/runtime/test_speculative_distribution.py 2>&1 | tee "$OUT/newpaths.log" | tail -40;;
    suite) "${RUN[@]}" python3 -m pytest -q -p no:cacheprovider --maxfail 15 --durations 10 tests/runtime tests/lang tests/radix 2>&1 | tee "$OUT/suite.log" | tail -60;;
    kbench) "${RUN[@]}" python3 benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench_kernels.log";;
    moebench) "${RUN[@]}" python3 benchmarks/bench_moe.py 2>&1 | tee "$OUT/bench_moe.log";;
    obench) "${RUN[@]}" python3 benchmarks/bench_offline.py --device cuda --dtype bfloat16 --size 1b 2>&1 | tee "$OUT/bench_offline.log";;
    obench-eager) "${RUN[@]}" python3 benchmarks/bench_offline.py --device cuda --dtype bfloat16 --size 1b --skip-transformers --disable-cuda-graph 2>&1 | tee "$OUT/bench_offline_eager.log";;
    spbench) "${RUN[@]}" python3 benchmarks/bench_speculative.py --device cuda --repeats 3 2>&1 | tee "$OUT/bench_speculative.log";;
    trees) for costs in --free ""; do
             "${RUN[@]}" python3 benchmarks/bench_token_trees.py --device cuda --samples 32 --temperature 0.8 $costs 2>&1
           done | tee "$OUT/bench_token_trees.log";;
    fuzz) "${RUN[@]}" python3 -m pytest -q -s -x -p no:cacheprovider tests/runtime/test_engine_fuzz.py \
            -k "itself_alone and not tp2" --fuzz-device cuda --fuzz-minutes "${FUZZ_MINUTES:-3}" 2>&1 | tee "$OUT/fuzz.log" | tail -40;;
    servers) "${RUN[@]}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_server_generate.py \
               tests/runtime/test_server_lifecycle.py tests/runtime/test_speculative_server.py \
               tests/runtime/test_server_openai_client.py 2>&1 | tee "$OUT/servers.log" | tail -30;;
    sbench|sbench-poisson)
      [ -d "$SITE/m1b" ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_offline import SIZES; \
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint; build_tiny_checkpoint('$SITE/m1b', 'llama', max_position_embeddings=4096, **SIZES['1b'])" >/dev/null 2>&1
      common=(--model "$SITE/m1b" --dtype bfloat16 --max-running-requests 128 --repeats 3)
      if [ "$phase" = sbench ]; then
        "${RUN[@]}" python3 benchmarks/bench_serving.py "${common[@]}" --max-concurrency 128 --gsp-num-groups 8 --gsp-prompts-per-group 16 \
          --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 64 --compare-engine 2>&1 | tee "$OUT/bench_serving.log"
      else
        "${RUN[@]}" python3 benchmarks/bench_serving.py "${common[@]}" --dataset random --num-prompts 256 --random-input-len 512 \
          --random-output-len 128 --request-rate 32 2>&1 | tee "$OUT/bench_serving_poisson.log"
      fi;;
    *) echo "unknown phase: $phase (see the usage at the top of this file)"; exit 2;;
  esac
done
rm -rf "$SITE"
