#!/usr/bin/env bash
# Builds .venv-sglang: SGLang's frontend language (not its server) in an environment of
# its own, so that tests/lang/test_sglang_frontend.py can run SGLang's own test programs
# with SGLang's RuntimeEndpoint against `sprig serve`, and the same programs under sprig.
#
#   bash scripts/sglang_env.sh            # SGLANG_ENV=DIR to build elsewhere
#
# sglang is installed without its dependencies (they are its server's: CUDA torch,
# flashinfer, ...). What its frontend imports need, found by importing
# `sglang` and `sglang.test.test_programs` until nothing was missing, is listed below.
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_DIR=${SGLANG_ENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
FRONTEND_DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
               pydantic pyzmq tqdm ipython aiohttp)

python3 -m venv "$ENV_DIR"
pip="$ENV_DIR/bin/pip"
# A download that arrives damaged (pip: "do not match the hashes") is fetched again.
install() { for attempt in 1 2 3; do "$pip" install --quiet "$@" && return 0; echo "pip failed (attempt $attempt)"; sleep 5; done; return 1; }
# The CPU build of torch first (as .ci/run does), so that nothing pulls the CUDA wheels.
install torch==2.13.0
install --no-deps "sglang==$SGLANG_VERSION"
install "${FRONTEND_DEPS[@]}"
"$ENV_DIR/bin/python" -c "import sglang, sglang.test.test_programs; print('sglang', sglang.__version__, 'frontend ready')"
