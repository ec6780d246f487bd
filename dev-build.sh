#!/usr/bin/env bash
# Rebuild the native module in place for an editable install (after `pip install --no-build-isolation -e .
# -Cbuild-dir=build`): compiles build/ and copies the module where the editable install loads it from.
set -euo pipefail
cd "$(dirname "$0")"
cmake --build build
dest=$(python3 -c "import importlib.util,os; print(os.path.dirname(importlib.util.find_spec('mooncake_kvaddr._native').origin))")
# Copy, then rename into place: overwriting the loaded file in place would crash running Python processes.
for so in build/_native*.so; do
    cp "$so" "$dest/.tmp.$(basename "$so")"
    mv -f "$dest/.tmp.$(basename "$so")" "$dest/$(basename "$so")"
done
