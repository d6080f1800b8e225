"""The coarsest dtype on a forward's gradient path, read off its autograd graph, against the same forward
watched op by op (the torch function mode, an independent reading of the same values)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.precision import GRAPH_DTYPES, PrecisionWatch


def _net(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).to(dtype)


def _float32_norm(x):  # transformers' RMSNorm: float32 arithmetic whatever the weights' dtype
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


FORWARDS = {
    "plain float64": (torch.float64, lambda net, x: net(x).sum(), None),
    "float32 norm in float64": (torch.float64, lambda net, x: _float32_norm(net(x)).sum(), None),
    "float32 mask off the gradient path": (
        torch.float64,
        lambda net, x: (net(x) * (x[:, :5] > 0).float().double()).sum(),
        None,
    ),
    "bf16 autocast": (
        torch.float32,
        lambda net, x: net(x).float().sum(),
        lambda: torch.autocast("cpu", torch.bfloat16),
    ),
    "non-reentrant checkpoint, bf16 inside": (
        torch.float32,
        lambda net, x: checkpoint(lambda h: net(h).bfloat16().float(), x, use_reentrant=False).sum(),
        None,
    ),
    "half inside": (torch.float32, lambda net, x: (net(x).half() * 2).float().sum(), None),
}


@pytest.mark.skipif(not GRAPH_DTYPES, reason="this torch's autograd nodes do not expose their outputs' metadata")
@pytest.mark.parametrize("name", list(FORWARDS))
def test_the_graph_reading_equals_the_watched_forward(name):
    dtype, fwd, ctx = FORWARDS[name]
    net = _net(dtype)
    x = torch.randn(4, 6, dtype=dtype)
    readings = []
    for by_graph in (False, True):
        watch = PrecisionWatch(dtype)
        with ctx() if ctx else torch.autocast("cpu", enabled=False):
            if by_graph:
                watch.see_graph(fwd(net, x))
            else:
                with watch:
                    fwd(net, x)
        readings.append((watch.coarsest, watch.coarser_than(dtype)))
    assert readings[0] == readings[1]
    if name in ("plain float64", "float32 mask off the gradient path"):
        assert readings[1][1] is None
    else:
        assert readings[1][1] in ("float32", "bfloat16", "float16")


class _Policy(nn.Module):
    def __init__(self, norm32: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb, self.head, self.norm32 = nn.Embedding(11, 8), nn.Linear(8, 11), norm32

    def credit_terms(self, batch):
        ids, adv = batch
        h = self.emb(ids)
        if self.norm32:
            h = _float32_norm(h)
        lp = torch.log_softmax(self.head(h), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp = nn.functional.pad(lp, (1, 0))
        trained = torch.ones_like(ids, dtype=torch.bool)
        trained[:, 0] = False
        return CreditTerms(
            -adv[:, None] * lp * trained / trained.sum(),
            trained,
            torch.arange(ids.shape[0]),
            torch.zeros(ids.shape[0], dtype=torch.long),
        )


@pytest.mark.parametrize("by_graph", [True, False])
@pytest.mark.parametrize("engine", ["ghost", "reference"])
@pytest.mark.parametrize("norm32", [False, True])
def test_an_engine_reports_the_dtype_its_forward_computed_in(engine, norm32, by_graph, monkeypatch):
    # by_graph=False: a torch whose nodes hide their outputs' metadata, where the watch is entered instead
    from lens_callbacks.credit import primitives

    monkeypatch.setattr(primitives, "GRAPH_DTYPES", by_graph and GRAPH_DTYPES)
    module = _Policy(norm32).double()
    g = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 11, (3, 7), generator=g), torch.randn(3, generator=g, dtype=torch.float64))
    rep = disintegrate(module, batch, "by_rollout", dtype="float64", engine=engine)
    watch = PrecisionWatch(torch.float64)  # the reference: the same terms' forward watched op by op
    with watch:
        module.credit_terms(batch)
    assert rep.compute_dtype == watch.coarser_than("float64") == ("float32" if norm32 else None)
