"""The layers mlxkv puts into an mlx-lm model, and what each step hands them.

`attention` holds `PagedAttention` (a layer's attention over the paged cache through its family's
adapter), Gemma 4's `SharingAttention` and multi-head latent attention's `LatentAttention`;
`module_attention` holds `ModuleAttention` (a family's own mlx-lm attention module run unchanged
over the pages, with its `LayerCache`); `recurrent` holds `RecurrentLayer` (a hybrid's recurrent
module over a step's rows, its state in the state pool); `step_context` is `StepContext`, what every
layer of a step is handed as its `cache`; `decoder_taps` holds `PositionEmbeddings` (GPT-2's
learned position table, looked up at each packed token's position) and `FinalNorm` (the final
hidden states of a decoder that computes the logits itself); `wrapped` is what each of these
layers shares.
"""
