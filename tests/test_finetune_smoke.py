"""examples/finetune.py on a tiny random-init Llama (no download): SP=2 trains exactly like one process."""
import math
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import finetune  # noqa: E402
import text_data  # noqa: E402
from dist_utils import DistributedPool  # noqa: E402
from hybrid import parse_layers  # noqa: E402

STEPS = 3
WORDS = ("gated delta rule linear attention packs documents back to back while every rank "
         "holds a slice of the sequence and the state restarts at each boundary").split()


def write_corpus(path) -> str:
    """Fortune-style file (``%`` lines between documents) of 120 documents, 1 to 60 words each."""
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(120)]
    path.write_text("\n%\n".join(docs) + "\n%\n")
    return str(path)


def argv(data, out, sp, *extra, steps=STEPS):
    # lr 1e-2 so that a gradient that is off between SP and one process changes the later losses
    return ["--tiny", "--steps", str(steps), "--seq-len", "64", "--eval-tokens", "128", "--lr", "1e-2",
            "--warmup", "1", "--train", "all", "--data", data, "--out", out, "--sp", str(sp), *extra]


def _train(rank, world, args):
    return finetune.run(finetune.parse_args(args))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "synthetic")


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    return finetune.run(finetune.parse_args(argv(corpus, str(tmp_path_factory.mktemp("sp1")), 1)))


def test_sp2_losses_equal_single_process_losses(corpus, single, tmp_path):
    with DistributedPool(2) as pool:
        ranks = pool.run(_train, argv(corpus, str(tmp_path), 2))
    assert len(single["losses"]) == STEPS and all(math.isfinite(x) for x in single["losses"])
    for r in ranks:
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=0)
        assert r["eval_before"] == pytest.approx(single["eval_before"], rel=1e-5)
        assert r["eval_after"] == pytest.approx(single["eval_after"], rel=1e-5)
    assert single["losses"][-1] < single["losses"][0]   # it learns, even in 3 steps
    for name in ["checkpoint.pt", "loss.png", "log.jsonl", "metrics.json"]:
        assert os.path.isfile(tmp_path / name), name


def test_cp2_losses_equal_single_process_losses(corpus, single, tmp_path):
    """State-passing context parallelism (--cp 2): the GDN layers pass states between the two slices."""
    with DistributedPool(2) as pool:
        ranks = pool.run(_train, argv(corpus, str(tmp_path), 1, "--cp", "2"))
    for r in ranks:
        assert r["gdn_parallel"] == [(1, 2)]             # the GDN layers really pass states (sp 1, cp 2)
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=0)
        assert r["eval_after"] == pytest.approx(single["eval_after"], rel=1e-5)


def test_resume_continues_with_the_same_step_count_and_losses(corpus, single, tmp_path, capsys):
    first = finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, steps=2)))
    assert first["steps"] == 2
    capsys.readouterr()
    resumed = finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, "--resume")))
    assert resumed["steps"] == STEPS
    # the closing summary compares the resumed step (2) with the last one, not step 0
    assert resumed["resumed_at"] == 2 and resumed["eval_resumed"] == first["eval_after"]
    assert f"held-out loss {first['eval_after']:.4f} (step 2) -> {resumed['eval_after']:.4f} (step {STEPS})" \
        in capsys.readouterr().out
    assert resumed["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert resumed["eval_before"] == pytest.approx(single["eval_before"], rel=1e-6)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]   # the temp file was renamed away


def test_resume_refuses_a_checkpoint_of_other_settings(corpus, tmp_path):
    finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, steps=1)))
    with pytest.raises(ValueError, match="different settings"):
        finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, "--resume", "--layers", "0")))


def test_packing_keeps_documents_apart():
    batches = text_data.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]], seq_len=4)
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 3, 4], [0, 1, 4], [0, 3]][:len(batches)]
    first = batches[0]
    assert first.labels.tolist() == [2, 3, text_data.IGNORE, text_data.IGNORE]
    assert first.position_ids.tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize("bad, match", [(["--steps", "0"], "--steps"), (["--sp", "0"], "--sp")])
