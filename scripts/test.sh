#!/usr/bin/env bash
# Set up (tests included) and run the whole test suite. A run that collects no test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
