"""The GRPO example with a probe objective: the likelihood of reference answers to additions.

GRPO trains on sampled completions and their reward; the probe asks something the reward does not:
how likely the policy finds the *right* answer, written out, to a fixed set of additions. Two named
probe batches split it by task type, as the training batches' ``source`` does: ``no_carry`` (one-digit
sums) and ``carry`` (two-digit sums). ``ProbeCreditCallback`` reads, every step, which rollouts moved
each probe, and checks the prediction against the probe's real change.

YAML class path: ``lens_callbacks.examples.grpo.probe.GRPOProbeModule`` (see cli_configs/grpo_probe.yaml).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from .module import GRPOModule
from .task import prompt_text

__all__ = ["GRPOProbeModule", "probe_pairs"]

#: An addition prompt as :func:`~lens_callbacks.examples.grpo.task.prompt_text` writes it.
_ADDITION = re.compile(r"^\s*([0-9]{1,3})\s*\+\s*([0-9]{1,3})\s*=\s*$")


def probe_pairs(n: int = 16, seed: int = 12345, max_operand: int = 9) -> dict[str, torch.Tensor]:
    """``{"no_carry": [n, 2], "carry": [n, 2]}`` operand pairs, drawn from a generator of their own.

    >>> p = probe_pairs(4)
    >>> bool((p["carry"].sum(1) >= 10).all()), bool((p["no_carry"].sum(1) < 10).all())
    (True, True)
    """
    g = torch.Generator().manual_seed(seed)
    grid = torch.cartesian_prod(torch.arange(max_operand + 1), torch.arange(max_operand + 1))  # [(m+1)², 2]
    grid = grid[torch.randperm(grid.shape[0], generator=g)]
    carry = grid.sum(1) >= 10  # [(m+1)²]
    return {"no_carry": grid[~carry][:n].clone(), "carry": grid[carry][:n].clone()}


class GRPOProbeModule(GRPOModule):
    """:class:`~lens_callbacks.examples.grpo.GRPOModule` with ``probe_batches()`` and ``probe_loss(pairs)``.

    Args:
        n_probe: additions per probe batch (each of ``no_carry`` and ``carry``).
        probe_seed: seeds the probe's additions (the global random stream is left alone).
        **kwargs: :class:`~lens_callbacks.examples.grpo.GRPOModule`'s arguments.
    """

    def __init__(self, n_probe: int = 16, probe_seed: int = 12345, **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(n_probe, bool) or not isinstance(n_probe, int) or n_probe < 1:
            raise ValueError(f"`n_probe` must be a positive int, got {n_probe!r}.")
        self.n_probe = n_probe
        self._probe = probe_pairs(n_probe, probe_seed)

    def make_probe_batch(self, trajectories) -> torch.Tensor:
        """Operand pairs ``[n, 2]`` of probe trajectories (a probe file for ``lens-callbacks audit --probe``): each
        trajectory's first user turn is an addition prompt ``"a+b="`` (the reference answer is the probe's own).

        >>> from lens_callbacks.credit.inputs.trajectories import Trajectory, Turn
        >>> GRPOProbeModule.make_probe_batch(None, [Trajectory((Turn("user", "3+4="),), 0.0, 0, 0)]).tolist()
        [[3, 4]]
        """
        pairs = []
        for k, traj in enumerate(trajectories):
            user = next((t for t in traj.turns if t.role == "user"), None)
            m = _ADDITION.match(user.text) if user is not None else None
            if m is None:
                shown = repr(user.text[:40]) if user is not None else "no user turn"
                raise ValueError(
                    f"trajectory {k} (rollout {traj.rollout}): its first user turn must be an addition prompt "
                    f"'a+b=' (operands of at most three digits), got {shown}."
                )
            pairs.append((int(m.group(1)), int(m.group(2))))
        return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)

    def probe_batches(self) -> dict[str, torch.Tensor]:
        """The named probe batches: operand pairs ``[n, 2]`` per name."""
        return {name: pairs.to(self.device) for name, pairs in self._probe.items()}

    def probe_loss(self, pairs: torch.Tensor, reduction: Optional[str] = "mean") -> torch.Tensor:
        """Mean negative log-likelihood per token of the reference answer and ``[EOS]``, teacher-forced.

        ``reduction=None`` returns one value per prompt ``[n]``.
        """
        if not isinstance(pairs, torch.Tensor):  # probe trajectories, as an offline probe file holds them
            pairs = self.make_probe_batch(pairs)
        pairs = pairs.long().cpu()
        rows = []
        for a, b in pairs.tolist():
            prompt = self.tokenizer(prompt_text(a, b))["input_ids"]
            answer = self.tokenizer(str(a + b))["input_ids"] + [self.eos_id]
            rows.append((prompt, answer))
        L = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)  # [n, L]
        target = torch.zeros(len(rows), L, dtype=torch.bool)  # [n, L] the answer's positions
        for k, (p, a) in enumerate(rows):
            ids[k, : len(p) + len(a)] = torch.tensor(p + a)
            target[k, len(p) : len(p) + len(a)] = True
        ids, target = ids.to(self.device), target.to(self.device)
        logits = self.policy(input_ids=ids, attention_mask=(ids != self.pad_id).long()).logits  # [n, L, V]
        logp = torch.log_softmax(
            logits[:, :-1].float() if logits.dtype in (torch.float16, torch.bfloat16) else logits[:, :-1], -1
        )
        tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [n, L-1]
        mask = target[:, 1:].to(tok.dtype)  # [n, L-1]
        per_prompt = -(tok * mask).sum(1) / mask.sum(1)  # [n]
        return per_prompt if reduction is None else per_prompt.mean()
