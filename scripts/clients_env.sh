#!/usr/bin/env bash
# Builds .venv-clients: the agent libraries instructor, litellm and the OpenAI Agents SDK,
# each driving `sprig serve` through its OpenAI-compatible API in
# tests/runtime/test_server_agent_clients.py (the Agents SDK through /v1/responses). They
# live apart from sprig's environment because instructor pins jiter<0.15, which holds the
# official openai client at an older release than the one sprig's own tests use.
#
#   bash scripts/clients_env.sh            # CLIENTS_ENV=DIR to build elsewhere
#
# None of them needs torch: they speak HTTP only.
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_DIR=${CLIENTS_ENV:-.venv-clients}
CLIENTS=(instructor==1.17.0 litellm==1.110.2 openai-agents==0.24.0)

python3 -m venv "$ENV_DIR"
# A download that arrives damaged (pip: "do not match the hashes") is fetched again.
install() { for attempt in 1 2 3; do "$ENV_DIR/bin/pip" install --quiet "$@" && return 0; echo "pip failed (attempt $attempt)"; sleep 5; done; return 1; }
install "${CLIENTS[@]}"
LITELLM_LOCAL_MODEL_COST_MAP=True "$ENV_DIR/bin/python" -c "import agents, instructor, litellm, openai
from importlib.metadata import version
print(*(f'{p} {version(p)}' for p in ('instructor', 'litellm', 'openai-agents', 'openai')), 'ready')"