def test_bad_arguments_raise_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        finetune.parse_args(bad)


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        finetune.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ["(default: 40)", "(default: 0.003)", "(default: 256)", "(default: 5)", "(default: 20)"]:
        assert shown in out, shown


@pytest.mark.parametrize("world, extra, flag", [("2", ["--sp", "2"], "--sp 2"), ("2", [], "--sp 2"),
                                                ("4", ["--cp", "4", "--sp", "1"], "--cp 4")])
def test_seq_len_not_divisible_by_the_split_is_refused_in_argument_parsing(monkeypatch, world, extra, flag):
    monkeypatch.setenv("WORLD_SIZE", world)   # as torchrun sets it
    with pytest.raises(ValueError, match=f"--seq-len 255 must be divisible by {flag}"):
        finetune.parse_args(["--seq-len", "255", *extra])
    assert finetune.parse_args(["--seq-len", "256", *extra]).seq_len == 256


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refused_argument_is_one_error_line_from_the_lead_rank(monkeypatch, capsys, rank):
    """``main`` turns parse_args' ValueError into argparse's short form (exit 2, no traceback), printed by
    rank 0 only: under torchrun every rank parses the same arguments."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_:
        finetune.main(["--seq-len", "255", "--sp", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    if rank == "0":
        assert err.count("\n") == 1 and ": error: --seq-len 255 must be divisible by --sp 2" in err, err
    else:
        assert err == ""


def test_only_the_lead_rank_shows_a_progress_bar():
    assert not finetune.progress_bar(0, 3, lead=True).disable
    assert finetune.progress_bar(0, 3, lead=False).disable


def test_a_tiny_smoke_run_writes_its_own_folder_by_default():
    """--tiny must not replace the real job's checkpoint in runs/finetune (a new user's smoke run did)."""
    assert finetune.parse_args([]).out == "runs/finetune"
    assert finetune.parse_args(["--tiny"]).out == "runs/finetune-tiny"
    assert finetune.parse_args(["--tiny", "--out", "x"]).out == "x"


def test_layer_spec():
    assert parse_layers("odd", 6) == [1, 3, 5]
    assert parse_layers("0,2-3", 6) == [0, 2, 3]
    with pytest.raises(ValueError, match="--layers"):
        parse_layers("7", 6)


def test_gdn_from_attention_maps_smollm2_heads_as_documented():
    """9 query / 3 kv heads (SmolLM2's layout, small dims) -> Hk 4, Hv 8, as in docs/finetune.md."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention
    from hybrid import default_gdn_heads, gdn_from_attention
    d, hidden = 8, 72
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=9, num_key_value_heads=3, head_dim=d)
    attn = LlamaAttention(config, 0)
    hk, hv = default_gdn_heads(9, 3)
    assert (hk, hv) == (4, 8)
    gdn = gdn_from_attention(attn, config, hk, hv, sp_group=None, backend="auto")
    q, k, v = gdn.in_proj_qkv.weight.detach().split([hk * d, hk * d, hv * d])
    heads = lambda w, idx: torch.cat([w.detach()[h * d:(h + 1) * d] for h in idx])
    assert torch.equal(q, heads(attn.q_proj.weight, [0, 2, 4, 6]))
    assert torch.equal(k, heads(attn.k_proj.weight, [0, 0, 1, 2]))
    assert torch.equal(v, heads(attn.v_proj.weight, [0, 0, 0, 1, 1, 1, 2, 2]))
    assert torch.equal(gdn.out_proj.weight.detach(), attn.o_proj.weight.detach()[:, :8 * d])


@pytest.mark.parametrize("sp, cp, flag", [(2, 1, "--sp 2"), (None, 2, "--cp 2")])
def test_a_split_larger_than_the_world_names_the_flag_given(monkeypatch, sp, cp, flag):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=flag):
        finetune.setup_distributed(sp, "cpu", cp=cp)
