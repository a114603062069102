#!/bin/sh
# Installs vLLM 0.32.0 for serving on the card, without its CUDA dependencies, into the
# environment whose pip is given (default: .venv/bin/pip). Two pip calls, because pip
# cannot install some packages of one command with --no-deps.
set -eu
pip="${1:-.venv/bin/pip}"
here="$(dirname "$0")"
"$pip" install -q -r "$here/vllm.txt" -c "$here/vllm-constraints.txt"
"$pip" install -q --no-deps -r "$here/vllm-no-deps.txt"
