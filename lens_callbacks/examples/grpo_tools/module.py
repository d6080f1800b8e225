"""A multi-turn GRPO loop whose assistant may call a calculator tool.

Each training step samples ``group_size`` episodes per prompt inside ``training_step`` (never again
later), builds the rollout batch with :func:`~lens_callbacks.credit.inputs.trajectories.batch_from_trajectories`
(each turn tokenised on its own; only assistant turns trained; tool results are ``tool`` turns), caches
it as ``last_rollout_batch``, and returns exactly ``self.credit_terms(None).terms.sum()`` as the loss.

Before RL, ``setup("fit")`` runs a short supervised warm start (:meth:`GRPOToolsModule.warm_start`) on
teacher episodes that call the tool, as an SFT stage before RL would; it ends before the Trainer builds
the optimizer and before a run record writes its step-0 policy, so an offline replay starts from the
warm-started weights and needs nothing of it.

Dropout: everything random in step ``N`` is a function of ``seed`` and ``N``. The tokens come from a
generator seeded by both; the dropout masks of the sampling forwards and of every evaluation of
``credit_terms`` on the step's batch come from the global stream, forked and seeded with the batch's
``dropout_seed`` (:meth:`GRPOToolsModule.dropout_seed`). So an audit that re-runs the forward draws the
masks the training forward drew, a run resumed from a checkpoint samples and trains as the uninterrupted
one, and an offline replay rebuilds the seed from the recorded step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader

from lens_callbacks.credit.inputs.terms import CreditTerms
from lens_callbacks.credit.inputs.trajectories import (
    Trajectory,
    TrajectoryBatch,
    TurnSegments,
    batch_from_trajectories,
    turn_segments,
)

from ..resumable import ResumableDataLoader
from ..tiny_policy import check_policy_args, make_optimizer, tiny_gpt2
from .env import VOCAB, build_tokenizer, demonstration, run_episode

_SEGMENT_BY = ("turn", "role", "turn_index")
WARM_START_STEPS = 40
WARM_START_BATCH = 32
_WARM_START_STREAM = 999_983  # offsets the warm start's generator from every step's sampling stream
_STEP_STRIDE = 1_000_003
_DROPOUT_STREAM = 2**62  # above every sampling seed seed·_STEP_STRIDE + step, so the two streams never meet


@dataclass(frozen=True)
class ToolRolloutBatch:
    """What one step trained on: the padded batch, the turn of each position, the advantages."""

    batch: TrajectoryBatch
    segments: TurnSegments
    advantages: torch.Tensor  # [B] float64
    trajectories: tuple[Trajectory, ...]
    dropout_seed: Optional[int] = None  # seeds the global stream around every forward on this batch


@contextlib.contextmanager
def _seeded_stream(seed: Optional[int], device: torch.device) -> Iterator[None]:
    """The global stream (and the device's) forked and seeded with ``seed``; left as it was afterwards."""
    if seed is None:
        yield
        return
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)
        yield


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages ``A_k = (R_k − mean_g R) / (std_g R + eps)`` within each prompt group (float64).

    One pass over the rows whatever the number of groups (scatter sums by group; a loop over the groups was
    quadratic in them).

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])).tolist()
        [0.999998000004, -0.999998000004, 0.0, 0.0]
    """
    r = rewards.double()  # [B]
    _, inv = torch.unique(group, return_inverse=True)  # [B] dense group index
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))  # [G]
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, r) / count  # [G]
    dev = r - mean[inv]  # [B]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, dev * dev) / count  # [G] population variance
    return dev / (var.sqrt()[inv] + eps)


class GRPOToolsModule(LightningModule):
    """GRPO on ``a + b =`` with a calculator the assistant may call.

    Args:
        n_layer, n_embd, n_head: the tiny GPT-2 policy.
        group_size: episodes per prompt.
        max_new_tokens: tokens per assistant turn at most.
        max_tool_calls: tool calls per episode at most.
        temperature: sampling temperature.
        dropout: GPT-2 dropout (its masks are seeded by ``seed`` and the step: see the module docstring).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``. lr, momentum, weight_decay: its settings.
        seed: model init and sampling seed (sampling and dropout at step N use ``seed`` and N only).
        dtype: ``"float32"`` or ``"float64"`` parameters.
        system_prompt: text of the system turn (``""``: no system turn).
        segment_by: the turn segments ``credit_terms`` reports: ``"turn"``, ``"role"`` or ``"turn_index"``.
        padding_side: ``"right"`` or ``"left"``.
        warm_start_steps: supervised steps on teacher episodes before RL (0: none); see :meth:`warm_start`.
        warm_start_lr: the warm start's Adam learning rate.
    """

    def __init__(
        self,
        n_layer: int = 2,
        n_embd: int = 32,
        n_head: int = 2,
        group_size: int = 4,
        max_new_tokens: int = 6,
        max_tool_calls: int = 2,
        temperature: float = 1.0,
        dropout: float = 0.0,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        dtype: str = "float32",
        system_prompt: str = "tools : calc",
        segment_by: str = "turn",
        padding_side: str = "right",
        warm_start_steps: int = WARM_START_STEPS,
        warm_start_lr: float = 0.01,
    ) -> None:
        super().__init__()
        check_policy_args(optimizer, dtype, n_embd, n_head)
        if segment_by not in _SEGMENT_BY:
            raise ValueError(f"`segment_by` must be one of {_SEGMENT_BY}, got {segment_by!r}.")
        if group_size < 1 or max_new_tokens < 1 or max_tool_calls < 0:
            raise ValueError(
                f"`group_size` and `max_new_tokens` must be >= 1 and `max_tool_calls` >= 0, got "
                f"{group_size!r}, {max_new_tokens!r}, {max_tool_calls!r}."
            )
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        if not isinstance(warm_start_steps, int) or warm_start_steps < 0:
            raise ValueError(f"`warm_start_steps` must be an int >= 0 (0: no warm start), got {warm_start_steps!r}.")
        if warm_start_lr <= 0:
            raise ValueError(f"`warm_start_lr` must be > 0, got {warm_start_lr!r}.")
        self.save_hyperparameters()
        self.tokenizer = build_tokenizer()
        self.policy = tiny_gpt2(
            vocab_size=len(VOCAB),
            n_positions=128,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            dropout=dropout,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            seed=seed,
            dtype=dtype,
        )
        self.last_rollout_batch: Optional[ToolRolloutBatch] = None
        self.last_trajectories: list[Trajectory] = []
        self.warm_start_losses: list[float] = []
        self._warm_started = False

    # -- the supervised warm start ----------------------------------------------------------------
    def warm_start(self) -> list[float]:
        r"""Teacher-forced steps on demonstration episodes; returns the loss of each step.

        Each step draws ``WARM_START_BATCH`` prompts ``a + b =`` (operands ``0..9``) and takes one Adam
        step (``warm_start_lr``) on

        ``L = −(1/N) Σ_{k,t} trained[k, t] · log π(y_{k,t} | y_{k,<t})``,  ``N = Σ trained``,

        over the episodes of :func:`~lens_callbacks.examples.grpo_tools.env.demonstration` (``calc a + b`` → tool
        result → answer): only assistant tokens are trained, as in RL. Deterministic: the prompts come
        from a generator of its own, seeded by ``seed``; dropout is off; the global RNG stream is left
        as it was. Called by ``setup("fit")`` unless it already ran on this module.
        """
        hp = self.hparams
        self._warm_started = True
        if hp.warm_start_steps == 0:
            return []
        gen = torch.Generator().manual_seed(int(hp.seed) * 1_000_003 + _WARM_START_STREAM)
        device = next(self.policy.parameters()).device
        opt = torch.optim.Adam(self.policy.parameters(), lr=hp.warm_start_lr)
        was_training = self.policy.training
        self.policy.eval()  # no dropout: nothing random but the prompts, which come from `gen`
        losses: list[float] = []
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for _ in range(hp.warm_start_steps):
                ab = torch.randint(0, 10, (WARM_START_BATCH, 2), generator=gen).tolist()
                demos = [
                    Trajectory(
                        tuple(
                            demonstration(
                                self.tokenizer, x, y, system_prompt=hp.system_prompt, use_tool=hp.max_tool_calls > 0
                            )
                        )
                    )
                    for x, y in ab
                ]
                batch, _ = batch_from_trajectories(self.tokenizer, demos, padding_side=hp.padding_side)
                batch = batch.to(device)
                ids = batch.input_ids  # [B, T]
                logits = self.policy(
                    input_ids=ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
                ).logits  # [B, T, V]
                logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
                trained = batch.trained[:, 1:].to(logp.dtype)  # [B, T-1]
                loss = -(logp * trained).sum() / trained.sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        for p in self.policy.parameters():  # leave no gradient behind for the RL optimizer to see
            p.grad = None
        self.policy.train(was_training)
        self.warm_start_losses = losses
        return losses

    def setup(self, stage: str) -> None:
        # Once per module, before the optimizer exists and before step 0 is recorded; a resumed run
        # gets its weights from the checkpoint instead.
        if stage == "fit" and not self._warm_started and self.trainer.ckpt_path is None:
            self.warm_start()

    # -- rollouts -------------------------------------------------------------------------------
    def dropout_seed(self, step: int) -> int:
        """The seed of step ``step``'s dropout masks: a function of ``seed`` and ``step`` only."""
        return (int(self.hparams.seed) * _STEP_STRIDE + int(step)) % _DROPOUT_STREAM + _DROPOUT_STREAM

    def rollout(self, prompts: Sequence[dict], step: int) -> list[Trajectory]:
        """Sample ``group_size`` episodes per prompt with a generator seeded by (seed, step) only.

        The sampling forwards' dropout masks come from the global stream seeded with
        :meth:`dropout_seed` ``(step)``, inside a fork: the stream outside is left as it was.
        """
        hp = self.hparams
        gen = torch.Generator().manual_seed(int(hp.seed) * _STEP_STRIDE + int(step))
        out: list[Trajectory] = []
        with _seeded_stream(self.dropout_seed(step), self.device):
            for g, p in enumerate(prompts):
                for _ in range(hp.group_size):
                    turns, r = run_episode(
                        self.policy,
                        self.tokenizer,
                        int(p["a"]),
                        int(p["b"]),
                        system_prompt=hp.system_prompt,
                        max_new_tokens=hp.max_new_tokens,
                        max_tool_calls=hp.max_tool_calls,
                        temperature=hp.temperature,
                        generator=gen,
                    )
                    out.append(Trajectory(tuple(turns), r, g, len(out), str(p["prompt_id"]), int(step)))
        return out

    def make_rollout_batch(self, trajectories: Sequence[Trajectory]) -> ToolRolloutBatch:
        """The rollout batch of one step's trajectories (from sampling, or read back from a run record).

        Its ``dropout_seed`` is :meth:`dropout_seed` of the trajectories' step, so a batch rebuilt from a
        record draws the masks training drew.
        """
        steps = {int(t.step) for t in trajectories}
        if len(steps) != 1:
            raise ValueError(
                f"`trajectories` must all come from one step (their dropout masks are seeded by it), got steps {sorted(steps)}."
            )
        batch, segments = batch_from_trajectories(self.tokenizer, trajectories, padding_side=self.hparams.padding_side)
        return ToolRolloutBatch(
            batch,
            segments,
            group_advantages(batch.rewards, batch.group),
            tuple(trajectories),
            self.dropout_seed(steps.pop()),
        )

    # -- the one interface ----------------------------------------------------------------------
    def credit_terms(self, batch: Any = None) -> CreditTerms:
        r"""``terms[k, t] = −A_k · log π(y_{k,t} | y_{k,<t}) · trained[k, t] / N_trained``."""
        if isinstance(batch, ToolRolloutBatch):
            rb = batch
        elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], Trajectory):
            rb = self.make_rollout_batch(batch)
        else:
            rb = self.last_rollout_batch
        if rb is None:
            raise ValueError("`credit_terms` needs a rollout batch; none was given and no step has run yet.")
        b = rb.batch.to(self.device)
        with _seeded_stream(rb.dropout_seed, self.device):
            logits = self.policy(
                input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
            ).logits  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        logp = F.pad(logp, (1, 0))  # [B, T]; position 0 is never trained (it has no context)
        trained = b.trained  # [B, T]
        n = trained.sum().clamp(min=1)
        adv = rb.advantages.to(device=logp.device, dtype=logp.dtype)  # [B]
        terms = -(adv[:, None] * logp) * trained.to(logp.dtype) / n  # [B, T]
        segment, names = turn_segments(rb.segments, self.hparams.segment_by, rollout=b.rollout)
        return CreditTerms(
            terms, trained, b.rollout, b.group, segment.to(trained.device), names, rewards=b.rewards, tokens=b.input_ids
        )

    # -- Lightning ------------------------------------------------------------------------------
    def training_step(self, batch: Sequence[dict], batch_idx: int) -> torch.Tensor:
        trajs = self.rollout(batch, self.global_step)
        self.last_trajectories = trajs
        self.last_rollout_batch = self.make_rollout_batch(trajs)
        loss = self.credit_terms(None).terms.sum()
        n = len(trajs)
        self.log_dict(
            {
                "train/loss": loss.detach().float(),
                "train/reward": sum(t.reward for t in trajs) / n,
                # the system turn is the same fixed text in every episode: not counted as a turn
                "train/turns": sum(sum(x.role != "system" for x in t.turns) for t in trajs) / n,
                "train/tool_calls": sum(t.n_tool_calls for t in trajs) / n,
                "train/tool_use": sum(t.n_tool_calls > 0 for t in trajs) / n,
            },
            batch_size=n,
        )
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return make_optimizer(self.parameters(), hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)


