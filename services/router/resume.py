"""The re-run of a preempted request: what it asks the mesh for.

A decode whose KV pool ran dry mid-generation preempts its newest sequence: it sends every
token sampled so far, then a typed `Preempted`, and frees the pages. The router continues
the request as a new one whose prompt is the original prompt plus the tokens already
streamed, with max_tokens reduced by them and the same seed from sampling step
`start_step` = the tokens already streamed: the seeded draw depends only on (seed, step,
token) and the logits, so the continuation samples exactly the tokens an unpreempted run
would have, greedy or seeded. The client's stream only pauses.

A re-run can find every decode full (the pool that preempted it is still busy): it is
admitted like any request, waiting in the router's admission queue (admission.py) for
room rather than failing a request that already streamed tokens. A request preempted more
than `--max-preemptions` times ends with a typed ABORTED rather than loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.v1 import common_pb2 as cpb

DEFAULT_MAX_PREEMPTIONS = 16


@dataclass
class Preempted:
    """The decode let the attempt go after streaming `completion_tokens`."""

    completion_tokens: int


def continuation(prompt: list[int], sampling: cpb.SamplingParams, streamed: list[int]
                 ) -> tuple[list[int], cpb.SamplingParams]:
    """The request that continues `prompt` after `streamed` tokens reached the client."""
    if not streamed:
        return prompt, sampling
    rest = cpb.SamplingParams()
    rest.CopyFrom(sampling)
    rest.max_tokens = sampling.max_tokens - len(streamed)
    rest.start_step = sampling.start_step + len(streamed)
    rest.prompt_logprobs = False  # the streamed tokens are output, not prompt to score
    return prompt + streamed, rest

