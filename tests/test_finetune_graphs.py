"""examples/finetune.py --cuda-graphs (and --graph-layers) on the CPU: the static-buffer step (examples/graph_step.py) run without a
graph trains exactly like the eager step, reads nothing on the host, and the flag's limits are checked
while parsing the arguments. The capture itself needs a GPU (scripts/gpu_session.sh ft_graphs)."""
import copy
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import finetune  # noqa: E402
import graph_step  # noqa: E402
import text_data  # noqa: E402
from dist_utils import DistributedPool  # noqa: E402
from host_read_spy import HostReadSpy, backward  # noqa: E402
from hybrid import make_hybrid, tiny_model  # noqa: E402
from test_finetune_smoke import argv, write_corpus  # noqa: E402
from gdn_layer.kernels.validation import skip_value_checks  # noqa: E402

T = 64
CPU = finetune.Ctx(rank=0, sp=1, sp_rank=0, sp_group=None, dp=1, dp_rank=0, dp_group=None,
                   device=torch.device("cpu"))
BUFFERS = ["input_ids", "labels", "position_ids", "cu_seqlens", "n_labels"]


def _batches():
    """Packs of T tokens with 1 to 7 documents (random byte tokens): different N, lengths and label counts."""
    rng = random.Random(0)
    out = []
    for cuts in ([], [40], [5, 6, 30], [3, 9, 20, 33, 47, 60], [10, 50]):
        bounds = [0, *cuts, T]
        out.append(text_data.make_batch([[rng.randint(1, 127) for _ in range(b - a)]
                                         for a, b in zip(bounds, bounds[1:])]))
    return out


def _hybrid():
    """The tiny Llama with a GatedDeltaNet in layer 1 and softmax attention (document mask, rotary
    positions) kept in layer 0; every parameter trained."""
    model = tiny_model(0)
    torch.manual_seed(1)
    make_hybrid(model, [1], 2, 4, None, "torch")
    return model.train()


