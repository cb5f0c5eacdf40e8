"""kernels/cu_cache.py: what the kernels derive from a cu_seqlens tensor is built once per tensor and
version, rebuilt after an in-place change, and never keeps its tensor alive.

On a GPU these caches are what removes the per-layer host reads of cu_seqlens (device syncs); here
they are checked through their observable effects: how often a builder runs, object identity, the
values after an in-place refill, and (on the meta device, which has no values) that the host copy of
a tensor that came from the CPU is never read back from the device.
"""
import gc

import pytest
import torch

from gdn_layer.kernels import check_cu_seqlens, cu_cache, flash_qla_backend, ops_delta_rule, varlen
from gdn_layer.kernels.triton import conv_args
from gdn_layer import derived as derived_rule


def test_derived_builds_once_per_tensor_and_key():
    cu = torch.tensor([0, 3, 7])
    calls = []

    def build():
        calls.append(1)
        return cu.sum().item()
    assert cu_cache.derived(cu, "k", build) == 10
    assert cu_cache.derived(cu, "k", build) == 10
    assert len(calls) == 1
    assert cu_cache.derived(cu, "other", build) == 10 and len(calls) == 2
    other = torch.tensor([0, 3, 7])                      # equal values, another tensor: its own entry
    cu_cache.derived(other, "k", build)
    assert len(calls) == 3


def test_derived_rebuilds_after_in_place_change():
    cu = torch.tensor([0, 3, 7])
    first = cu_cache.derived(cu, "lens", lambda: (cu[1:] - cu[:-1]).tolist())
    cu.copy_(torch.tensor([0, 5, 6]))                    # a refilled buffer: same object, new version
    assert first == [3, 4]
    assert cu_cache.derived(cu, "lens", lambda: (cu[1:] - cu[:-1]).tolist()) == [5, 1]


def test_entries_leave_with_their_tensor():
    before = len(derived_rule._CACHE)
    cu = torch.tensor([0, 4])
    cu_cache.derived(cu, "x", lambda: torch.zeros(3))
    cu_cache.host_copy(cu)
    assert len(derived_rule._CACHE) == before + 1
    del cu
    gc.collect()
    assert len(derived_rule._CACHE) == before


def test_as_int64_shares_one_copy_per_version():
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    a = check_cu_seqlens(cu, 9)
    b = check_cu_seqlens(cu, 9)
    assert a is b and a.dtype == torch.int64 and a.tolist() == [0, 2, 9]
    cu[1] = 5                                            # in place: the next call sees the new values
    c = check_cu_seqlens(cu, 9)
    assert c is not a and c.tolist() == [0, 5, 9] and a.tolist() == [0, 2, 9]
    int64 = torch.tensor([0, 9])
    assert check_cu_seqlens(int64, 9) is int64           # CPU int64: the caller's tensor itself


def test_accelerator_copy_is_new_per_version_and_knows_its_host_values():
    # meta stands in for an accelerator: it holds no values, so reading them back would raise
    cu = torch.tensor([0, 2, 9])
    dev = cu_cache.as_int64(cu, torch.device("meta"))
    assert dev.device.type == "meta" and dev is cu_cache.as_int64(cu, torch.device("meta"))
    assert cu_cache.host_copy(dev).tolist() == [0, 2, 9]
    cu[1] = 4
    dev2 = cu_cache.as_int64(cu, torch.device("meta"))
    assert dev2 is not dev and cu_cache.host_copy(dev2).tolist() == [0, 4, 9]


def test_dense_pack_boundaries_are_shared_and_known_on_host():
    a = ops_delta_rule.dense_cu(3, 5, torch.device("meta"))
    assert a is ops_delta_rule.dense_cu(3, 5, torch.device("meta"))
    assert cu_cache.host_copy(a).tolist() == [0, 5, 10, 15]
    cpu = ops_delta_rule.dense_cu(2, 4, torch.device("cpu"))
    assert cpu.tolist() == [0, 4, 8]


