"""No recompilation when the packed layout changes: Triton's real compiler on CPU, counted.

``tests/compile_probe.py`` runs in a subprocess (Triton's interpreter off, a fresh cache, a fake SM90
driver whose launches do nothing) and calls every kernel of the layer's CUDA path -- our Triton
kernels and fla's chunk forward/backward and fused recurrent forward -- at 64 packed layouts,
T in {1000, 1025, 2047, 3001, 4096, 5000, 7777, 8192} x N in {1, 2, 3, 5, 9, 17, 33, 64}. Everything
compiles at the first layout and nothing after it.

The counter can fail: ``--negative-control`` runs a kernel with ``T: tl.constexpr``, which recompiles
at every new T, and the second test asserts the probe sees that. (Making a length argument of one of
our kernels ``tl.constexpr`` turns the first test red the same way; ``scan_triton.py`` catches it
statically as well.) FlashQLA's TileLang kernels cannot go through a Triton driver: they are covered
by ``benchmarks/compile_check.py`` on the GPU.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
FLA_SITE = HERE.parent / ".venv" / "fla-site"     # fla-core kept out of the test venv (scripts/setup.sh)


def probe(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FLA_SITE), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(HERE / "compile_probe.py"), *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def full_probe():
    if not (FLA_SITE / "fla").is_dir():
        pytest.fail(f"fla-core is not installed in {FLA_SITE}: run scripts/setup.sh")
    return probe("--host-reads")


@pytest.mark.slow
def test_new_packed_layouts_compile_nothing_on_the_cuda_path(full_probe):
    r = full_probe
    assert r["first"] > 0, "nothing compiled: the probe did not reach Triton's compiler"
    assert r["after_first"] == 0, [x for x in r["layouts"] if x["compiles"]]
    assert len(r["layouts"]) == 64


@pytest.mark.slow
def test_fla_chunk_forward_and_backward_read_nothing_on_the_host(full_probe):
    """No sync and no host-built tensor in fla's chunk path over 63 new layouts: its chunk index is built on
    the device (``fla_backend.chunk_index``). Red with fla's ``prepare_chunk_indices``, whose
    ``repeat_interleave`` reads the chunk count on the host."""
    assert full_probe["host_reads"] == []


def test_the_probe_sees_a_length_specialised_kernel_recompile():
    r = probe("--negative-control", "--lengths", "1000", "1025", "2047", "--counts", "1")
    assert r["first"] == 1 and r["after_first"] == 2
