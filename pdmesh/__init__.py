"""pdmesh: a prefill/decode-disaggregated LLM serving mesh."""
