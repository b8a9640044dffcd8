#!/usr/bin/env bash
# The GPU checks of a new node in one run of at most 7 minutes: the node self-test
# (python3 -m ditfleet.workers.selftest; docs/performance.md says what each line means).
# Replaces the earlier three-script session, whose step limits added up to 840 s.
#
#   OUT=/tmp/selftest bash bench/gpu_session.sh          # then read $OUT/selftest.jsonl and selftest.log
#
# Needs the node's own python3 with torch >= 2.11 (CUDA), safetensors, numpy, pillow, pyarrow;
# never Ray, pydantic or boto3. diffusers is used when importable; without network, bring its
# wheel: `pip download --no-deps -d wheels/ diffusers` elsewhere, then here
# `pip install --no-deps --no-index wheels/*`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ditfleet-selftest}
PY=${PY:-python3}
mkdir -p "$OUT"
if ! $PY -c "import ditfleet.workers.selftest" 2>/dev/null; then
  # the layers install as ditfleet.<layer>: an editable install maps them, without dependencies
  LOG=${TMPDIR:-/tmp}/ditfleet-selftest-install.log   # not in $OUT: it gets the two result files only
  $PY -m pip install --no-deps --no-build-isolation -e . > "$LOG" 2>&1 || {
    echo "could not install ditfleet (see $LOG)" >&2; exit 2; }
fi
exec env PYTHONUNBUFFERED=1 $PY -m ditfleet.workers.selftest --out "$OUT" "$@"
