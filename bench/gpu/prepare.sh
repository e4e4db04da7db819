#!/usr/bin/env bash
# Prepares the GPU device check (bench/gpu/run.sh) here, on a development machine:
# what the device machine lacks goes into .gpu/ (git-ignored), which the device
# tool's `run` carries there (carry: [".gpu"]). The device has Python 3.12, torch
# with CUDA and torchvision, and no network (bench/README.md, "On a GPU: the device check").
#
#   .gpu/site.tar.gz  the Python packages it lacks, installed here for CPython 3.12
#                     on manylinux x86-64: PyAV, grpcio with its health and
#                     reflection services, protobuf, nvImageCodec and nvJPEG. As
#                     wheels they are 72 MB, over the 64 MiB a run carries with the
#                     tree; installed and packed, without nvImageCodec's bindings for
#                     other Pythons and its OpenCV plug-in (PNG, WebP... on the CPU;
#                     the check decodes JPEGs), they are about 56 MB.
#   .gpu/ext/         gpufeed's two C extensions built here for CPython's stable ABI
#                     (abi3, 3.11 and later), which the 3.12 there loads as they are,
#                     beside the libjpeg-turbo they link (found through their rpath):
#                     the device image has neither libjpeg-turbo's headers nor its
#                     Debian library, and a CPU baseline on the PyAV fallback would
#                     not be a baseline. And, where nvcc is here, the nvimgcodec
#                     path's resample kernel (_resample.so, loaded through ctypes).
#
# Usage: bash bench/gpu/prepare.sh [--ext-only]
#   --ext-only  build .gpu/ext/ alone, no download (the dry run's test does this)
# GPUFEED_GPU_DIR overrides .gpu (the folder must be inside the checkout to travel).
set -euo pipefail
cd "$(dirname "$0")/../.."
gpu=${GPUFEED_GPU_DIR:-.gpu}
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
# Pinned: the device check must be the same from one session to the next.
packages=(av==19.0.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
          protobuf==7.36.2 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
limit=$((64 * 1024 * 1024))

build_extensions() {  # the flags of pyproject.toml's ext-modules, plus the stable ABI
    local ext=$gpu/ext include
    include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    rm -rf "$ext" && mkdir -p "$ext"
    if [ ! -f /usr/include/jpeglib.h ]; then
        echo "no libjpeg-turbo headers here (Debian: libjpeg62-turbo-dev): the check will" \
             "run the CPU rows on the PyAV fallback, and say so"
    else
        gcc -O3 -fPIC -shared -DPy_LIMITED_API=0x030B0000 -I"$include" \
            src/gpufeed/server/media/_jpeg.c -o "$ext/_jpeg.abi3.so" -ljpeg -Wl,-rpath,'$ORIGIN'
        cp -L "$(ldd "$ext/_jpeg.abi3.so" | awk '/libjpeg/ {print $3}')" "$ext/"
    fi
    gcc -O3 -ffp-contract=off -fno-trapping-math -fPIC -shared -DPy_LIMITED_API=0x030B0000 \
        -I"$include" src/gpufeed/server/media/transforms/_augment.c -o "$ext/_augment.abi3.so" -lm
    # The resample kernel (--decoder nvimgcodec): for the A100 and the H100, plus PTX for
    # newer chips; the CUDA runtime linked in, so it needs only the driver there.
    local nvcc
    nvcc=$(command -v nvcc || true)
    if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
    if [ -n "$nvcc" ]; then
        "$nvcc" -O3 -Xcompiler -fPIC -shared -gencode arch=compute_80,code=sm_80 \
            -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
            src/gpufeed/server/media/_resample.cu -o "$ext/_resample.so"
    else
        echo "no nvcc here: the nvimgcodec path will resample with torch, and say so"
    fi
    echo "built $(ls "$ext" | tr '\n' ' ')in $ext"
}

pack_site() {
    local staging
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' RETURN
    echo "downloading ${packages[*]} (cp312, manylinux x86-64)..."
    "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${platforms[@]}" -d "$staging/wheels" \
        "${packages[@]}"
    "$python" -m pip install -q --disable-pip-version-check --no-deps --no-index \
        --ignore-requires-python --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --target "$staging/site" "$staging"/wheels/*.whl
    find "$staging/site/nvidia/nvimgcodec" -name 'nvimgcodec_impl.cpython-*.so' \
        ! -name 'nvimgcodec_impl.cpython-312-*' -delete
    rm -f "$staging"/site/nvidia/nvimgcodec/extensions/libopencv_ext.so*
    find "$staging/site" -name __pycache__ -prune -exec rm -rf {} +
    tar czf "$gpu/site.tar.gz" -C "$staging/site" .
    echo "packed $(ls "$staging/wheels" | wc -l) packages into $gpu/site.tar.gz"
}

mkdir -p "$gpu"
build_extensions
[ "${1:-}" = --ext-only ] && exit 0
pack_site
# What a run carries: the files git would send (tracked, and untracked but not ignored)
# plus the carried folder.
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
carried=$(du -sb "$gpu" | cut -f1)
total=$((tree + carried))
awk -v c="$carried" -v t="$tree" -v g="$gpu" 'BEGIN { m = 1048576; printf \
    "carry: %.1f MiB of %s + %.1f MiB of tree = %.1f MiB of the 64 MiB a run takes\n", \
    c / m, g, t / m, (c + t) / m }'
if [ "$total" -gt "$limit" ]; then
    echo "over the limit: the device tool will refuse the run" >&2
    exit 1
fi
echo "ready: device run(command=\"bash bench/gpu/run.sh\", carry=[\"$gpu\"], timeout_s=570)"
