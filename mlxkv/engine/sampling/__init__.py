"""From a step's logits to a request's text.

`params` declares `SamplingParams`, how one request samples; `sampler` draws the batch's tokens (one
argmax, one Gumbel-max draw) and their log-probabilities; `structured_output` masks the logits of
constrained requests with llguidance's grammars, whose text `lark` spells as the tokenizer does,
each request's `constraint` following its output (from the first token, or lazily from a trigger);
`text` turns tokens into streamed text and finds stop strings, and `reasoning` keeps a thinking
model's reasoning apart from its answer, closing its thinking at a budget.
"""
