"""The IR: the training step traced into one aten-level GraphModule, and what the trace knows about it.

`trace` builds the graph (forward, loss, backward, optimizer update) with fake tensors;
`collectives` defines the collective ops the passes insert (over axis names, bound
later); `provenance` maps a failure back to the user's line and module; `shapes`, `mutations`,
`replicate`, `rng`, `dtypes` and `sync_batch_norm` check or rewrite what was traced;
`graph_utils` reads and writes the compiler's node tags; `training` holds the traced
training features; `torch_logs` keeps torch's own logs back while tracing.
"""
