"""Bounds every prefill and decode enforces on a request, whatever its caller: the
router's own (configurable) bounds must stay within them. Torch-free, so the router can
check its flags against them."""

# Alternatives per token a request may ask for (SamplingParams.top_logprobs): it bounds a
# member's per-token work (a top-k over the vocabulary) and its messages' size.
MAX_TOP_LOGPROBS = 64