def _collate(items: list[dict]) -> list[dict]:
    return list(items)


class ToolsAdditionDataModule(LightningDataModule):
    """Prompts ``a + b =`` with operands in ``0 .. max_operand`` (a fixed, seeded list).

    Args:
        n_prompts: prompts in the list.
        prompts_per_step: prompts per training step (each gets ``group_size`` episodes).
        max_operand: largest operand.
        data_seed: the list's seed (named apart from the module's ``seed`` so loggers keep both).
    """

    def __init__(
        self, n_prompts: int = 64, prompts_per_step: int = 2, max_operand: int = 9, data_seed: int = 0
    ) -> None:
        super().__init__()
        if n_prompts < 1 or prompts_per_step < 1:
            raise ValueError(
                f"`n_prompts` and `prompts_per_step` must be >= 1, got {n_prompts!r}, {prompts_per_step!r}."
            )
        if not 0 <= max_operand <= 9:
            raise ValueError(f"`max_operand` must be in 0..9 (sums stay in the vocabulary), got {max_operand!r}.")
        self.save_hyperparameters()
        self.n_prompts, self.prompts_per_step, self.max_operand, self.data_seed = (
            n_prompts,
            prompts_per_step,
            max_operand,
            data_seed,
        )

    def prompts(self) -> list[dict]:
        g = torch.Generator().manual_seed(self.data_seed)
        ab = torch.randint(0, self.max_operand + 1, (self.n_prompts, 2), generator=g).tolist()
        return [{"a": a, "b": b, "prompt_id": f"{a}+{b}"} for a, b in ab]

    def train_dataloader(self) -> DataLoader:
        # Resumable: a run resumed mid-epoch continues with the prompts the uninterrupted run took next.
        return ResumableDataLoader(self.prompts(), batch_size=self.prompts_per_step, shuffle=False, collate_fn=_collate)
