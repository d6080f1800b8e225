"""What the examples share: a tiny GPT-2 policy built offline, and the optimizer the config names.

Both examples (``lens_callbacks.examples.grpo``, ``lens_callbacks.examples.grpo_tools``) build their policy and optimizer here, so
a seed gives the same initial weights however the module is constructed, and an offline replay
(``lens-callbacks audit``) rebuilds exactly the optimizer the run used.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["DTYPES", "OPTIMIZERS", "check_policy_args", "tiny_gpt2", "make_optimizer"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
OPTIMIZERS = ("adam", "adamw", "sgd")


def check_policy_args(optimizer: str, dtype: str, n_embd: int, n_head: int) -> None:
    """Raise a ``ValueError`` naming the bad value for an unknown optimizer or dtype, or a bad GPT-2 shape."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {list(OPTIMIZERS)}, got {optimizer!r}.")
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {list(DTYPES)}, got {dtype!r}.")
    if n_embd % n_head != 0:
        raise ValueError(f"`n_embd` must be divisible by `n_head`, got n_embd={n_embd!r}, n_head={n_head!r}.")


def tiny_gpt2(
    *,
    vocab_size: int,
    n_positions: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    dropout: float,
    eos_id: int,
    pad_id: int,
    seed: int,
    dtype: str,
    init_std: float = 0.02,
) -> torch.nn.Module:
    """A ``GPT2LMHeadModel`` whose initial weights depend on ``seed`` only.

    The weights are drawn from the CPU generator seeded with ``seed`` inside ``fork_rng``, so the
    global random stream (CPU and CUDA) is the same before and after. Attention is the eager (math)
    implementation, which behaves the same in float32 and float64, with dropout, and under forward AD.
    ``init_std`` is GPT-2's ``initializer_range`` (the std of the initial weights; 0.02 is GPT-2's own).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=init_std,
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return GPT2LMHeadModel(config).to(DTYPES[dtype])


def make_optimizer(
    params: Iterable[torch.nn.Parameter], optimizer: str, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``torch.optim.Adam``, ``AdamW`` or ``SGD`` (``momentum`` is used by SGD only) over the trainable ``params``."""
    params = [p for p in params if p.requires_grad]
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"`optimizer` must be one of {list(OPTIMIZERS)}, got {optimizer!r}.")
