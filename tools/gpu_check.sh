#!/usr/bin/env bash
# The prepared GPU check of issue #33 (tools/gpu_check.py): installs the wheels carried in .whl/
# (packages the bare device image lacks), then runs every step under the run's time budget.
# Results: tools/results/bench_gpu_<gpu>.{json,md} and, where $OUT is set, copies there.
#
#   tools/gpu_check.sh [gpu_check.py options]      e.g. --steps env,measure,bench
#   tools/gpu_check.sh --fetch-wheels                 here, with network: fill .whl/ (ignored by git;
#                                                     name .whl in the device run's carry)
# The device run: the repository's root as the working directory, `.whl` carried, a limit of
# about 9 minutes (the steps' budget is 480 s, --budget; setup and the last merge come on top).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# What the device image lacks of the engine's and tools' imports (its package list:
# /work/.library/device/KINDS.md): gguf surely; msgspec, llguidance and pyzmq for the daemon's
# and constrained decoding's imports. Pinned as in this project's own environment.
WHEELS="gguf==0.19.0 msgspec==0.22.0 llguidance==1.9.1 pyzmq==27.3.0"
if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
    || echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p .whl
  for w in $WHEELS; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 -d .whl "$w" || exit 1
  done
  du -ch .whl/*.whl | tail -1
  exit 0
fi
START=$(date +%s)
export PYTHONUNBUFFERED=1
export MACE_CACHE_DIR="${MACE_CACHE_DIR:-/tmp/gpu_check/cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi || echo "gpu_check.sh: nvidia-smi failed"
SITE=""
# One wheel at a time, so one that does not install (another Python, say) costs only itself.
for whl in .whl/*.whl; do
  [ -e "$whl" ] || continue
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site "$whl"; then
    SITE=/tmp/gpu_check_site
  else
    echo "gpu_check.sh: $whl did not install; going on without it"
  fi
done
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check.sh: setup took $(( $(date +%s) - START )) s"
"$PY" tools/gpu_check.py --device "${GPU_CHECK_DEVICE:-cuda}" ${OUT:+--out "$OUT"} "$@"
echo "gpu_check.sh: $(( $(date +%s) - START )) s in all"
