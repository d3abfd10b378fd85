"""Structured output in the reference engine: each constrained row's logits keep only the tokens
its automaton allows from the sequence's state (end of sequence only in accepting states), and the
committed token moves the state on (wire/automaton.py; docs/engine.md, "Structured output").

The mask comes after penalties and logit_bias and before temperature: sampling, greedy and the
logprobs all see the constrained distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import torch

from blink_appliance.engine.reference.sequence import Sequence


def allowed_tokens(seq: Sequence, eos_token_ids: Seq[int]) -> list[int]:
    """The tokens `seq` may take next under its constraint."""
    automaton = seq.params.constraint
    allowed = automaton.allowed(seq.constraint_state).tolist()
    if automaton.accepting[seq.constraint_state]:
        allowed += list(eos_token_ids)
    return allowed


def mask_constrained(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Seq[int]) -> torch.Tensor:
    """Row r of `logits` (for seqs[r]) with -inf outside what its constraint allows; the same tensor
    when no row is constrained, else a copy."""
    if not any(s.params.constraint is not None for s in seqs):
        return logits
    out = torch.full_like(logits, -math.inf)
    for row, seq in enumerate(seqs):
        if seq.params.constraint is None:
            out[row] = logits[row]
        else:
            keep = torch.tensor(allowed_tokens(seq, eos_token_ids), dtype=torch.int64, device=logits.device)
            out[row, keep] = logits[row, keep]
    return out


def advance(seq: Sequence, token: int) -> bool:
    """Move `seq`'s state by the token it committed (not end of sequence); False when its constraint
    has no edge for it."""
    state = seq.params.constraint.advance(seq.constraint_state, token)
    if state is None:
        return False
    seq.constraint_state = state
    return True
