"""Speculative decoding: each step, a speculating request proposes draft tokens that the model checks
in the same forward pass, and keeps those it would have drawn itself.

`speculation` decides how many draft tokens each request proposes (a fit of the step's time against
its acceptance rate), which ones the model accepted, and declares the `Drafter` interface;
`prompt_lookup` drafts from the request's own earlier n-grams; `draft_model` drafts with a smaller
checkpoint for every speculating request at once, in a paged cache of its own.
"""
