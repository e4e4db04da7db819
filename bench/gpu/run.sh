#!/usr/bin/env bash
# The GPU device check: one `run` call on the device machine, prepared here by
# bench/gpu/prepare.sh (bench/README.md, "On a GPU: the device check"):
#
#   run(command="bash bench/gpu/run.sh", carry=[".gpu"], timeout_s=570)
#
# 1. unpacks the carried Python packages (.gpu/site.tar.gz) into a target folder;
# 2. lays gpufeed out on PYTHONPATH without dependencies (the package's folders as
#    pyproject.toml maps them) with the carried C extensions (.gpu/ext/);
# 3. python -m bench.gpu.check: the machine, the CUDA layer's tests, the GPU bench,
#    each step bounded in time, and a log and a JSON of results in $OUT.
#
# Its arguments go to bench.gpu.check (--help lists them).
# `bash bench/gpu/run.sh --dry-run` does the same here, on the CPU: the carried
# packages are unpacked but left off the path (they are for Python 3.12), only
# the CUDA tests are picked (they skip) and the GPU rows say "no CUDA device"
# (tests/test_gpu_check.py runs it, so the script cannot rot between the sessions
# that have a GPU). $OUT defaults to
# bench/results/device-check; PYTHON to python3 (.venv's in a dry run).
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=""  # its arguments go to bench.gpu.check; --dry-run changes steps 1 and 2 too
case " $* " in *" --dry-run "*) dry=--dry-run ;; esac
gpu=${GPUFEED_GPU_DIR:-.gpu}
out=${OUT:-bench/results/device-check}
python=${PYTHON:-python3}
[ -n "$dry" ] && [ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
exec > >(tee "$out/device-check.log") 2>&1
tee_pid=$!
started=$SECONDS
say() { echo "[device-check $((SECONDS - started)) s] $*"; }

say "1/3 the carried packages"
path=""
if [ -f "$gpu/site.tar.gz" ]; then
    mkdir -p "$work/site" && tar xzf "$gpu/site.tar.gz" -C "$work/site"
    say "unpacked $(ls "$work/site" | grep -c dist-info) packages: $(cd "$work/site" && ls -d ./*.dist-info | sed 's|./||; s|.dist-info||' | tr '\n' ' ')"
    if [ -z "$dry" ]; then
        path=$work/site
        # nvImageCodec loads nvJPEG by name: the carried one, then the image's CUDA libraries.
        libs=$(find "$work/site/nvidia" -maxdepth 3 -type d -name lib | tr '\n' ':')
        export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:-}
    else
        say "dry run: left off the path (they are built for CPython 3.12)"
    fi
else
    say "no $gpu/site.tar.gz: run bench/gpu/prepare.sh first; going on with what is installed"
fi

say "2/3 gpufeed, without dependencies"
pkg=$work/pkg/gpufeed
mkdir -p "$pkg"
cp -r src/gpufeed/. "$pkg/"
find "$pkg" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
if ls "$gpu"/ext/*.so >/dev/null 2>&1; then
    cp "$gpu"/ext/* "$pkg/server/media/"  # _jpeg, and the libjpeg it loads from its folder
    if [ -f "$pkg/server/media/_augment.abi3.so" ]; then
        mv "$pkg/server/media/_augment.abi3.so" "$pkg/server/media/transforms/"
    fi
    say "C extensions: $(cd "$gpu/ext" && ls | tr '\n' ' ')(built by prepare.sh for the stable ABI)"
else
    say "no $gpu/ext: the JPEG fast path and the C kernels are missing; the check says which path ran"
fi
export PYTHONPATH=$work/pkg${path:+:$path}:$PWD
"$python" - <<'EOF' || say "gpufeed does not import (above)"
import gpufeed.server.media.jpeg as jpeg
print("gpufeed from", jpeg.__file__.rsplit("/server/", 1)[0] + ";", jpeg.describe())
EOF

say "3/3 python -m bench.gpu.check $*"
"$python" -m bench.gpu.check --out "$out" "$@"
code=$?
say "done, exit $code; $out: $(ls "$out" | tr '\n' ' ')"
exec >&- 2>&-
wait "$tee_pid"  # the log is whole before the script returns
exit $code
