#!/usr/bin/env bash
# Builds the import stubs (*_stub.c + *.map) into one directory: .ci/stubs/build.sh [OUT_DIR]
# (default build/ci-stubs). Each output is named by its soname (libcuda.so.1, ...), for LD_LIBRARY_PATH in
# the wheel matrix's venvs only (.ci/wheels); nothing is installed anywhere. docs/native-client.md,
# "Wheel matrix", says why each exists.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../build/ci-stubs}
CC=${CC:-cc}
mkdir -p "$out"
# name of the source  soname it provides
while read -r stem soname; do
    "$CC" -shared -fPIC -O2 -Wall -Wextra -Werror -fvisibility=hidden \
        -Wl,--version-script="$here/$stem.map" -Wl,-soname,"$soname" -Wl,--no-undefined \
        -o "$out/$soname.tmp" "$here/${stem}_stub.c"
    mv -f "$out/$soname.tmp" "$out/$soname"
done <<'LIST'
libcuda libcuda.so.1
libmlx5 libmlx5.so.1
libfabric libfabric.so.1
libamdhip64 libamdhip64.so.7
libhsa-runtime64 libhsa-runtime64.so.1
LIST
echo "stubs built in $out: $(cd "$out" && ls | tr '\n' ' ')"
