"""The calculator environment: an in-memory tokenizer, the tool, the reward, and one multi-turn episode.

An episode is ``system → user → assistant (→ tool → assistant)*``. An assistant turn that contains the
word ``calc`` calls the calculator on the words after it; the result comes back as a ``tool`` turn
(not trained) and the assistant speaks again, up to ``max_tool_calls`` times. The reward is read from
the last assistant turn. :func:`demonstration` writes the episode a teacher would: call the tool on the
prompt's operands, then answer with its result (the warm start before RL trains on these).
"""

from __future__ import annotations

from typing import Optional

import torch

from lens_callbacks.credit.inputs.trajectories import ToolCall, Turn, encode_text

MAX_NUMBER = 19
EOT = "<eot>"
PAD = "<pad>"
TOOL_NAME = "calc"
VOCAB: tuple[str, ...] = (PAD, EOT, TOOL_NAME, "+", "=", ":", "tools", "error") + tuple(
    str(i) for i in range(MAX_NUMBER + 1)
)


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over :data:`VOCAB`, built in memory (no files, no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOT)


def calculator(arguments: str) -> str:
    """Add up the numbers in ``arguments`` (``+`` signs optional); ``"error"`` without any number or past 19.

    >>> calculator("3 + 4"), calculator("3 4 +"), calculator("+"), calculator("19 + 1")
    ('7', '7', 'error', 'error')
    """
    nums = [int(w) for w in arguments.split() if w.isdigit()]
    if not nums or any(w != "+" and not w.isdigit() for w in arguments.split()):
        return "error"
    total = sum(nums)
    return str(total) if total <= MAX_NUMBER else "error"


def first_number(text: str) -> Optional[int]:
    for w in text.split():
        if w.isdigit():
            return int(w)
    return None


def reward(answer_text: str, target: int) -> float:
    """1 for the right sum, partial credit ``0.5·max(0, 1 − |n − target| / 10)`` for a near one, else 0."""
    n = first_number(answer_text)
    if n is None:
        return 0.0
    if n == target:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(n - target) / 10.0)


@torch.no_grad()
def sample_turn(
    policy, context: list[int], max_new_tokens: int, temperature: float, generator: torch.Generator, eot_id: int
) -> list[int]:
    """Sample one assistant turn (stops after ``<eot>`` or ``max_new_tokens``) from the full softmax."""
    out: list[int] = []
    ids = list(context)
    device = next(policy.parameters()).device
    for _ in range(max_new_tokens):
        x = torch.tensor([ids], dtype=torch.long, device=device)  # [1, L]
        logits = policy(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].double()  # [V]
        probs = torch.softmax(logits / temperature, dim=-1).cpu()  # [V]
        tok = int(torch.multinomial(probs, 1, generator=generator))
        out.append(tok)
        ids.append(tok)
        if tok == eot_id:
            break
    return out


def _untrained(tokenizer, role: str, text: str) -> Turn:
    """A turn the policy is given, not one it samples: tokenised on its own, not trained."""
    return Turn(role, text, tuple(encode_text(tokenizer, text)), False)


def _opening(tokenizer, a: int, b: int, system_prompt: str) -> list[Turn]:
    """The turns an episode starts from: the system turn (unless ``system_prompt`` is empty), then ``a + b =``."""
    turns = [_untrained(tokenizer, "system", system_prompt)] if system_prompt else []
    turns.append(_untrained(tokenizer, "user", f"{a} + {b} ="))
    return turns


def run_episode(
    policy,
    tokenizer,
    a: int,
    b: int,
    *,
    system_prompt: str,
    max_new_tokens: int,
    max_tool_calls: int,
    temperature: float,
    generator: torch.Generator,
) -> tuple[list[Turn], float]:
    """One trajectory for the prompt ``a + b =``: its turns (with token ids) and its outcome reward."""
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    turns = _opening(tokenizer, a, b, system_prompt)
    calls = 0
    while True:
        context = [i for t in turns for i in t.token_ids]
        ids = sample_turn(policy, context, max_new_tokens, temperature, generator, eot_id)
        text = tokenizer.decode(ids)
        words = text.split()
        call = None
        if TOOL_NAME in words and calls < max_tool_calls:
            args = " ".join(w for w in words[words.index(TOOL_NAME) + 1 :] if w != EOT)
            call = ToolCall(TOOL_NAME, args)
        turns.append(Turn("assistant", text, tuple(ids), True, call))
        if call is None:
            break
        calls += 1
        result = calculator(call.arguments)
        turns.append(_untrained(tokenizer, "tool", result))
    return turns, reward(turns[-1].text, a + b)


def demonstration(tokenizer, a: int, b: int, *, system_prompt: str, use_tool: bool = True) -> list[Turn]:
    """The teacher's episode for ``a + b =``: ``assistant "calc a + b" → tool "a+b" → assistant "a+b"``.

    Assistant turns end with ``<eot>`` as sampled ones do; without ``use_tool`` the assistant answers at once.

    >>> tok = build_tokenizer()
    >>> [(t.role, t.text) for t in demonstration(tok, 3, 4, system_prompt="")]
    [('user', '3 + 4 ='), ('assistant', 'calc 3 + 4 <eot>'), ('tool', '7'), ('assistant', '7 <eot>')]
    """
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    turns = _opening(tokenizer, a, b, system_prompt)

    def say(text: str, call: Optional[ToolCall] = None) -> Turn:
        ids = tuple(encode_text(tokenizer, text)) + (eot_id,)
        return Turn("assistant", tokenizer.decode(list(ids)), ids, True, call)

    if use_tool:
        args = f"{a} + {b}"
        result = calculator(args)
        turns.append(say(f"{TOOL_NAME} {args}", ToolCall(TOOL_NAME, args)))
        turns.append(_untrained(tokenizer, "tool", result))
    turns.append(say(str(a + b)))
    return turns
