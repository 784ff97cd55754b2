"""Log-probabilities of chosen tokens, and the most likely alternatives, from logits.

What OpenAI's `logprobs` report is the model's own distribution: the fp32 log-softmax of
the logits, before temperature, top-k and top-p reshape what the sampler draws from. So a
greedy and a sampled request report the same numbers for the same token at the same
position, and a client can compare them with any other implementation of the model.

Computed only for the rows that asked (a log-softmax and a top-k over the vocabulary per
token is not free), and copied to the host in one transfer per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int] | torch.Tensor, top_n: Sequence[int]
) -> list[TokenLogprob]:
    """For each row of ``logits`` [R, vocab]: ``tokens[r]``'s log-probability and the
    ``top_n[r]`` most likely tokens with theirs."""
    if len(top_n) != logits.shape[0]:
        raise ValueError(f"{len(top_n)} top_n for {logits.shape[0]} rows")
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(tokens, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(-1, ids[:, None])  # [R, 1]
    width = min(max(top_n), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(width, dim=-1)  # [R, width]
    # One device-to-host copy; float64 holds the ids and the fp32 values exactly.
    host = torch.cat([ids[:, None], top_ids], 1).double()
    rows = torch.cat([host, chosen.double(), top_values.double()], 1).cpu().tolist()
    out = []
    for row, n in zip(rows, top_n, strict=True):
        top_row, values = row[1 : 1 + width], row[2 + width :]
        top = tuple((int(top_row[i]), values[i]) for i in range(min(n, width)))
        out.append(TokenLogprob(int(row[0]), row[1 + width], top))
    return out
