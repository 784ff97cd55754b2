"""pdmesh inference engine: a plain-torch Llama over a paged KV pool (prefill/decode steps).

Import the modules themselves (engine, loader, specs, tokenizer, ...): this package imports
nothing, so a process that only tokenizes (the router, through specs) never loads torch.
"""
