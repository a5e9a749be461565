"""Ollama's API: `router` (its routes), `protocol` (request and response bodies, error shape) and
`serving` (requests into engine requests, outputs into JSON lines and model descriptions)."""
