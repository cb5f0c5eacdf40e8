"""examples/cp_token_order.py: the hybrid (GDN blocks with token_order, an attention block on the same
per-document head-tail layout) trains on 2 and 4 gloo ranks exactly like one process."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import cp_token_order  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def single():
    return cp_token_order.train(0, 1, 1, 1, STEPS)


def _close(parallel, single):
    return max(abs(a - b) / abs(b) for a, b in zip(parallel, single)) <= 1e-5


def test_cp2_trains_like_one_process(pool2, single):
    for losses in pool2.run(cp_token_order.train, 2, 1, STEPS, timeout=120):
        assert _close(losses, single), (losses, single)


@pytest.mark.parametrize("cp, sp", [(2, 2), (4, 1)])
def test_four_ranks_train_like_one_process(pool4, single, cp, sp):
    for losses in pool4.run(cp_token_order.train, cp, sp, STEPS, timeout=180):
        assert _close(losses, single), (losses, single)
