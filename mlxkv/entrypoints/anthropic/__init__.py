"""Anthropic's Messages API: `router` (its routes), `protocol` (request and response bodies, stream
events, error shape), `serving` (requests into engine requests, outputs into messages and events)
and `signatures` (the thinking blocks it writes, signed to be known again)."""
