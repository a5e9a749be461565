"""OpenAI's API: `router` (its routes), `protocol` and `serving` for chat and completions (request
and response bodies; requests into engine requests, outputs into responses and streams), and
`responses_protocol` and `responses` for the Responses API, and `embeddings` for `/v1/embeddings`."""
