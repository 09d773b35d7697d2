#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 4.0.0b36, CuTe DSL) on a GPU machine that reaches no registry, for torch's
# activate_flash_attention_impl("FA4"). Its wheels are 102 MB, nvidia-cutlass-dsl-libs-cu13's 92 MB of them,
# over one call's 64 MiB: the libs' two large shared objects travel xz-compressed (50 + 13 MB), the first in a
# call of its own, kept in /tmp while the machine stays warm.
#   here:   pip download --no-deps (py3.12, manylinux) flash-attn-4==4.0.0b36 nvidia-cutlass-dsl-libs-base==4.8.1
#           nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi torch-c-dlpack-ext
#           quack-kernels; unpack libs-cu13, xz its _cutlass_ir.cu13*.so (→ A/ir.so.xz) and cu13/lib/libcute_dsl_runtime.so
#           (→ B/rt.so.xz), tar the rest (→ B/cu13-lite.tgz), the other wheels into B/
#   there:  bash bench/carry_fa4.sh stage A        (first call: keeps ir.so.xz in /tmp/fa4)
#           bash bench/carry_fa4.sh install B      (next call: installs into /tmp/site; then source the exports)
set -eu
site=/tmp/site
case $1 in
  stage) mkdir -p /tmp/fa4 && cp "$2"/ir.so.xz /tmp/fa4/ ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site "$2"/*.whl
    tar xzf "$2"/cu13-lite.tgz -C $site
    xz -dc /tmp/fa4/ir.so.xz >$site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
    xz -dc "$2"/rt.so.xz >$site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
    echo "export PYTHONPATH=\${PYTHONPATH:-.}:$site:$site/nvidia_cutlass_dsl/dsl_packages" ;;
esac
