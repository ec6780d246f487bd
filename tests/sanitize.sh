#!/usr/bin/env bash
# Runs the native tests, the native fuzz suite, the leak test and the staged-transfer driver tests against an
# AddressSanitizer + UndefinedBehaviorSanitizer build of the extension.
#
# Usage: tests/sanitize.sh [pytest args]      (default: the test files listed below)
# Env:   SANITIZE_DIR (build/work folder, default build/sanitize in this checkout; a CMake cache left there by
#        another checkout is discarded, never reused)
#        SANITIZE_DRIVER=0 skips the driver tests (they need the mooncake package).
#        SANITIZE_BUILD_ONLY=1 stops after the build (CI builds while the main tests run, then runs this again).
#
# Works from a fresh clone with python3, pip, cmake, ninja and g++: pybind11 is taken from the interpreter
# or, when missing, pip-installed into the work folder (nothing global). Exits non-zero when a test fails
# or when either sanitizer reports anything (reports are logged to files and printed at the end; UBSan
# halts on the first error).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${SANITIZE_DIR:-$root/build/sanitize}
mkdir -p "$work"
# A build folder configured from another source tree makes CMake refuse to run: start that one afresh.
cache="$work/build/CMakeCache.txt"
if [[ -f $cache ]] && ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$cache"; then
    echo "sanitize: $work/build was configured for another source tree; rebuilding it" >&2
    rm -rf "$work/build"
fi

if ! pybind11_dir=$(python3 -m pybind11 --cmakedir 2>/dev/null); then
    python3 -m pip install --quiet --target "$work/pydeps" pybind11
    pybind11_dir=$(PYTHONPATH="$work/pydeps" python3 -m pybind11 --cmakedir)
fi
cxx=${CXX:-g++}
# -O1 -g1: ASan's recommended level, line tables for the reports, and a cold build several times faster than at
# -O2 -g (docs/development.md, "Sanitizer leg").
cmake -S "$root" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVADDR_SANITIZE=ON \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DCMAKE_CXX_COMPILER="$cxx" -Dpybind11_DIR="$pybind11_dir" >/dev/null
cmake --build "$work/build"
if [[ ${SANITIZE_BUILD_ONLY:-0} == 1 ]]; then exit 0; fi
rm -rf "$work/pkg" "$work/reports" && mkdir -p "$work/pkg" "$work/reports"
cp -r "$root/python/mooncake_kvaddr" "$work/pkg/"
rm -f "$work/pkg/mooncake_kvaddr"/_native*.so
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
tests=(test_prepare_values.py test_differential.py test_keys_native.py test_pool_keys_walk_and_hash_views.py
       test_threads.py test_staging.py test_native_hostile_inputs.py test_fuzz_native.py test_leaks.py
       test_layouts.py test_rows_native.py test_layouts_and_transfer_screen_hostile.py test_region_pin.py
       test_native_argument_conversion.py test_driver_ownership_and_close.py)
tests+=(test_ranges.py)
if [[ ${SANITIZE_DRIVER:-1} != 0 ]] && python3 -c "import mooncake.store" 2>/dev/null; then
    tests+=(test_transfer_modes.py test_transfer.py test_transfer_safety.py test_staged_plan.py
            test_native_client.py test_native_client_driver.py test_address_forms.py)
fi
# pytest runs from tests/: accept test paths given from the repository root too (tests/test_x.py).
if (($#)); then
    args=()
    for arg in "$@"; do
        if [[ $arg == tests/* && -e "$root/$arg" ]]; then args+=("${arg#tests/}"); else args+=("$arg"); fi
    done
    set -- "${args[@]}"
fi
libasan=$(${cxx} -print-file-name=libasan.so)
libubsan=$(${cxx} -print-file-name=libubsan.so)
cd "$root/tests"
status=0
LD_PRELOAD="$libasan:$libubsan" \
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$work/reports/asan" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/reports/ubsan" \
KVADDR_SANITIZE=1 PYTHONPATH="$work/pkg:$root/tests" \
    python3 "$work/run.py" "$work/pkg" -q -p no:cacheprovider -c "$root/pyproject.toml" -W ignore::DeprecationWarning \
    "${@:-${tests[@]}}" \
    || status=$?
if compgen -G "$work/reports/*" >/dev/null; then
    echo "sanitizer reports:" >&2
    cat "$work/reports"/* >&2
    [[ $status == 0 ]] && status=1
fi
exit $status