def test_flash_qla_compaction_is_built_once(monkeypatch):
    calls = []
    real = varlen.without_empty_segments

    def counting(cu):
        calls.append(cu)
        return real(cu)
    monkeypatch.setattr(varlen, "without_empty_segments", counting)
    cu = torch.tensor([0, 3, 3, 8])
    c1, c2 = flash_qla_backend._compact(cu), flash_qla_backend._compact(cu)
    assert len(calls) == 1 and c1 is c2
    assert c1.cu.tolist() == [0, 3, 8] and c1.keep.tolist() == [0, 2]
    cu.copy_(torch.tensor([0, 4, 6, 8]))                 # refilled: no empty segment any more
    assert flash_qla_backend._compact(cu) is None and len(calls) == 2


@pytest.mark.parametrize("refill", [False, True])
def test_conv_sequence_index_follows_the_values(refill):
    cu = torch.tensor([0, 2, 2, 6])
    first = conv_args._seq_index(cu, 6)
    assert conv_args._seq_index(cu, 6) is first
    assert first.tolist() == [0, 0, 2, 2, 2, 2]
    if refill:
        cu.copy_(torch.tensor([0, 1, 5, 6]))
        assert conv_args._seq_index(cu, 6).tolist() == [0, 1, 1, 1, 1, 2]


def test_inference_tensors_are_never_cached():
    # no version counter: a buffer refilled under inference_mode must still give its new values
    with torch.inference_mode():
        cu = torch.tensor([0, 2, 2, 6])
        assert conv_args._seq_index(cu, 6).tolist() == [0, 0, 2, 2, 2, 2]
        cu.copy_(torch.tensor([0, 1, 5, 6]))
        assert conv_args._seq_index(cu, 6).tolist() == [0, 1, 1, 1, 1, 2]
        dev = cu_cache.as_int64(cu, torch.device("meta"))
        cu.copy_(torch.tensor([0, 3, 4, 6]))
        assert cu_cache.as_int64(cu, torch.device("meta")) is not dev


def test_known_never_builds_and_follows_the_version():
    cu = torch.tensor([0, 3, 7])
    assert derived_rule.known(cu, "host") is None and derived_rule.known(cu, "lens") is None
    cu_cache.derived(cu, "lens", lambda: [3, 4])
    assert derived_rule.known(cu, "lens") == [3, 4]
    cu.copy_(torch.tensor([0, 1, 7]))                    # refilled: what was kept is stale, not served
    assert derived_rule.known(cu, "lens") is None


def _meta_with_host(values):
    """An "accelerator" cu_seqlens (meta: reading its values would raise) whose host values the layer knows."""
    return cu_cache.as_int64(torch.tensor(values), torch.device("meta"))


def test_padding_and_compaction_keep_the_host_values_known(monkeypatch):
    from gdn_layer.parallel import packing, pad_cu_seqlens
    monkeypatch.setattr(packing, "check_cu_seqlens", lambda cu, total_len: None)   # (it refuses meta tensors)
    padded = pad_cu_seqlens(_meta_with_host([0, 300, 300, 1000]), 6)
    assert padded.device.type == "meta"
    assert cu_cache.known_host(padded).tolist() == [0, 300, 300, 1000, 1000, 1000, 1000]
    c = varlen.without_empty_segments(padded)           # host values known: nothing is read back
    assert c.cu.device.type == "meta" and cu_cache.known_host(c.cu).tolist() == [0, 300, 1000]
    assert c.num_seqs == 6 and c.keep.shape == (2,)
    again = cu_cache.as_int64(padded, torch.device("meta"))   # the layer's own copy knows them too
    assert again is not padded and cu_cache.known_host(again).tolist() == cu_cache.known_host(padded).tolist()
    unknown = torch.zeros(5, dtype=torch.int64, device="meta")
    assert cu_cache.known_host(unknown) is None and cu_cache.known_host(pad_cu_seqlens(unknown, 6)) is None
