"""The gradient-traffic counter of PowerSGDStrategy against a hand count and against the hook's real all-reduces.

One process, a gloo group of size 1 (the hooks run the same code path at any world size): DDP over a small model
whose tensors cover the hook's cases — a matrix it compresses, a matrix too small to be worth it, a 3-D weight it
views as ``n × m``, and biases. The independent reference is a spy on
``torch.distributed.all_reduce``, which both hooks call for every value they send.
"""

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lens_callbacks.callbacks.powersgd import GradCommCounter, PowerSGDStrategy, counting_hook

RANK, START, STEPS = 2, 2, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 8, 5)  # weight [8, 2, 5] -> 8 × 10: (8+10)·2·2 = 72 < 80, compressed
        self.fc1 = nn.Linear(32, 12)  # weight [12, 32]: (12+32)·2·2 = 176 < 384, compressed
        self.fc2 = nn.Linear(12, 3)  # weight [3, 12]: (3+12)·2·2 = 60 ≥ 36, sent whole

    def forward(self, x):  # x [B, 2, 8]
        h = torch.relu(self.conv(x)).flatten(1)  # [B, 32]
        return self.fc2(torch.relu(self.fc1(h)))  # [B, 3]


def hand_count():
    """Values per step by hand: every tensor whole during the warm-up; after it, P and Q of the compressed."""
    whole = 8 * 2 * 5 + 8 + 12 * 32 + 12 + 3 * 12 + 3
    compressed = (8 + 10) * RANK + 8 + (12 + 32) * RANK + 12 + 3 * 12 + 3
    return [whole * 4] * START + [compressed * 4] * (STEPS - START)  # float32


@pytest.fixture
def group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train(hook, state, monkeypatch=None, counting=True, one_bucket=True):
    """STEPS backward passes of DDP; returns (grads per step, spied bytes per step).

    PowerSGD runs with one bucket: its callbacks block gloo's two worker threads while they wait for the next
    all-reduce, so several buckets in flight can deadlock (PowerSGDStrategy keeps one bucket on CPU for that
    reason). The plain all-reduce, which never blocks a worker, runs with one bucket per tensor.
    """
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=(1 << 20) if one_bucket else 1e-5)  # tiny cap: a bucket per tensor
    counter = GradCommCounter(hook, state) if counting else None
    if counting:
        model.register_comm_hook(counter, counting_hook)
    else:
        model.register_comm_hook(state, hook)
    sent: list[int] = []
    if monkeypatch is not None:
        real = dist.all_reduce

        def spy(tensor, *a, **k):
            sent.append(tensor.numel() * tensor.element_size())
            return real(tensor, *a, **k)

        monkeypatch.setattr(dist, "all_reduce", spy)
    grads, per_step = [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        before = len(sent)
        model(torch.randn(4, 2, 8, generator=gen)).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        per_step.append(sum(sent[before:]))
    if monkeypatch is not None:
        monkeypatch.setattr(dist, "all_reduce", real)
    return counter, grads, per_step


def psgd_state():
    return PowerSGDState(
        process_group=None,
        matrix_approximation_rank=RANK,
        start_powerSGD_iter=START,
        min_compression_rate=2,
        random_seed=0,
    )


def test_powersgd_bytes_match_the_hand_count_and_the_real_all_reduces(group, monkeypatch):
    counter, grads, spied = train(powerSGD_hook, psgd_state(), monkeypatch)
    want = hand_count()
    assert spied == want  # the hook really sends what the hand count says, warm-up included
    assert counter.bytes_total == sum(want)
    assert counter.by_path == {"warmup": sum(want[:START]), "powersgd": sum(want[START:])}
    assert counter.calls == STEPS  # one bucket per backward
    # PowerSGD's own statistics count the same elements after compression (compressed iterations only)
    assert counter.state.total_numel_after_compression * 4 == sum(want[START:])

    # counting changes nothing: the same run with the bare hook gives bitwise the same gradients
    _, bare, _ = train(powerSGD_hook, psgd_state(), counting=False)
    for g, b in zip(grads, bare):
        assert all(torch.equal(x, y) for x, y in zip(g, b))
    # and the hook was live: after the warm-up the gradient is the low-rank one, not the local gradient
    _, plain, _ = train(default_hooks.allreduce_hook, None, counting=False)
    assert all(torch.equal(x, y) for x, y in zip(grads[0], plain[0]))
    assert not torch.equal(grads[-1][2], plain[-1][2])  # fc1.weight, compressed


def test_plain_allreduce_counts_every_bucket_whole(group, monkeypatch):
    counter, _, spied = train(default_hooks.allreduce_hook, None, monkeypatch, one_bucket=False)
    whole = hand_count()[0]
    assert spied == [whole] * STEPS and counter.bytes_total == whole * STEPS
    # several buckets per backward were counted (DDP fixes its layout only after the first backward; the sums
    # above do not depend on it)
    assert counter.calls > STEPS
    assert counter.by_path == {"allreduce": whole * STEPS}


def test_strategy_arguments_are_checked():
    s = PowerSGDStrategy(matrix_approximation_rank=3, start_powerSGD_iter=5)
    st = s.grad_comm_counter.state
    assert s.grad_comm_counter.hook is powerSGD_hook and st.process_group is None
    assert (st.matrix_approximation_rank, st.start_powerSGD_iter) == (3, 5)
    assert PowerSGDStrategy(compress=False).grad_comm_counter.hook is default_hooks.allreduce_hook
    with pytest.raises(ValueError, match="`matrix_approximation_rank` must be an int ≥ 1, got 0"):
        PowerSGDStrategy(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="`start_powerSGD_iter` must be ≥ 2 when use_error_feedback"):
        PowerSGDStrategy(start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="`min_compression_rate` must be a number > 0"):
        PowerSGDStrategy(min_compression_rate=0)
    # DDPStrategy's defaults, as LightningCLI passes them, are accepted
    assert PowerSGDStrategy(ddp_comm_wrapper=None, ddp_comm_hook=None)._ddp_comm_hook is counting_hook
    with pytest.raises(ValueError, match="`ddp_comm_wrapper` is set by PowerSGDStrategy"):
        PowerSGDStrategy(ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)
    with pytest.raises(ValueError, match="`hook` must be powerSGD_hook or allreduce_hook"):
        GradCommCounter(default_hooks.fp16_compress_hook)
