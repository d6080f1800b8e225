"""The verifiable toy task: small-number addition, with an in-memory character tokenizer.

A prompt is ``"a+b="`` with single-digit operands, the answer is the decimal sum followed by ``[EOS]``.
Reward: ``1.0`` for the right sum plus a small format reward (``0.1``) for a completion that is only
digits and ends with ``[EOS]``, so that groups of an untrained policy still have reward variance.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["PAD", "EOS", "UNK", "CHARS", "build_tokenizer", "reward", "prompt_text", "FORMAT_REWARD"]

PAD, EOS, UNK = "[PAD]", "[EOS]", "[UNK]"
CHARS = "0123456789+="
FORMAT_REWARD = 0.1


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` built in memory (no files, no network).

    Vocabulary: ``[PAD]=0, [EOS]=1, [UNK]=2``, then the digits, ``+`` and ``=``.

    Example:
        >>> tok = build_tokenizer()
        >>> tok("12+7=")["input_ids"], tok.decode([4, 5, 1], skip_special_tokens=True)
        ([4, 5, 13, 10, 14], '12')
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # One token per character: the WordLevel model sees each character as its own word.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def reward(a: int, b: int, completion: str, ended: bool) -> float:
    """Outcome reward of one completion (text without special tokens).

    ``1.0`` if the completion is the decimal sum, plus ``FORMAT_REWARD`` if it is a non-empty string of
    digits that ended with ``[EOS]``.

    Example:
        >>> reward(3, 4, "7", True), reward(3, 4, "8", True), reward(3, 4, "7", False), reward(3, 4, "+", True)
        (1.1, 0.1, 1.0, 0.0)
    """
    r = 1.0 if completion == str(a + b) else 0.0
    if ended and completion.isdigit():
        r += FORMAT_REWARD
    return r


def parse_prompt(text: str) -> Optional[tuple[int, int]]:
    left, _, right = text.rstrip("=").partition("+")
    if not (left.isdigit() and right.isdigit()):
        return None
    return int(left), int(right)
