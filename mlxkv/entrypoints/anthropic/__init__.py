"""Anthropic's Messages API: `router` (its routes), `protocol` (request and response bodies, stream
events, error shape) and `serving` (requests into engine requests, outputs into messages and events)."""
