"""The layers mlxkv puts into an mlx-lm model, and what each step hands them.

`attention` holds `PagedAttention` (a layer's attention over the paged cache through its family's
adapter) and Gemma 4's `SharingAttention`; `recurrent` holds `RecurrentLayer` (a hybrid's recurrent
module over a step's rows, its state in the state pool); `step_context` is `StepContext`, what every
layer of a step is handed as its `cache`.
"""
