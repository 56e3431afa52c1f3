#!/usr/bin/env bash
# Builds what the slow tests need, side by side: real vLLM on CPU (mostly downloads) and the Go
# programs (the test control plane and what users run beside kvpilot; mostly compiling), each cached
# by version, so a cold CI run pays for the longer of the two rather than their sum.  Each build's output goes to a log, printed if it fails.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$(date +%s)
./scripts/install-vllm-env.sh >"$logs/vllm-env.log" 2>&1 &
vllm=$!
./scripts/build-go-programs.sh >"$logs/go-programs.log" 2>&1 &
goprograms=$!
status=0
for job in "vllm-env:$vllm" "go-programs:$goprograms"; do
  name=${job%%:*}
  if wait "${job##*:}"; then
    echo "test-prereqs: $name ready: $(tail -n 1 "$logs/$name.log")"
    # Each Go program's own build time, for the cold-CI budget.
    grep -h "^go-programs: [a-z-]* in " "$logs/$name.log" | sed 's/^/test-prereqs: /' || true
  else
    echo "test-prereqs: $name FAILED; its log:" >&2
    tail -n 60 "$logs/$name.log" >&2
    status=1
  fi
done
echo "test-prereqs: $(( $(date +%s) - start )) s"
exit $status
