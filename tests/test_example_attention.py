"""The fine-tune example's softmax attention (examples/hybrid.py) and data regimes (examples/text_data.py).

FlexAttention with a document block mask built from ``cu_seqlens`` attends like SDPA with a dense
block-diagonal causal mask; the block mask visits exactly the blocks the dense mask needs; building it
reads nothing on the host; ``--attention`` defaults to sdpa on the CPU and flex on CUDA, and flex is
refused on the CPU (no backward there); ``--doc-mode concat`` makes every pack one document. The dense
masks and expected packs here are built by plain loops, not by the code under test. FlexAttention's
training path needs a GPU (scripts/gpu_session.sh ft_*)."""
import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import finetune  # noqa: E402
import hybrid  # noqa: E402
import text_data  # noqa: E402
from host_read_spy import HostReadSpy  # noqa: E402
from test_finetune_smoke import argv, write_corpus  # noqa: E402
from gdn_layer.parallel import pad_cu_seqlens  # noqa: E402

T, BLOCK = 44, 8                      # T not a multiple of the block: the last block row holds 4 tokens
LAYOUTS = {
    "one document": [0, 44],
    "many documents": [0, 5, 6, 20, 33, 44],
    "single tokens and block edges": [0, 1, 2, 8, 16, 43, 44],
    "empty segments inside": [0, 10, 10, 30, 30, 44],
    "padded tail (pad_cu_seqlens)": pad_cu_seqlens(torch.tensor([0, 17, 44]), 6).tolist(),
}
CPU = finetune.Ctx(rank=0, sp=1, sp_rank=0, sp_group=None, dp=1, dp_rank=0, dp_group=None,
                   device=torch.device("cpu"))


def dense_document_mask(bounds: list[int], total: int) -> torch.Tensor:
    """``[T, T]`` bool, by hand: a lower triangle per document, nothing across documents."""
    mask = torch.zeros(total, total, dtype=torch.bool)
    for a, b in zip(bounds, bounds[1:]):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return mask


@pytest.mark.parametrize("name", LAYOUTS)
def test_flex_attention_with_the_document_block_mask_equals_sdpa_with_a_dense_mask(name):
    bounds = LAYOUTS[name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 16, generator=gen)           # 4 query heads on 2 key-value heads (GQA)
    k, v = torch.randn(1, 2, T, 16, generator=gen), torch.randn(1, 2, T, 16, generator=gen)
    block_mask = hybrid.document_block_mask(torch.tensor(bounds, dtype=torch.int32), T, block_size=BLOCK)
    got = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(bounds, T), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_block_mask_visits_exactly_the_blocks_the_dense_mask_needs(name):
    """Compiled FlexAttention skips the blocks the BlockMask does not list and skips the mask inside the blocks
    it lists as full (eager flex_attention reads only the mask_mod, so the test above cannot see them)."""
    bounds = LAYOUTS[name]
    bm = hybrid.document_block_mask(torch.tensor(bounds), T, block_size=BLOCK)
    n = -(-T // BLOCK)
    padded = torch.zeros(n * BLOCK, n * BLOCK, dtype=torch.bool)
    padded[:T, :T] = dense_document_mask(bounds, T)
    for i in range(n):
        counts = [int(padded[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].sum()) for j in range(n)]
        full = {j for j, c in enumerate(counts) if c == BLOCK * BLOCK}
        partial = {j for j, c in enumerate(counts) if 0 < c < BLOCK * BLOCK}
        assert set(bm.full_kv_indices[0, 0, i, :bm.full_kv_num_blocks[0, 0, i]].tolist()) == full, i
        assert set(bm.kv_indices[0, 0, i, :bm.kv_num_blocks[0, 0, i]].tolist()) == partial, i


def test_building_the_block_mask_reads_nothing_on_the_host():
    """What a CUDA-graph capture (--cuda-graphs) and a sync-free step need: no cu_seqlens value read on
    the host, no tensor built there (tests/host_read_spy.py)."""
    for bounds in LAYOUTS.values():
        cu = torch.tensor(bounds, dtype=torch.int32)
        with HostReadSpy() as spy:
            hybrid.document_block_mask(cu, T, block_size=BLOCK)
        assert spy.found == [], bounds


@pytest.mark.slow
def test_compiled_block_mask_builds_one_graph_for_every_layout():
    """``torch.compile(create_block_mask)`` (the CUDA path; inductor on the CPU here, ~6 s cold): the same
    block mask as uncompiled, and a new cu_seqlens layout at the same T is data, not a recompile."""
    from torch._dynamo.utils import counters
    graphs = []
    for bounds in LAYOUTS.values():
        cu = torch.tensor(bounds, dtype=torch.int32)
        got = hybrid.document_block_mask(cu, T, block_size=BLOCK, compiled=True)
        graphs.append(counters["stats"]["unique_graphs"])
        want = hybrid.document_block_mask(cu, T, block_size=BLOCK, compiled=False)
        for a, b in zip(got.as_tuple()[2:-1], want.as_tuple()[2:-1]):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), bounds
    assert graphs[1:] == graphs[:1] * (len(graphs) - 1), graphs


