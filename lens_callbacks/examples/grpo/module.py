"""A single-turn GRPO LightningModule on a tiny transformers policy, with ``credit_terms`` implemented.

One training step: take ``P`` prompts, sample ``group_size`` completions per prompt inside
``training_step`` (no re-sampling later), score them with the verifiable reward, normalise the rewards
within each group into advantages, and train on

.. math::

    L = \\sum_{k,t} \\text{terms}[k, t], \\qquad
    \\text{terms}[k, t] = -\\frac{A_k \\, \\log\\pi(y_{k,t} \\mid y_{k,<t})}{|y_k| \\, B}\\,\\text{mask}[k, t],

with ``A_k = (R_k - mean_g R) / (std_g R + 1e-4)`` over the ``G`` rollouts of its group. The loss IS
``credit_terms(None).terms.sum()``, so the terms add up to the loss by construction.

Dropout: a rollout batch carries a ``dropout_seed`` drawn from the global stream when it is built, and
every evaluation of ``credit_terms`` on that batch runs its forward under ``fork_rng`` seeded with it.
So an audit that re-runs the forward draws the very dropout masks the training forward drew, and
neither consumes the training run's random stream.

Resume: the sampling of step ``N`` (tokens and the dropout seed) draws from its own generator, seeded
by the run's sampling seed and ``N`` only. The sampling seed is drawn once from the global stream when
the fit starts (so ``seed_everything`` still picks the run) and travels in the checkpoint, and the data
order is resumable (:class:`~lens_callbacks.examples.resumable.ResumableDataLoader`): a run killed at any step and
resumed from its last checkpoint takes the very steps of the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import torch

try:
    from lightning.pytorch import LightningModule
except ImportError:  # pragma: no cover
    from pytorch_lightning import LightningModule  # type: ignore

from lens_callbacks.credit.inputs.terms import CreditTerms

from ..tiny_policy import check_policy_args, make_optimizer, tiny_gpt2
from .task import EOS, PAD, UNK, build_tokenizer, prompt_text, reward

__all__ = ["GRPOModule", "RolloutBatch", "Rollout", "grpo_advantages", "SOURCE_NAMES"]

# The task type of a prompt, for `by_source`: a one-digit answer, or a two-digit one that needs a carry.
SOURCE_NAMES = ("no_carry", "carry")


def grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``A_k = (R_k − mean_g R) / (std_g R + 1e-4)`` over each group of ``group_size`` consecutive rows.

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 2).tolist()
    [0.7070067953266834, -0.7070067953266834, 0.0, 0.0]
    """
    r = rewards.view(-1, group_size)  # [P, G]
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).reshape(-1)  # [B]


@dataclass
class RolloutBatch:
    """The rollouts of one step, as the policy trained on them (rows = rollouts, ``B = P * G``)."""

    input_ids: torch.Tensor  # [B, L] prompt + completion, [PAD] after [EOS]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L] bool, the trained positions (completion tokens incl. [EOS])
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    group: torch.Tensor  # [B]
    rollout: torch.Tensor  # [B]
    prompt_len: int
    dropout_seed: int
    source: Optional[torch.Tensor] = None  # [B] index into SOURCE_NAMES: does the sum carry?

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class Rollout:
    """One rollout of a step, for run records: texts, token ids, reward and ids."""

    prompt: str
    completion: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # the trained tokens, [EOS] included when sampled
    reward: float
    group: int
    rollout: int
    prompt_id: str
    ended: bool

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_ids"] = list(self.prompt_ids)
        d["completion_ids"] = list(self.completion_ids)
        return d


