"""OpenAI's Chat Completions and Completions API: `protocol` (request bodies, errors, response JSON)
and `serving` (requests into engine requests, outputs into responses and streams)."""