@pytest.mark.slow
def test_the_example_forward_with_flex_equals_sdpa_without_recompiling(monkeypatch):
    """``hybrid_forward`` of the attention-only tiny model and of its hybrid (GDN in layer 1) under
    ``set_attention(model, "flex")`` (transformers' flex_attention, compiled by inductor: the CPU kernel
    uses the block structure; ~6 s cold) against ``"sdpa"``, forward only (FlexAttention has no backward
    on the CPU), over layouts with documents across and inside the 128-token blocks; the compiled
    attention compiles once for all layouts."""
    from torch._dynamo.utils import counters
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    flex_forward, masks = ALL_ATTENTION_FUNCTIONS["flex_attention"], []

    def recording(module, query, key, value, attention_mask, **kwargs):
        masks.append(type(attention_mask).__name__)
        return flex_forward(module, query, key, value, attention_mask, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flex_attention", recording)
    n = 384
    layouts = ([0, n], [0, 100, 300, n], [0, 1, 130, 131, 260, n],
               pad_cu_seqlens(torch.tensor([0, 200, n]), 5).tolist())
    ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(0))
    for layers in ([], [1]):
        model = hybrid.tiny_model(0)
        hybrid.make_hybrid(model, layers, 2, 4, None, "torch")
        graphs = []
        for bounds in layouts:
            cu = torch.tensor(bounds, dtype=torch.int32)
            pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
            logits = {}
            for attention in ("sdpa", "flex"):
                hybrid.set_attention(model, attention)
                with torch.no_grad():
                    logits[attention] = hybrid.hybrid_forward(model, ids, pos, cu, None)
            graphs.append(counters["stats"]["unique_graphs"])
            torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"layers {layers}, cu {bounds}: {m}")
        assert graphs[1:] == graphs[:1] * (len(graphs) - 1), graphs
    # flex ran in every softmax layer (2 + 1) of every layout, on a BlockMask
    assert masks == ["BlockMask"] * 3 * len(layouts)


# ------------------------------------------------------------------------------------ --attention
@pytest.mark.parametrize("cuda, extra, want", [
    (False, [], "sdpa"), (False, ["--device", "cpu"], "sdpa"), (True, ["--device", "cpu"], "sdpa"),
    (True, [], "flex"), (True, ["--device", "cuda"], "flex"),
    (True, ["--attention", "sdpa"], "sdpa"), (True, ["--device", "cuda", "--attention", "flex"], "flex"),
])
def test_attention_defaults_to_sdpa_on_the_cpu_and_flex_on_cuda(monkeypatch, cuda, extra, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert finetune.parse_args(extra).attention == want


@pytest.mark.parametrize("extra, where", [(["--device", "cpu"], "--device cpu"),
                                          ([], "--device auto with no CUDA device visible")])
def test_flex_attention_on_the_cpu_is_refused_while_parsing(monkeypatch, extra, where):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError,
                       match=f"--attention flex needs --device cuda .*, got {where}; pass --attention sdpa"):
        finetune.parse_args(["--attention", "flex", *extra])


def test_set_attention_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="--attention must be one of \\['flex', 'sdpa'\\], got 'eager'"):
        hybrid.set_attention(hybrid.tiny_model(0), "eager")


# -------------------------------------------------------------------------------------- --doc-mode
DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17]]


def test_concat_packs_one_document_per_sequence():
    stream = [t for d in DOCS for t in d]                  # 17 tokens -> 4 packs of 4, one token left over
    packs = text_data.pack(DOCS, 4, doc_mode="concat")
    assert len(packs) == 4
    for i, p in enumerate(packs):
        assert p.cu_seqlens.tolist() == [0, 4]
        assert p.input_ids.tolist() == stream[4 * i:4 * i + 4]
        assert p.position_ids.tolist() == [0, 1, 2, 3]
        assert p.labels.tolist() == stream[4 * i + 1:4 * i + 4] + [text_data.IGNORE]
    assert len(text_data.pack(DOCS, 4, max_batches=2, doc_mode="concat")) == 2


def test_short_packs_each_document_as_its_own_segment():
    packs = text_data.pack(DOCS, 4)
    assert [p.cu_seqlens.tolist() for p in packs] == [[0, 3, 4], [0, 1, 4], [0, 3, 4], [0, 4]]
    with pytest.raises(ValueError, match="--doc-mode must be one of"):
        text_data.pack(DOCS, 4, doc_mode="long")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "synthetic")


@pytest.mark.parametrize("mode", ["short", "concat"])
def test_the_example_builds_its_packs_in_the_doc_mode_given(tmp_path, mode):
    """400 fortune-style documents of 1 to 12 words (~40 bytes) in packs of 256 bytes."""
    rng = random.Random(0)
    words = "packs of documents hold many short texts side by side".split()
    data = tmp_path / "short_fortunes"
    data.write_text("\n%\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
                                  for _ in range(400)) + "\n%\n")
    args = finetune.parse_args(argv(str(data), str(tmp_path), 1, "--doc-mode", mode, "--device", "cpu",
                                    "--seq-len", "256", "--eval-tokens", "256"))
    model, _, _, train, held, _, summary = finetune.build(args, CPU)
    segments = [b.cu_seqlens.numel() - 1 for b in train + held]
    assert len(train) > 10 and len(held) == 1
    if mode == "concat":
        assert set(segments) == {1}
    else:
        assert min(segments) > 1 and sum(segments) > 4 * len(segments)
    assert model.config._attn_implementation == "sdpa" and "attention: sdpa" in summary


def test_resume_refuses_another_doc_mode(corpus, tmp_path):
    finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, steps=1)))
    with pytest.raises(ValueError, match="different settings .*'doc_mode': \\('short', 'concat'\\)"):
        finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, "--resume", "--doc-mode", "concat")))


@pytest.mark.parametrize("mode", ["short", "concat"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_pack_refuses_a_batch_count_below_one_in_both_modes(mode, bad):
    with pytest.raises(ValueError, match="max_batches"):
        text_data.pack(DOCS, 4, max_batches=bad, doc_mode=mode)
