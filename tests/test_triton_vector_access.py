"""The layer's Triton kernels read and write their 16-bit rows as 16-byte vectors on a GPU.

``tests/vector_probe.py`` runs in a subprocess (Triton's interpreter off, the fake SM90 driver of
``fake_cuda_driver``: the real compiler down to PTX) and compiles the kernels with the layer's training
flags (bf16, packed, no bias, no conv states) at a head layout whose pre-conv row, ``C + 2 hv`` elements,
is not a multiple of 16 (hv = 4: Triton's ``% 16`` specialisation cannot show its rows are 16-byte aligned,
as under SP when a rank holds 4 value heads). In each kernel's tile loop (the PTX after the entry block)
it counts 2-byte global loads and stores, one element per instruction, and 4-byte ones (a row read two
elements at a time); the conv runs packed and as a padded batch of two rows. On an H200, with such accesses the
conv's dz pass takes 1.58 ms at 32k tokens and Qwen3-Next's shape; with 16-byte rows 0.92 ms
(docs/performance.md).

The count can fail: ``--negative-control`` compiles a row copy whose row stride is a runtime argument, and
the second test asserts the probe sees its 2-byte accesses. (Dropping the conv's ``X_ALIGN`` hint, the L2
norm's ``ALIGN`` hint or the constant packed row of the conv's ``_tile`` turns the first test red.)
"""
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
KERNELS = {"conv:_conv_fwd_kernel", "conv:_conv_dz_kernel", "conv:_conv_dx_kernel",
           "conv_dense:_conv_fwd_kernel", "conv_dense:_conv_dz_kernel", "conv_dense:_conv_dx_kernel",
           "conv_split:_conv_fwd_kernel", "conv_split:_conv_dz_kernel", "conv_split:_conv_dx_kernel",
           "l2norm:_l2norm_fwd_kernel", "l2norm:_l2norm_bwd_kernel",
           "norm:_norm_fwd_kernel", "norm:_norm_bwd_kernel"}


def probe(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(HERE / "vector_probe.py"), *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_tile_loops_access_16_bit_rows_as_vectors_only():
    found = probe()
    assert set(found) == KERNELS, set(found) ^ KERNELS
    # a few 4-byte accesses are not rows: the packed path's sequence index and start per token, the conv's
    # fp32 dweight partials and the norms' rstd; a 16-bit row read 2 elements at a time would add dozens
    scalar = {name: r for name, r in found.items()
              if r["scalar16_in_loop"] or r["scalar32_in_loop"] > 8 or not r["vector_in_loop"]}
    assert not scalar, scalar


def test_the_probe_sees_2_byte_accesses():
    found = probe("--negative-control")
    assert found["control:copy_rows"]["scalar16_in_loop"] > 0, found
