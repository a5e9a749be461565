"""What the engine may spend, in bytes and in time.

`memory_budget` splits one budget into weights, the draft model, the step reserve, MLX's buffer
cache and the KV cache; `kv_budget` turns the KV part into pages and sequences and builds the cache;
`step_memory` says what a step's temporaries take by its shape; `step_time` fits what a step's time
takes as the engine runs; `chunk_sizing` cuts prefill chunks to the reserve and to the latency target.
"""
