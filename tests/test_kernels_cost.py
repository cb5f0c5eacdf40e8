"""The torch backend (the CPU path) costs O(T) for any mix of sequence lengths, and a long input's
inference memory grows with T * hidden only; its chunk layout is exact however the chunks are grouped.

Memory is the peak of torch's CPU allocator during the call above the level before it (torch's
profiler with ``profile_memory=True``), under ``torch.no_grad()``.
"""
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule, reference
from gdn_layer.kernels.varlen import ChunkPlan
from oracle import naive_gated_delta_rule


def peak_bytes(fn, tmp_path) -> int:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e["args"] for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - base


def cu_of(lengths):
    return torch.tensor([0, *lengths]).cumsum(0)


def delta_inputs(lengths, Hk=1, Hv=2, D=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.randn(1, T, Hk, D, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(1, T, Hv, D, generator=gen, dtype=dtype)
    g = -0.1 * torch.rand(1, T, Hv, generator=gen, dtype=dtype)
    beta = torch.rand(1, T, Hv, generator=gen, dtype=dtype)
    return q, k, v, g, beta


ONE_LONG = [2048]
ONE_LONG_AND_SHORT = [2048] + [1] * 127


def test_chunk_memory_of_one_long_plus_127_one_token_documents_stays_within_1_5x_of_the_long_one(tmp_path):
    def run(lengths):
        x = delta_inputs(lengths)
        return peak_bytes(lambda: chunk_gated_delta_rule(*x, cu_seqlens=cu_of(lengths), use_qk_l2norm=True,
                                                         output_final_state=True, backend="torch"), tmp_path)
    alone, mixed = run(ONE_LONG), run(ONE_LONG_AND_SHORT)
    assert mixed <= 1.5 * alone, f"{mixed / 2**20:.1f} MB with 127 one-token documents vs {alone / 2**20:.1f} MB"


def test_recurrent_memory_of_a_pack_is_within_1_5x_of_its_documents_run_apart(tmp_path):
    """Every running sequence holds a state (N * Hv * Dk * Dv), so the bound is the sum of the parts."""
    def run(lengths):
        x = delta_inputs(lengths)
        return peak_bytes(lambda: recurrent_gated_delta_rule(*x, cu_seqlens=cu_of(lengths), use_qk_l2norm=True,
                                                             output_final_state=True, backend="torch"), tmp_path)
    long, shorts, mixed = run([512]), run([1] * 127), run([512] + [1] * 127)
    assert mixed <= 1.5 * (long + shorts), f"{mixed / 2**20:.2f} MB vs {long / 2**20:.2f} + {shorts / 2**20:.2f} MB"


def test_conv_memory_of_one_long_plus_127_one_token_documents_stays_within_1_5x_of_the_long_one(tmp_path):
    def run(lengths):
        x = torch.randn(1, sum(lengths), 64)
        w = torch.randn(64, 4)
        h0 = torch.randn(len(lengths), 64, 3)
        return peak_bytes(lambda: causal_conv1d(x, w, cu_seqlens=cu_of(lengths), initial_state=h0,
                                                output_final_state=True, backend="torch"), tmp_path)
    alone, mixed = run(ONE_LONG), run(ONE_LONG_AND_SHORT)
    assert mixed <= 1.5 * alone, f"{mixed / 2**20:.1f} MB with 127 one-token documents vs {alone / 2**20:.1f} MB"


def test_layer_memory_of_one_long_plus_127_one_token_documents_stays_within_1_5x_of_the_long_one(tmp_path):
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 2, 4, 64, 64, backend="torch")

    def run(lengths):
        x = torch.randn(1, sum(lengths), 256)
        return peak_bytes(lambda: layer(x, cu_seqlens=cu_of(lengths)), tmp_path)
    alone, mixed = run(ONE_LONG), run(ONE_LONG_AND_SHORT)
    assert mixed <= 1.5 * alone, f"{mixed / 2**20:.1f} MB with 127 one-token documents vs {alone / 2**20:.1f} MB"


def test_long_input_inference_memory_grows_with_tokens_times_hidden_only(tmp_path):
    """The per-chunk C x C matrices of all chunks at once would cost ~45x the input here."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, 16, 16, backend="torch")
    short, long = torch.randn(1, 4096, 64), torch.randn(1, 32768, 64)
    peak_short = peak_bytes(lambda: layer(short), tmp_path)
    peak_long = peak_bytes(lambda: layer(long), tmp_path)
    input_bytes = long.numel() * long.element_size()
    assert peak_long <= 16 * input_bytes, f"{peak_long / input_bytes:.1f}x the input"
    assert peak_long / long.shape[1] <= 1.1 * peak_short / short.shape[1], "memory grows faster than T"


# ------------------------------------------------------------------------------------------------------
# the layout itself: exact whatever the grouping of chunks

ONE_CHAIN = [0, 1, 70, 5, 130, 0, 64, 3, 200, 63]  # empty, one-token, straddling: no start on a chunk edge
# sequences that start on chunk edges (with a state, each sequence has 16 more rows: Dk virtual tokens),
# so chunks form 7 or more chains side by side, with 2 sequences in one chunk and an empty one
MANY_CHAINS = {False: [128, 64, 192, 0, 64, 20, 44, 128, 70, 58, 64], True: [112, 48, 176, 48, 0, 32, 112, 54, 42, 48]}


@pytest.mark.parametrize("window", [1, 2, 3, 16])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("pack", ["one_chain", "many_chains"])
def test_chunk_equals_the_literal_oracle_for_any_number_of_chunks_per_window(pack, window, with_state, monkeypatch):
    lengths = ONE_CHAIN if pack == "one_chain" else MANY_CHAINS[with_state]
    chains = ChunkPlan(lengths, 16 if with_state else 0, 64, window, torch.device("cpu")).active[0]
    assert chains == 1 if pack == "one_chain" else chains >= 7
    monkeypatch.setattr(reference, "WINDOW", window)
    q, k, v, g, beta = delta_inputs(lengths, Hk=2, Hv=4, D=16, dtype=torch.float64, seed=window)
    cu = cu_of(lengths)
    h0 = torch.randn(len(lengths), 4, 16, 16, dtype=torch.float64) if with_state else None
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, use_qk_l2norm=True)
    o_ref, final_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("pack", ["one_chain", "many_chains"])
def test_chunk_grads_equal_the_recurrence_grads_for_any_number_of_chunks_per_window(pack, window, monkeypatch):
    monkeypatch.setattr(reference, "WINDOW", window)
    lengths = ONE_CHAIN if pack == "one_chain" else MANY_CHAINS[True]
    inputs = [x.requires_grad_() for x in delta_inputs(lengths, Hk=2, Hv=4, D=16, dtype=torch.float64, seed=1)]
    h0 = torch.randn(len(lengths), 4, 16, 16, dtype=torch.float64, requires_grad=True)
    cu = cu_of(lengths)
    grads = []
    for kernel in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, final = kernel(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True)
        loss = (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)).sum() + final.sin().sum()
        grads.append(torch.autograd.grad(loss, [*inputs, h0]))
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], *grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"grad of {n}: {m}")
