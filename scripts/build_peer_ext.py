"""Compile a peer's CUDA extension from its unpacked sdist with torch.utils.cpp_extension.load.

    python scripts/build_peer_ext.py selective_scan <mamba_ssm src dir> <out dir>
    python scripts/build_peer_ext.py causal_conv1d <causal_conv1d src dir> <out dir>

The built module (selective_scan_cuda / causal_conv1d_cuda) is left in <out dir> (on PYTHONPATH).
"""
import glob
import os
import shutil
import sys
import time

from torch.utils.cpp_extension import load

NVCC = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
        "-gencode", "arch=compute_90,code=sm_90"]


def main():
    which, src, out = sys.argv[1], sys.argv[2], sys.argv[3]
    t0 = time.time()
    if which == "selective_scan":
        name, d = "selective_scan_cuda", os.path.join(src, "csrc", "selective_scan")
    elif which == "causal_conv1d":
        name, d = "causal_conv1d_cuda", os.path.join(src, "csrc")
    else:
        raise SystemExit(f"which: expected selective_scan or causal_conv1d, got {which!r}")
    sources = sorted(glob.glob(os.path.join(d, "*.cpp")) + glob.glob(os.path.join(d, "*.cu")))
    build = os.path.join(out, "build-" + name)
    os.makedirs(build, exist_ok=True)
    mod = load(name=name, sources=sources, extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=NVCC,
               extra_include_paths=[d], build_directory=build, verbose=False)
    for so in glob.glob(os.path.join(build, name + "*.so")):
        shutil.copy(so, out)
    print(f"built {name} in {time.time() - t0:.0f}s: {mod.__file__}")


if __name__ == "__main__":
    main()