def _train(model, batches, static_of=None):
    """Per-step losses and post-clip gradients of ``finetune.train_step`` over ``batches`` (lr 1e-2, so a
    step that differs once changes every later loss), and the final parameters."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    static = static_of(model, opt) if static_of else None
    losses, grads = [], []
    for batch in batches:
        losses.append(finetune.train_step(model, params, opt, batch, CPU, static))
        grads.append([p.grad.clone() for p in params])
    return losses, grads, [p.detach().clone() for p in params]


def _static(model, opt, n_max=None):
    return graph_step.StaticStep(model, opt, T, n_max or graph_step.max_documents(_batches()), CPU.device,
                                 capture=False)


@pytest.fixture(scope="module")
def eager():
    return _train(_hybrid(), _batches())


def _assert_same(got, want):
    (l1, g1, p1), (l2, g2, p2) = got, want
    assert l1 == pytest.approx(l2, rel=1e-6, abs=0)
    for step, (a, b) in enumerate(zip(g1, g2)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {step + 1}: {m}")
    for x, y in zip(p1, p2):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_static_step_with_padded_cu_seqlens_equals_the_eager_step(eager):
    batches = _batches()
    n_max = graph_step.max_documents(batches)
    counts = [b.cu_seqlens.numel() - 1 for b in batches]
    assert n_max == 7 and len(set(counts)) == len(counts)      # padding from 6 empty segments down to none
    assert len({int((b.labels != text_data.IGNORE).sum()) for b in batches}) == len(batches)
    _assert_same(_train(_hybrid(), batches, _static), eager)


def test_static_step_with_a_larger_capacity_than_needed_equals_the_eager_step(eager):
    _assert_same(_train(_hybrid(), _batches(), lambda m, o: _static(m, o, n_max=20)), eager)


@pytest.mark.parametrize("stale", BUFFERS)
def test_every_buffer_is_refilled_at_each_step(eager, stale, monkeypatch):
    """The comparison above fails when one buffer keeps its old contents (a forgotten copy)."""
    load = graph_step.StaticStep.load

    def forgetful_load(self, batch):
        old = getattr(self, stale).clone()
        load(self, batch)
        getattr(self, stale).copy_(old)

    monkeypatch.setattr(graph_step.StaticStep, "load", forgetful_load)
    with pytest.raises(AssertionError):
        _assert_same(_train(_hybrid(), _batches(), _static), eager)


def test_the_static_step_reads_nothing_on_the_host():
    """What a graph replayed over new packings needs of the model code outside the kernels (the hybrid
    forward, transformers' attention and rotary embedding, the loss and backward): no host read of a
    tensor value, no tensor built on the host (tests/host_read_spy.py), once the buffers are filled."""
    model = _hybrid()
    static = _static(model, torch.optim.AdamW(model.parameters()))
    for batch in _batches():
        static.load(batch)
        with skip_value_checks(), HostReadSpy() as spy:
            logits = graph_step.hybrid_forward(model, static.input_ids, static.position_ids, static.cu_seqlens, None)
            backward(graph_step.local_loss(logits, static.labels, static.n_labels))
        assert spy.found == [], batch.cu_seqlens.tolist()


def test_a_batch_over_the_capacity_is_refused():
    static = _static(_hybrid(), None, n_max=2)
    static.load(_batches()[0])
    before = [t.clone() for t in (static.input_ids, static.labels, static.position_ids, static.cu_seqlens)]
    with pytest.raises(ValueError, match="capacity max_num_seqs = 2"):
        static.load(_batches()[2])
    after = (static.input_ids, static.labels, static.position_ids, static.cu_seqlens)
    assert all(torch.equal(a, b) for a, b in zip(after, before))     # nothing half-loaded
    with pytest.raises(ValueError, match="--seq-len"):
        graph_step.StaticStep(_hybrid(), None, T + 1, 8, CPU.device, capture=False).load(_batches()[0])
    with pytest.raises(ValueError, match="CUDA device"):
        graph_step.StaticStep(_hybrid(), None, T, 8, CPU.device, capture=True)


# ------------------------------------------------------------------------------ the example's run
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "synthetic")


def _run(args_list, graphs: bool):
    """``finetune.run`` with ``--cuda-graphs`` set after parsing: parse_args admits it on CUDA only, and on
    the CPU ``run`` drives the same static step without capturing."""
    args = finetune.parse_args(args_list)
    args.cuda_graphs = graphs
    return finetune.run(args)


def test_run_with_cuda_graphs_trains_and_resumes_like_the_eager_run(corpus, tmp_path, capsys):
    eager = _run(argv(corpus, str(tmp_path / "eager"), 1), graphs=False)
    first = _run(argv(corpus, str(tmp_path / "graphs"), 1, steps=2), graphs=True)
    assert "--cuda-graphs: capacity 64 tokens and N_max = " in capsys.readouterr().out
    resumed = _run(argv(corpus, str(tmp_path / "graphs"), 1, "--resume"), graphs=True)
    assert resumed["losses"] == pytest.approx(eager["losses"], rel=1e-6, abs=0)
    assert first["losses"] == pytest.approx(eager["losses"][:2], rel=1e-6, abs=0)
    assert resumed["eval_after"] == pytest.approx(eager["eval_after"], rel=1e-6)


def test_run_with_graph_layers_trains_and_resumes_like_the_eager_run(corpus, tmp_path, capsys, monkeypatch):
    """``--graph-layers`` (set after parsing) with gdn_layer.graphed's capture replaced by the CPU stand-in
    (tests/graph_standin.py: torch's static-buffer semantics): every training step's GDN layer replays, eval
    runs it eagerly, and the losses, the held-out loss and a resume equal the eager run's."""
    import gdn_layer.graphed
    from graph_standin import Replays
    replays = Replays()
    monkeypatch.setattr(gdn_layer.graphed, "_capture", replays)
    eager = _run(argv(corpus, str(tmp_path / "eager"), 1), graphs=False)

    def graph_layers(args_list):
        args = finetune.parse_args(args_list)
        args.graph_layers = True
        return finetune.run(args)
    first = graph_layers(argv(corpus, str(tmp_path / "layers"), 1, steps=2))
    assert "--graph-layers: 1 GatedDeltaNet layers captured at 64 tokens and N_max = " in capsys.readouterr().out
    assert (replays.forwards, replays.backwards) == (2, 2)
    resumed = graph_layers(argv(corpus, str(tmp_path / "layers"), 1, "--resume"))
    assert replays.backwards == len(eager["losses"])
    assert resumed["losses"] == pytest.approx(eager["losses"], rel=1e-6, abs=0)
    assert first["losses"] == pytest.approx(eager["losses"][:2], rel=1e-6, abs=0)
    assert resumed["eval_after"] == pytest.approx(eager["eval_after"], rel=1e-6)


def _dp2(rank, world, corpus, out):
    losses = [_run(argv(corpus, f"{out}/{graphs}", 1), graphs)["losses"] for graphs in (False, True)]
    import gdn_layer.graphed                  # --graph-layers on the stand-in capture (tests/graph_standin.py)
    from graph_standin import Replays
    gdn_layer.graphed._capture = replays = Replays()
    args = finetune.parse_args(argv(corpus, f"{out}/layers", 1))
    args.graph_layers = True
    losses.append(finetune.run(args)["losses"])
    assert replays.backwards == len(losses[-1])
    # without torchrun's WORLD_SIZE parse_args cannot see that the default SP size is 2: run refuses it
    args = finetune.parse_args(argv(corpus, f"{out}/sp2", 1))
    args.sp, args.cuda_graphs = None, True
    try:
        finetune.run(args)
    except ValueError as e:
        return losses, str(e)
    return losses, None


def test_data_parallel_replicas_reduce_the_static_gradients_outside_the_step(corpus, tmp_path):
    """--cuda-graphs (uncaptured on the CPU) and --graph-layers (stand-in capture) with two gloo DP replicas."""
    with DistributedPool(2) as pool:
        ranks = pool.run(_dp2, corpus, str(tmp_path))
    for (eager_losses, graph_losses, layer_losses), refused in ranks:
        assert graph_losses == pytest.approx(eager_losses, rel=1e-6, abs=0)
        assert layer_losses == pytest.approx(eager_losses, rel=1e-6, abs=0)
        assert refused == "--cuda-graphs runs one process per sequence, so not with --sp 2"
    assert ranks[0][0][1] == ranks[1][0][1]            # the replicas agree: the gradients were averaged


# ------------------------------------------------------------------------------------ the flag's limits
@pytest.mark.parametrize("world, extra, match", [
    ("1", ["--device", "cpu"], "--cuda-graphs needs --device cuda .*, got --device cpu"),
    ("1", ["--device", "cuda", "--sp", "2"], "--cuda-graphs runs one process per sequence, so not with --sp 2:"),
    ("2", ["--device", "cuda"], "so not with --sp 2 \\(the default for this world size\\)"),
    ("2", ["--device", "cuda", "--sp", "1", "--cp", "2"], "so not with --cp 2"),
])
def test_cuda_graphs_outside_its_limits_is_refused_in_argument_parsing(monkeypatch, world, extra, match):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # (--device cuda is checked too)
    with pytest.raises(ValueError, match=match):
        finetune.parse_args(["--cuda-graphs", *extra])


@pytest.mark.parametrize("world, extra, match", [
    ("1", ["--device", "cpu"], "--graph-layers needs --device cuda .*, got --device cpu"),
    ("1", ["--device", "cuda", "--sp", "2"], "--graph-layers runs one process per sequence, so not with --sp 2:"),
    ("2", ["--device", "cuda", "--sp", "1", "--cp", "2"], "--graph-layers runs .* so not with --cp 2"),
    ("1", ["--device", "cuda", "--cuda-graphs"], "pass one of --cuda-graphs and --graph-layers"),
])
def test_graph_layers_outside_its_limits_is_refused_in_argument_parsing(monkeypatch, world, extra, match):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=match):
        finetune.parse_args(["--graph-layers", *extra])


def test_cuda_graphs_with_auto_device_and_no_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device auto with no CUDA device visible"):
        finetune.parse_args(["--cuda-graphs"])


def test_device_cuda_without_cuda_and_tiny_with_model_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda, but this torch sees no CUDA device"):
        finetune.parse_args(["--device", "cuda"])
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):     # before the --sp advice
        monkeypatch.setenv("WORLD_SIZE", "2")
        finetune.parse_args(["--cuda-graphs"])
    with pytest.raises(ValueError, match="--tiny builds its own 2-layer model: drop --model"):
        finetune.parse_args(["--tiny", "--model", "/tmp"])


def test_a_model_path_that_is_neither_a_gguf_file_nor_a_directory_is_refused_while_parsing(tmp_path):
    """(A new user's ``--model /nonexistent`` got a traceback from hybrid.py, not argparse's one-line error.)"""
    with pytest.raises(ValueError, match="a .gguf file or a transformers model directory, got '/nonexistent'"):
        finetune.parse_args(["--model", "/nonexistent"])
    with pytest.raises(ValueError, match="missing.gguf' does not exist"):
        finetune.parse_args(["--model", str(tmp_path / "missing.gguf")])
    assert finetune.parse_args(["--model", str(tmp_path)]).model == str(tmp_path)      # a directory passes
    (tmp_path / "m.gguf").write_bytes(b"")
    assert finetune.parse_args(["--model", str(tmp_path / "m.gguf")]).model.endswith("m.gguf")


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        finetune.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: 0)" in out and "(default: float32)" in out


def test_cuda_graphs_with_data_parallel_replicas_is_accepted(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert finetune.parse_args(["--cuda-graphs", "--device", "cuda", "--sp", "1"]).cuda_graphs
    assert not finetune.parse_args(["--device", "cpu"]).cuda_graphs
