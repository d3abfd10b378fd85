"""A token automaton: the constraint of structured output, as both ends of the ring hold it.

The front end compiles a regex (or a JSON schema, through its regex) over the model's vocabulary
into states and token edges (frontend/structured_output.py, with outlines-core); the engine masks
each constrained row to the edges of the sequence's state, and advances the state by the token it
commits. End-of-sequence is allowed exactly in accepting states (it is no edge of its own).

On the wire it is one run of int32 words in the ring's constraint area (docs/protocol.md,
"Constraint area"), CSR by state:

    [0] n_states   [1] initial state   [2] n_edges
    accepting[n_states]            1: the text so far is a full match
    starts[n_states + 1]           state s's edges are [starts[s], starts[s + 1]), by token id
    tokens[n_edges]                the edge's token
    targets[n_edges]               the state it leads to
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEADER_WORDS = 3


@dataclass(frozen=True, eq=False)
class TokenAutomaton:
    initial: int
    accepting: np.ndarray  # [n_states] bool
    starts: np.ndarray  # [n_states + 1] int32
    tokens: np.ndarray  # [n_edges] int32, ascending within a state
    targets: np.ndarray  # [n_edges] int32

    @property
    def num_states(self) -> int:
        return int(self.accepting.shape[0])

    @property
    def num_words(self) -> int:
        return HEADER_WORDS + 2 * self.num_states + 1 + 2 * int(self.tokens.shape[0])

    @classmethod
    def from_transitions(
        cls, initial: int, transitions: dict[int, dict[int, int]], accepting: set[int], skip: set[int]
    ) -> TokenAutomaton:
        """From state -> {token: next state} with any state ids; edges on `skip` tokens (end of
        sequence: accepting states allow it) are left out. States are renumbered from 0."""
        ids = sorted(
            {initial, *transitions, *accepting, *(t for e in transitions.values() for t in e.values())}
        )
        index = {s: i for i, s in enumerate(ids)}
        starts, tokens, targets = [0], [], []
        for s in ids:
            edges = sorted(
                (tok, index[nxt]) for tok, nxt in transitions.get(s, {}).items() if tok not in skip
            )
            tokens += [t for t, _ in edges]
            targets += [n for _, n in edges]
            starts.append(len(tokens))
        return cls(
            index[initial],
            np.array([s in accepting for s in ids], dtype=bool),
            np.array(starts, dtype=np.int32),
            np.array(tokens, dtype=np.int32),
            np.array(targets, dtype=np.int32),
        )

    def to_words(self) -> np.ndarray:
        n = self.num_states
        header = np.array([n, self.initial, self.tokens.shape[0]], dtype=np.int32)
        return np.concatenate(
            [header, self.accepting.astype(np.int32), self.starts, self.tokens, self.targets]
        )

    @classmethod
    def from_words(cls, words: np.ndarray, vocab_size: int) -> TokenAutomaton:
        """Parse and check words read from the ring; ValueError says what is wrong."""
        words = np.asarray(words, dtype=np.int32)
        if words.shape[0] < HEADER_WORDS:
            raise ValueError("constraint shorter than its header")
        n, initial, n_edges = (int(x) for x in words[:HEADER_WORDS])
        if n < 1 or n_edges < 0 or words.shape[0] != HEADER_WORDS + 2 * n + 1 + 2 * n_edges:
            raise ValueError(
                f"constraint of {words.shape[0]} words does not hold {n} states and {n_edges} edges"
            )
        at = HEADER_WORDS
        accepting = words[at : at + n] != 0
        starts = words[at + n : at + 2 * n + 1]
        tokens = words[at + 2 * n + 1 : at + 2 * n + 1 + n_edges]
        targets = words[at + 2 * n + 1 + n_edges :]
        if not 0 <= initial < n or starts[0] != 0 or starts[-1] != n_edges or (np.diff(starts) < 0).any():
            raise ValueError("constraint states are out of range or their edges out of order")
        if n_edges and (
            tokens.min() < 0 or tokens.max() >= vocab_size or targets.min() < 0 or targets.max() >= n
        ):
            raise ValueError("constraint edges name tokens or states out of range")
        return cls(initial, accepting.copy(), starts.copy(), tokens.copy(), targets.copy())

    def allowed(self, state: int) -> np.ndarray:
        """The tokens with an edge out of `state` (end of sequence not included)."""
        return self.tokens[self.starts[state] : self.starts[state + 1]]

    def advance(self, state: int, token: int) -> int | None:
        """The state after `token`, None when `state` has no edge for it."""
        lo, hi = int(self.starts[state]), int(self.starts[state + 1])
        i = lo + int(np.searchsorted(self.tokens[lo:hi], token))
        return int(self.targets[i]) if i < hi and self.tokens[i] == token else None
