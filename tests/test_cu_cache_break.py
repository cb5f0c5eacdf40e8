"""kernels/cu_cache.py under attack: the ways a cu_seqlens tensor can change or be reused while the cache
holds what was derived from it. Each case compares against what an uncached computation gives (a
fresh clone of the values, or the float64 torch reference)."""
import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import check_cu_seqlens, cu_cache, ops_delta_rule
from gdn_layer import derived as derived_rule


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(32, 2, 4, 16, 8, backend="torch")
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
    return layer


def test_an_inference_mode_pass_does_not_break_training_on_the_same_cu():
    # an evaluation under inference_mode, then training with the same (normal) cu_seqlens tensor:
    # what the eval pass derived from cu must not come back as inference tensors, which autograd
    # refuses to save for backward
    layer = _layer()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    x = torch.randn(1, 12, 32)
    with torch.inference_mode():
        y_eval = layer(x, cu_seqlens=cu)
    assert not check_cu_seqlens(cu, 12).is_inference()
    xg = x.clone().requires_grad_(True)
    y = layer(xg, cu_seqlens=cu)
    y.sum().backward()
    xr = x.clone().requires_grad_(True)
    y_ref = layer(xr, cu_seqlens=cu.clone())        # a fresh tensor: nothing cached for it
    y_ref.sum().backward()
    assert torch.allclose(y, y_ref, atol=1e-6) and torch.allclose(y_eval, y_ref, atol=1e-6)
    assert torch.allclose(xg.grad, xr.grad, atol=1e-6)


def test_dense_pack_made_first_under_inference_mode_still_knows_its_host_values():
    # dense_cu keeps its tensor across calls (derived_from_sizes): one made under inference_mode would be an
    # inference tensor for good, with nothing recorded for it (no version counter), so every later
    # dense call would read it back from the device (meta: no values to read)
    ops_delta_rule._DENSE_CU.clear()
    with torch.inference_mode():
        a = ops_delta_rule.dense_cu(3, 7, torch.device("meta"))
        assert cu_cache.host_copy(a).tolist() == [0, 7, 14, 21]
    assert ops_delta_rule.dense_cu(3, 7, torch.device("meta")) is a and not a.is_inference()
    assert cu_cache.host_copy(a).tolist() == [0, 7, 14, 21]


def test_dense_pack_host_values_stay_on_the_host_under_a_default_device():
    # torch.set_default_device("cuda") (or `with torch.device(...)`) is common in training scripts: the
    # recorded host values must still be on the CPU, or every host read of them is a device read
    ops_delta_rule._DENSE_CU.clear()
    with torch.device("meta"):
        a = ops_delta_rule.dense_cu(2, 3, torch.device("meta"))
    host = cu_cache.host_copy(a)
    assert host.device.type == "cpu" and host.tolist() == [0, 3, 6]


def test_many_live_cu_tensors_do_not_grow_the_cache_without_bound():
    # a dataset of stored packs (the same cu tensor objects every epoch, e.g. a map-style dataset read
    # with num_workers=0) keeps every cu alive: what was derived from each (on a GPU: the int64 copy,
    # the conv's [T] sequence index, fla's chunk index) must not stay with all of them
    from gdn_layer.kernels.triton import conv_args
    gen = torch.Generator().manual_seed(0)
    T = 64
    hot = torch.tensor([0, 20, 64], dtype=torch.int32)           # the pack every step sees
    hot_copy = check_cu_seqlens(hot, T)
    packs = []
    for i in range(600):
        inner = torch.randint(0, T + 1, (3,), generator=gen).sort().values
        cu = torch.cat([torch.tensor([0]), inner, torch.tensor([T])]).to(torch.int32)
        packs.append(cu)
        x = check_cu_seqlens(cu, T)
        assert conv_args._seq_index(x, T).tolist() == (
            torch.searchsorted(cu.long(), torch.arange(T), right=True) - 1).tolist()
        assert check_cu_seqlens(hot, T) is hot_copy                # still kept while in use
    assert len(derived_rule._CACHE) <= 200
    for cu in packs[:5]:                                          # dropped ones are rebuilt, right
        x = check_cu_seqlens(cu, T)
        assert x.tolist() == cu.tolist()
        assert conv_args._seq_index(x, T).tolist() == (
            torch.searchsorted(cu.long(), torch.arange(T), right=True) - 1).tolist()


def _refilled_by_broadcast(rank, world_size):
    # rank 0 builds each batch's boundaries and broadcasts them into every rank's cu_seqlens buffer:
    # torch.distributed's collectives write without bumping the buffer's version counter
    import torch.distributed as dist
    from gdn_layer.kernels.triton import conv_args
    layer = _layer()
    buf = torch.zeros(4, dtype=torch.int32)
    T = 12
    got = []
    for lay in ([0, 3, 7, 12], [0, 6, 6, 12], [0, 1, 11, 12]):
        if rank == 0:
            buf.copy_(torch.tensor(lay))
        dist.broadcast(buf, 0)
        x = check_cu_seqlens(buf, T)
        assert buf.tolist() == lay
        ok = [x.tolist() == lay,
              conv_args._seq_index(x, T).tolist() == (
                  torch.searchsorted(torch.tensor(lay), torch.arange(T), right=True) - 1).tolist()]
        xs = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(len(got)))
        ok.append(torch.allclose(layer(xs, cu_seqlens=buf), layer(xs, cu_seqlens=torch.tensor(lay)), atol=1e-6))
        got.append(ok)
    return got


def test_a_cpu_buffer_refilled_by_a_collective_is_seen():
    from dist_utils import run_distributed
    for rank_result in run_distributed(_refilled_by_broadcast, 2, timeout=120):
        assert rank_result == [[True, True, True]] * 3


@pytest.mark.parametrize("how", ["numpy", "data_copy", "data_assign"])
def test_a_cpu_buffer_written_past_its_version_counter_is_seen(how):
    # writes the version counter does not see (a numpy view, .data): on the CPU the
    # values are compared instead (no device read), so nothing stale comes back
    from gdn_layer.kernels.triton import conv_args
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    lay = [0, 6, 6, 12]
    first = check_cu_seqlens(cu, 12)
    meta_first = cu_cache.as_int64(cu, torch.device("meta"))
    version = cu._version
    if how == "numpy":
        cu.numpy()[:] = lay
    elif how == "data_copy":
        cu.data.copy_(torch.tensor(lay))
    else:
        cu.data = torch.tensor(lay, dtype=torch.int32)
    assert cu._version == version and cu.tolist() == lay          # unseen by the version counter
    assert first.tolist() == [0, 3, 7, 12]                        # what was handed out is untouched
    x = check_cu_seqlens(cu, 12)
    assert x.tolist() == lay
    assert cu_cache.host_copy(cu_cache.as_int64(cu, torch.device("meta"))).tolist() == lay
    assert cu_cache.host_copy(meta_first).tolist() == [0, 3, 7, 12]
    i64 = torch.tensor([0, 2, 12])                                # an int64 cu: the conv's index keys on it
    assert conv_args._seq_index(i64, 12)[:4].tolist() == [0, 0, 1, 1]
    i64.numpy()[1] = 4
    assert conv_args._seq_index(i64, 12)[:4].tolist() == [0, 0, 0, 0]
