#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels that bench/gpu_check.sh installs on an offline GPU
# machine: every line of constraints/gpu-wheels.txt, --no-deps, for CPython $GPU_PY_VERSION (default 3.12,
# the GPU image's) on x86-64 Linux; packages PyPI has only as an sdist ("# build") are built here into
# pure-Python wheels. Then checks the folder the way `bench/gpu_check.sh --dry-run` does.
#
#   bench/gpu_wheels.sh [DIR]        (default: wheels/, ignored by git; `make gpu-wheels` runs this)
#
# Environment: GPU_PY_VERSION (3.12), PYTHON (python3: the python whose pip downloads).
set -euo pipefail
cd "$(dirname "$0")/.."

dest=${1:-wheels}
pyver=${GPU_PY_VERSION:-3.12}
py=${PYTHON:-python3}
manifest=constraints/gpu-wheels.txt

# name==version lines, without comments; the "# build" ones apart.
binary=()
build=()
while IFS= read -r line; do
    req=${line%%#*}
    req=${req//[[:space:]]/}
    [[ -z $req ]] && continue
    if [[ $line == *"# build"* ]]; then build+=("$req"); else binary+=("$req"); fi
done <"$manifest"

mkdir -p "$dest"
platforms=()
# pip matches a manylinux tag exactly: name the glibc levels the wheels of these packages use.
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 \
    manylinux1_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux_2_12_x86_64; do
    platforms+=(--platform "$p")
done

echo "gpu_wheels: ${#binary[@]} wheels for CPython $pyver into $dest/"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$dest" "${binary[@]}"
for req in "${build[@]}"; do
    echo "gpu_wheels: building $req (sdist only on PyPI) into a pure-Python wheel"
    "$py" -m pip wheel -q --no-deps -w "$dest" "$req"
done

"$py" bench/gpu_check.py --check-wheels --wheels "$dest" --python-version "$pyver"
