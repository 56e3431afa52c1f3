#!/usr/bin/env bash
# Builds what the slow tests need, side by side: real vLLM on CPU (mostly downloads) and the test
# control plane (mostly compiling), each cached by version, so a cold CI run pays for the longer of
# the two rather than their sum.  Each build's output goes to a log, printed if it fails.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$(date +%s)
./scripts/install-vllm-env.sh >"$logs/vllm-env.log" 2>&1 &
vllm=$!
./scripts/build-control-plane.sh >"$logs/control-plane.log" 2>&1 &
plane=$!
status=0
for job in "vllm-env:$vllm" "control-plane:$plane"; do
  name=${job%%:*}
  if wait "${job##*:}"; then
    echo "test-prereqs: $name ready: $(tail -n 1 "$logs/$name.log")"
  else
    echo "test-prereqs: $name FAILED; its log:" >&2
    tail -n 60 "$logs/$name.log" >&2
    status=1
  fi
done
echo "test-prereqs: $(( $(date +%s) - start )) s"
exit $status