class GRPOModule(LightningModule):
    """Single-turn GRPO on ``"a+b="`` with a tiny ``GPT2LMHeadModel`` built offline.

    Args:
        n_layer, n_embd, n_head: GPT-2 shape (``n_embd`` divisible by ``n_head``).
        group_size: completions sampled per prompt (``G >= 2``, so a group has a baseline).
        max_new_tokens: longest completion (the answer has at most 2 digits, plus ``[EOS]``).
        temperature: sampling temperature (> 0).
        dropout: GPT-2 residual, embedding and attention dropout.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        lr, momentum, weight_decay: optimizer settings (``momentum`` is used by SGD only).
        seed: seeds the policy's initial weights (the global RNG is left alone).
        dtype: ``"float32"`` or ``"float64"`` policy weights.
        init_std: std of the initial weights (GPT-2's ``initializer_range``; 0.02 is GPT-2's own). A wider
            start (0.1, the demo's) gives a policy whose outputs already depend on the prompt, so GRPO
            can learn per-prompt answers before the shared bias toward one answer takes over.
    """

    def __init__(
        self,
        n_layer: int = 2,
        n_embd: int = 32,
        n_head: int = 2,
        group_size: int = 4,
        max_new_tokens: int = 3,
        temperature: float = 1.0,
        dropout: float = 0.0,
        optimizer: str = "adam",
        lr: float = 3e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        dtype: str = "float32",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        check_policy_args(optimizer, dtype, n_embd, n_head)
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or not init_std > 0:
            raise ValueError(f"`init_std` must be a float > 0 (0.02 is GPT-2's own), got {init_std!r}.")
        if not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"`group_size` must be an int >= 2 (a group needs a baseline), got {group_size!r}.")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be a positive int, got {max_new_tokens!r}.")
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}.")
        self.save_hyperparameters()
        self.tokenizer = build_tokenizer()
        self.pad_id = self.tokenizer.convert_tokens_to_ids(PAD)
        self.eos_id = self.tokenizer.convert_tokens_to_ids(EOS)
        self.unk_id = self.tokenizer.convert_tokens_to_ids(UNK)
        self.policy = tiny_gpt2(
            vocab_size=len(self.tokenizer),
            n_positions=16,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            dropout=dropout,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            seed=seed,
            dtype=dtype,
            init_std=float(init_std),
        )
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.temperature = float(temperature)
        self.last_rollout_batch: Optional[RolloutBatch] = None
        self.last_rollouts: list[Rollout] = []
        self.sample_seed: Optional[int] = None  # drawn at the start of fit; kept in the checkpoint

    # ---- sampling -------------------------------------------------------------------------------

    def step_generator(self, step: int) -> torch.Generator:
        """The sampling generator of optimizer step ``step``: a function of the sampling seed and ``step`` only."""
        if self.sample_seed is None:
            self.sample_seed = int(torch.randint(0, 2**62, (1,)).item())
        return torch.Generator(device=self.device).manual_seed((self.sample_seed + 1_000_003 * int(step)) % 2**63)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.sample_seed is None:
            # From the global stream, so seed_everything picks the run; a resumed run restores it from the
            # checkpoint (on_load_checkpoint runs after setup).
            self.sample_seed = int(torch.randint(0, 2**62, (1,)).item())

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["grpo_sample_seed"] = self.sample_seed

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if checkpoint.get("grpo_sample_seed") is not None:
            self.sample_seed = int(checkpoint["grpo_sample_seed"])

    @torch.no_grad()
    def sample_rollouts(
        self, pairs: torch.Tensor, generator: Optional[torch.Generator] = None
    ) -> tuple[RolloutBatch, list[Rollout]]:
        """Sample ``group_size`` completions for each prompt ``(a, b)`` of ``pairs`` ``[P, 2]``.

        ``generator`` draws the tokens and the dropout seed; None: inside ``training_step`` the step's
        :meth:`step_generator`, elsewhere the global stream.
        """
        if generator is None:
            generator = getattr(self, "_step_sampling", None)
        pairs = pairs.long().cpu()
        P, G = int(pairs.shape[0]), self.group_size
        texts = [prompt_text(a, b) for a, b in pairs.tolist()]
        enc = [self.tokenizer(t)["input_ids"] for t in texts]
        lp = len(enc[0])
        if any(len(e) != lp for e in enc):
            raise ValueError("prompts must all have the same length (single-digit operands).")
        device = self.device
        prompt_ids = torch.tensor(enc, dtype=torch.long, device=device)  # [P, Lp]
        ids = prompt_ids.repeat_interleave(G, dim=0)  # [B, Lp]
        B = P * G
        done = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
        was_training = self.policy.training
        self.policy.eval()
        try:
            for _ in range(self.max_new_tokens):
                am = (ids != self.pad_id).long()  # [B, L] pads only follow [EOS]
                logits = (
                    self.policy(input_ids=ids, attention_mask=am).logits[:, -1].float() / self.temperature
                )  # [B, V]
                logits[:, self.pad_id] = float("-inf")
                logits[:, self.unk_id] = float("-inf")
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)  # [B]
                nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
                ids = torch.cat([ids, nxt[:, None]], dim=1)  # [B, L]
                done |= nxt == self.eos_id
                if bool(done.all()):
                    break
        finally:
            self.policy.train(was_training)
        L = ids.shape[1]
        comp = ids[:, lp:].cpu()  # [B, L - Lp]
        completion_mask = torch.zeros(B, L, dtype=torch.bool)  # [B, L]
        rewards = torch.zeros(B, dtype=torch.float64)  # [B]
        rollouts: list[Rollout] = []
        for k in range(B):
            row = comp[k].tolist()
            n = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            ended = self.eos_id in row
            completion_mask[k, lp : lp + n] = True
            text = self.tokenizer.decode(row[: n - 1] if ended else row[:n], skip_special_tokens=True)
            a, b = pairs[k // G].tolist()
            rewards[k] = reward(a, b, text, ended)
            rollouts.append(
                Rollout(
                    prompt=texts[k // G],
                    completion=text,
                    prompt_ids=tuple(enc[k // G]),
                    completion_ids=tuple(row[:n]),
                    reward=float(rewards[k]),
                    group=k // G,
                    rollout=k,
                    prompt_id=f"{a}+{b}",
                    ended=ended,
                )
            )
        adv = grpo_advantages(rewards, G)  # [B]
        wdtype = self.policy.dtype
        batch = RolloutBatch(
            input_ids=ids,
            attention_mask=(torch.arange(L)[None, :] < (lp + completion_mask.sum(1))[:, None]).long().to(device),
            completion_mask=completion_mask.to(device),
            advantages=adv.to(device=device, dtype=wdtype),
            rewards=rewards.to(device=device, dtype=wdtype),
            group=torch.arange(P).repeat_interleave(G).to(device),
            rollout=torch.arange(B).to(device),
            prompt_len=lp,
            # Drawn from the step's stream so the run stays seeded; replayed by every credit_terms call.
            dropout_seed=int(
                torch.randint(
                    0, 2**62, (1,), generator=generator, device=generator.device if generator is not None else None
                ).item()
            ),
            source=(pairs.sum(1) >= 10).long().repeat_interleave(G).to(device),
        )
        return batch, rollouts

    # ---- the credit interface -------------------------------------------------------------------

    def credit_terms(self, batch: Any = None) -> CreditTerms:
        """Per-position GRPO terms of a rollout batch (``batch``, else the one cached by ``training_step``)."""
        rb = batch if isinstance(batch, RolloutBatch) else self.last_rollout_batch
        if rb is None:
            raise RuntimeError(
                "`credit_terms` needs a rollout batch: pass a RolloutBatch, or call it after `training_step` "
                "has cached one in `last_rollout_batch`."
            )
        B = rb.batch_size
        with self._replay_dropout(rb):
            logits = self.policy(input_ids=rb.input_ids, attention_mask=rb.attention_mask).logits  # [B, L, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, L-1, V]
        logp_tok = logp.gather(-1, rb.input_ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
        mask = rb.completion_mask[:, 1:]  # [B, L-1]
        n_tok = rb.completion_mask.sum(dim=1).clamp(min=1).to(logp_tok.dtype)  # [B]
        adv = rb.advantages.to(logp_tok.dtype)  # [B]
        per = (-adv / (n_tok * B))[:, None] * logp_tok  # [B, L-1]
        per = torch.where(mask, per, torch.zeros_like(per))  # untrained positions hold exactly zero
        terms = torch.cat([torch.zeros_like(per[:, :1]), per], dim=1)  # [B, L]
        return CreditTerms(
            terms=terms,
            trained=rb.completion_mask,
            rollout=rb.rollout,
            group=rb.group,
            rewards=rb.rewards,
            tokens=rb.input_ids,
            advantages=rb.advantages,
            source=rb.source,
            source_names=SOURCE_NAMES if rb.source is not None else None,
        )

    @contextlib.contextmanager
    def _replay_dropout(self, rb: RolloutBatch) -> Iterator[None]:
        dev = rb.input_ids.device
        devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(rb.dropout_seed)
            if devices:
                with torch.cuda.device(devices[0]):
                    torch.cuda.manual_seed(rb.dropout_seed)
            yield

    # ---- Lightning ------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pairs = batch[0] if isinstance(batch, (list, tuple)) else batch  # [P, 2]
        # Through an attribute, not an argument: subclasses that override sample_rollouts(pairs) keep working.
        self._step_sampling = self.step_generator(self.global_step)
        try:
            rb, rollouts = self.sample_rollouts(pairs)
        finally:
            self._step_sampling = None
        self.last_rollout_batch = rb
        self.last_rollouts = rollouts
        loss = self.credit_terms(None).terms.sum()
        P = int(pairs.shape[0])
        r = rb.rewards.detach().float()
        correct = torch.tensor([ro.completion == str(sum(map(int, ro.prompt_id.split("+")))) for ro in rollouts])
        self.log("train/loss", loss.detach(), batch_size=P)
        self.log("train/reward", r.mean(), prog_bar=True, batch_size=P)
        self.log("train/accuracy", correct.float().mean(), prog_bar=True, batch_size=P)
        return loss

    @torch.no_grad()
    def greedy_answers(self, pairs: torch.Tensor) -> list[str]:
        """Greedy (argmax) completions for the prompts ``(a, b)`` of ``pairs`` ``[P, 2]``, as text.

        No random number is drawn, so scoring a validation set leaves the training run's stream alone.
        """
        pairs = pairs.long().cpu()
        texts = [prompt_text(a, b) for a, b in pairs.tolist()]
        ids = torch.tensor(
            [self.tokenizer(t)["input_ids"] for t in texts], dtype=torch.long, device=self.device
        )  # [P, Lp]
        lp = ids.shape[1]
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)  # [P]
        was_training = self.policy.training
        self.policy.eval()
        try:
            for _ in range(self.max_new_tokens):
                am = (ids != self.pad_id).long()  # [P, L]
                logits = self.policy(input_ids=ids, attention_mask=am).logits[:, -1].float()  # [P, V]
                logits[:, self.pad_id] = float("-inf")
                logits[:, self.unk_id] = float("-inf")
                nxt = torch.where(done, torch.full_like(done, self.pad_id, dtype=torch.long), logits.argmax(-1))  # [P]
                ids = torch.cat([ids, nxt[:, None]], dim=1)  # [P, L]
                done |= nxt == self.eos_id
                if bool(done.all()):
                    break
        finally:
            self.policy.train(was_training)
        out = []
        for row in ids[:, lp:].tolist():
            n = row.index(self.eos_id) if self.eos_id in row else len(row)
            out.append(self.tokenizer.decode(row[:n], skip_special_tokens=True))
        return out

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """``val/accuracy``: share of held-out prompts whose greedy completion is the right sum."""
        pairs = batch[0] if isinstance(batch, (list, tuple)) else batch  # [P, 2]
        answers = self.greedy_answers(pairs)
        correct = torch.tensor([ans == str(a + b) for ans, (a, b) in zip(answers, pairs.long().tolist())])
        self.log("val/accuracy", correct.float().mean(), on_step=False, on_epoch=True, batch_size=len(answers))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return make_optimizer(self.parameters(), hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)
