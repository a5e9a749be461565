"""Ollama's API: `router` (its routes), `protocol` (request and response bodies, error shape),
`serving` (requests into engine requests, outputs into JSON lines and model descriptions) and
`embed` (vectors as Ollama answers them)."""
