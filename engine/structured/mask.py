"""The grammar's hook into sampling: before `sample`, mask the constrained rows' logits to the
tokens their grammar allows now; after it, feed each sampled token back into its matcher.

Rows without a grammar are not touched, and a batch with none costs one list scan. The masks
of all constrained rows go into one bitmask and one `apply_token_bitmask_inplace` call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


def constrain(logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
    """logits: [B, V], modified in place; matchers: [B], None for an unconstrained row. A
    matcher that has ended (its output complete, and the request still running because
    min_tokens is not reached) allows no token: the executor fails that row's request alone."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [B, ceil(V / 32)] int32
    for i in rows:
        if matchers[i].is_terminated():
            bitmask[i] = 0
        else:
            matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def advance(matchers: Sequence[xgr.GrammarMatcher | None], tokens: Sequence[int]) -> list[int]:
    """Accept each constrained row's sampled token; returns the rows whose matcher refused it.
    A token the mask allowed is always accepted: a refusal means the row had nothing to sample
    (or the mask and the matcher disagree), and fails that row's request, loudly."""
    return [i for i, m in enumerate(matchers)
            if m is not None and not m.is_terminated() and not m.accept_token(tokens[i])]
