r"""From a SkyRL dump to the credit engine: audit a dumped SkyRL step by rollout and by group.

A dump holds what the trainer's policy loss consumes: ``sequences``, ``attention_mask``, ``loss_mask``
and ``advantages``. Given a policy with the dump's vocabulary (or a ``token_map`` onto a smaller one),
:class:`SkyRLCreditSource` rebuilds the step's per-position objective terms

.. math:: \text{terms}[k, j] = -A_{k,j}\,\log\pi_\theta(y_{k,j} \mid y_{k,<j})\,m_{k,j} / Z

where ``m`` is ``loss_mask`` and ``Z`` follows SkyRL's ``loss_reduction``. This is the gradient of
SkyRL's PPO/GRPO policy loss at its first update of the step (ratio 1, nothing clipped), so
:func:`~lens_callbacks.credit.disintegrate` splits that step exactly by rollout or by prompt group.

Example::

    dump = read_skyrl_dump("dumped_data/global_step_3_training_input.pkl")
    report = audit_skyrl_dump(policy, dump, partition="by_group", dtype="float64")
    print(report.render())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from ..credit.engine import disintegrate
from ..credit.inputs.terms import CreditTerms
from ..credit.report import CreditReport
from .skyrl import SkyRLDump

__all__ = [
    "SkyRLCreditBatch",
    "SkyRLCreditSource",
    "skyrl_credit_batch",
    "compact_vocabulary",
    "audit_skyrl_dump",
    "LOSS_REDUCTIONS",
]

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class SkyRLCreditBatch:
    """The tensors of a dumped step that the policy loss consumes (real rows only).

    Attributes:
        input_ids: ``[N, S]`` token ids fed to the policy (after ``token_map``).
        attention_mask: ``[N, S]`` 1 = real token.
        position_ids: ``[N, S]`` positions counted over real tokens (left padding starts at 0).
        loss_mask: ``[N, R]`` float, 1 = trained token.
        advantages: ``[N, R]`` float.
        response_tokens: ``[N, R]`` the dump's own token ids in the response window.
        rollout: ``[N]`` row index in the dump; ``group``: ``[N]`` prompt group.
        outcome: ``[N]`` per-row advantage (the reward is popped before the dump).
    """

    input_ids: torch.Tensor  # [N, S]
    attention_mask: torch.Tensor  # [N, S]
    position_ids: torch.Tensor  # [N, S]
    loss_mask: torch.Tensor  # [N, R]
    advantages: torch.Tensor  # [N, R]
    response_tokens: torch.Tensor  # [N, R]
    rollout: torch.Tensor  # [N]
    group: torch.Tensor  # [N]
    outcome: torch.Tensor  # [N]

    @property
    def response_width(self) -> int:
        return int(self.loss_mask.shape[1])


def compact_vocabulary(dump: SkyRLDump) -> dict[int, int]:
    """Map every token id in ``sequences`` to ``0 … V-1`` (sorted), so a tiny policy can read the step."""
    ids = torch.unique(dump.batch["sequences"]).tolist()
    return {int(t): i for i, t in enumerate(ids)}


def skyrl_credit_batch(
    dump: SkyRLDump, token_map: Optional[Mapping[int, int]] = None, rows: Optional[Sequence[int]] = None
) -> SkyRLCreditBatch:
    """The dump's policy-loss inputs, optionally remapped (``token_map``) and restricted to ``rows``.

    ``rows`` selects, e.g., one of ``metadata["policy_mini_batch_boundaries"]``: each mini-batch is its own
    optimizer step in SkyRL.
    """
    b = dump.batch
    idx = torch.arange(dump.n_rows) if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
    if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= dump.n_rows:
        raise ValueError(f"`rows` must index the dump's {dump.n_rows} real rows, got {list(idx.tolist())[:8]!r}.")
    seq = b["sequences"][idx].long()  # [N, S]
    att = b["attention_mask"][idx].long()  # [N, S]
    if token_map is not None:
        missing = sorted(set(torch.unique(seq).tolist()) - set(int(k) for k in token_map))
        if missing:
            raise ValueError(f"`token_map` must map every token id of the dump, got none for {missing[:5]!r}.")
        lut = {int(k): int(v) for k, v in token_map.items()}
        ids = torch.tensor([[lut[int(t)] for t in row] for row in seq.tolist()], dtype=torch.long)  # [N, S]
    else:
        ids = seq
    pos = (att.cumsum(-1) - 1).clamp_min(0)  # [N, S]
    S, R = seq.shape[1], dump.response_width
    return SkyRLCreditBatch(
        input_ids=ids,
        attention_mask=att,
        position_ids=pos,
        loss_mask=b["loss_mask"][idx].double(),
        advantages=b["advantages"][idx].double(),
        response_tokens=seq[:, S - R :],
        rollout=idx.clone(),
        group=dump.group_of_rows()[idx],
        outcome=dump.advantages_per_row()[idx],
    )


class SkyRLCreditSource(nn.Module):
    """Wraps a causal-LM policy so that ``credit_terms(batch)`` rebuilds a dumped SkyRL step's objective.

    The policy is called as ``policy(input_ids=…, attention_mask=…, position_ids=…)`` and must return
    logits ``[N, S, V]`` (or an object with ``.logits``), as Hugging Face causal LMs do.

    Args:
        policy: the policy module (its parameters are the ones audited).
        loss_reduction: SkyRL's ``loss_reduction``: ``"token_mean"`` (``Z`` = trained tokens in the
            batch), ``"sequence_mean"`` (per-row token mean, then mean over rows) or
            ``"seq_mean_token_sum_norm"`` (per-row token sum / ``R``, then mean over rows).
    """

    def __init__(self, policy: nn.Module, loss_reduction: str = "token_mean") -> None:
        super().__init__()
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"`loss_reduction` must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}.")
        self.policy = policy
        self.loss_reduction = loss_reduction

    def response_logprobs(self, batch: SkyRLCreditBatch) -> torch.Tensor:
        """``[N, R]``: log π of each response-window token given everything before it."""
        out = self.policy(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
        logits = getattr(out, "logits", out)  # [N, S, V]
        S, R = batch.input_ids.shape[1], batch.response_width
        # The token at column S-R+j is predicted by the logits at column S-R+j-1.
        lp = torch.log_softmax(logits[:, S - R - 1 : S - 1], dim=-1)  # [N, R, V]
        return lp.gather(-1, batch.input_ids[:, S - R :, None]).squeeze(-1)  # [N, R]

    def credit_terms(self, batch: Any) -> CreditTerms:
        if not isinstance(batch, SkyRLCreditBatch):
            raise TypeError(f"`batch` must be a SkyRLCreditBatch (see skyrl_credit_batch), got {type(batch).__name__}.")
        lp = self.response_logprobs(batch)  # [N, R]
        m = batch.loss_mask.to(lp.dtype)  # [N, R]
        per = -batch.advantages.to(lp.dtype) * lp * m  # [N, R]
        N, R = per.shape
        if self.loss_reduction == "token_mean":
            terms = per / m.sum().clamp_min(1.0)
        elif self.loss_reduction == "sequence_mean":
            terms = per / (m.sum(-1, keepdim=True).clamp_min(1.0) * N)
        else:
            terms = per / (R * N)
        trained = batch.loss_mask > 0  # [N, R]
        # Untrained positions must hold exactly zero: -0.0 * finite is zero, but a -inf log-prob is not.
        terms = torch.where(trained, terms, torch.zeros_like(terms))
        return CreditTerms(
            terms=terms,
            trained=trained,
            rollout=batch.rollout,
            group=batch.group,
            rewards=batch.outcome,
            tokens=batch.response_tokens,
        )


def audit_skyrl_dump(
    policy: nn.Module,
    dump: SkyRLDump,
    partition: Any = "by_rollout",
    *,
    dtype: Any = "float32",
    token_map: Optional[Mapping[int, int]] = None,
    loss_reduction: str = "token_mean",
    rows: Optional[Sequence[int]] = None,
) -> CreditReport:
    """Disintegrate a dumped SkyRL step's policy gradient at ``policy``'s weights (``by_rollout``, ``by_group``, …)."""
    source = SkyRLCreditSource(policy, loss_reduction)
    batch = skyrl_credit_batch(dump, token_map, rows)
    _check_vocabulary(policy, batch.input_ids)
    return disintegrate(source, batch, partition, dtype=dtype)


def _check_vocabulary(policy: nn.Module, input_ids: torch.Tensor) -> None:
    """Token ids the policy cannot embed are an error naming the id, not an index error deep in a forward."""
    vocab = None
    get = getattr(policy, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in policy.modules() if isinstance(m, nn.Embedding)), None)
    if isinstance(emb, nn.Embedding):
        vocab = int(emb.num_embeddings)
    hi, lo = int(input_ids.max()), int(input_ids.min())
    if lo < 0 or (vocab is not None and hi >= vocab):
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"token id {bad} of the dump lies outside the policy's vocabulary 0..{(vocab or 0) - 1}; pass "
            "`token_map=compact_vocabulary(dump)` to map the dump's ids onto a smaller policy."
        )
