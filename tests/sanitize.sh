#!/usr/bin/env bash
# Runs the native-kernel tests against an AddressSanitizer + UBSan build of the extension (not part of CI:
# slow). Usage: tests/sanitize.sh [pytest args]. Needs the dev install's build tools (cmake, ninja, pybind11).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${SANITIZE_DIR:-/tmp/mooncake_kvaddr_sanitize}
cmake -S "$root" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVADDR_SANITIZE=ON \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >/dev/null
cmake --build "$work/build"
rm -rf "$work/pkg" && mkdir -p "$work/pkg"
cp -r "$root/python/mooncake_kvaddr" "$work/pkg/"
cp "$work/build"/_native*.so "$work/pkg/mooncake_kvaddr/"
cat > "$work/run.py" <<'PY'
import sys
# An editable install's import hook would load the regular module: drop it so PYTHONPATH wins.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (type(f).__module__ + type(f).__name__).lower()]
import pytest
import mooncake_kvaddr._native as native
assert native.__file__.startswith(sys.argv[1]), native.__file__
sys.exit(pytest.main(sys.argv[2:]))
PY
tests=(test_prepare_values.py test_differential.py test_keys_native.py test_keys_and_hashes.py test_threads.py
       test_staging.py)
cd "$root/tests"
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
PYTHONPATH="$work/pkg:$root/tests" \
    python3 "$work/run.py" "$work/pkg" -q -p no:cacheprovider -c "$root/pyproject.toml" "${@:-${tests[@]}}"
