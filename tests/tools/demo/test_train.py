import itertools
import json
import math

import pytest
import torch

from ropekit.tools.demo.data import load_corpus
from ropekit.tools.demo.model import ModelConfig
from ropekit.tools.demo.train import (
    DistContext,
    TrainSettings,
    fresh_model,
    learning_rate,
    min_depth,
    retrieval_correct,
    token_losses,
    train,
)

# Loss of the 2-process run against the single-process run at every step. Both average the same global
# batch; only the order of float32 reductions differs (per-rank means, then gloo's all-reduce). Measured:
# 1.2e-6 nats at worst over the 200 quick steps; 1e-4 leaves room for other CPUs and still catches a wrong
# shard, seed or average (those move the loss by 1e-2 or more).
DDP_LOSS_TOL = 1e-4


def test_learning_rate_warms_up_then_decays_to_the_floor():
    s = TrainSettings(steps=100, batch_size=4, length=8, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert learning_rate(0, s) == pytest.approx(0.1)
    assert learning_rate(9, s) == pytest.approx(1.0)
    assert learning_rate(10, s) == pytest.approx(1.0)
    assert learning_rate(100, s) == pytest.approx(0.1)
    values = [learning_rate(k, s) for k in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_curriculum_widens_the_key_query_gap_to_the_whole_window():
    s = TrainSettings(steps=100, batch_size=4, length=8, curriculum=0.5, curriculum_gap=0.1)
    assert min_depth(0, s) == pytest.approx(0.9)
    depths = [min_depth(k, s) for k in range(0, 60)]
    assert all(a >= b for a, b in itertools.pairwise(depths))
    assert min_depth(50, s) == 0.0 and min_depth(99, s) == 0.0
    assert min_depth(0, TrainSettings(steps=10, batch_size=4, length=8, curriculum=0.0)) == 0.0


def test_retrieval_is_exact_match_of_every_answer_byte():
    class Echo(torch.nn.Module):
        """Predicts, at each position, the byte that follows it in ``truth`` (one digit wrong in row 1)."""

        def __init__(self, truth):
            super().__init__()
            self.truth = truth

        def forward(self, tokens):
            logits = torch.full((*tokens.shape, 256), -1.0)
            return logits.scatter(2, self.truth[:, 1:, None], 1.0)

    windows = torch.randint(48, 58, (3, 20))
    truth = windows.clone()
    truth[1, -2] = (truth[1, -2] - 48 + 1) % 10 + 48
    correct = retrieval_correct(Echo(truth), windows, 3, torch.device("cpu"))
    assert correct.tolist() == [True, False, True]


def test_a_model_with_uniform_predictions_loses_log_256_per_byte():
    model = fresh_model(ModelConfig(variant="nope", dim=16, n_layers=1, n_heads=2), 0, torch.device("cpu"))
    with torch.no_grad():
        model.embed.weight.zero_()  # tied with the head: every logit is 0
    windows = torch.randint(0, 256, (3, 17))
    losses = token_losses(model, windows, 2, torch.device("cpu"))
    assert losses.shape == (3, 16)
    # The logits are float32 zeros; log-softmax of them is exact to float32 rounding.
    torch.testing.assert_close(
        losses, torch.full((3, 16), math.log(256.0), dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert math.exp(float(losses.mean())) == pytest.approx(256.0, rel=1e-6)


@pytest.fixture
def one_thread():
    # Tiny matmuls gain nothing from threads, and spinning ones stall on a busy machine (see default_threads).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_training_is_deterministic_and_lowers_the_loss(one_thread):
    corpus = load_corpus(100_000, 10_000)
    settings = TrainSettings(steps=20, batch_size=4, length=16, warmup=5)
    runs = []
    for _ in range(2):
        model = fresh_model(
            ModelConfig(variant="rope", dim=32, n_layers=1, n_heads=2), 0, torch.device("cpu")
        )
        runs.append(train(model, corpus.train, settings, DistContext()))
    assert runs[0] == runs[1]
    assert sum(runs[0][-5:]) / 5 < sum(runs[0][:5]) / 5 - 0.5


def test_global_batch_must_split_evenly_over_ranks():
    model = fresh_model(ModelConfig(variant="nope", dim=16, n_layers=1, n_heads=2), 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="batch_size"):
        train(model, torch.zeros(1000, dtype=torch.uint8), TrainSettings(steps=1, batch_size=3, length=8),
              DistContext(rank=0, world_size=2))  # fmt: skip


@pytest.mark.proof  # two processes of the quick training, 17 s: make proofs since 2026-12-08 (CONTRIBUTING)
def test_two_processes_match_one_process_at_the_same_global_batch(quick_report, quick_ddp_report):
    single = json.loads((quick_report / "results.json").read_text())
    ddp = json.loads((quick_ddp_report / "results.json").read_text())
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert ddp["results"] == []  # --train-only
    one, two = single["train_loss"]["rope"], ddp["train_loss"]["rope"]
    assert len(one) == len(two) == single["settings"]["steps"]
    assert all(math.isfinite(x) for x in two)
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < DDP_LOSS_TOL
