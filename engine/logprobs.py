"""Log-probabilities of chosen tokens and their top-k alternatives, from raw logits.

Raw: the model's distribution before temperature, penalties and bias (vLLM's default
`logprobs_mode`). Computed only for the rows that ask, in one log_softmax per call.
"""

from __future__ import annotations

import torch

from engine.messages import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits: [N, V] raw; token_ids[i]: the token scored at row i; ks[i]: alternatives wanted."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()  # [N]
    k_max = max(ks)
    if k_max > 0:
        top_lp, top_ids = lp.topk(k_max, dim=-1)  # [N, k_max], most likely first
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out = []
    for i, (token, logprob, k) in enumerate(zip(token_ids, chosen, ks)):
        top = list(zip(top_ids[i][:k], top_lp[i][:k])) if k > 0 else []
        out.append(TokenLogprob(token, logprob, top))
    return out
