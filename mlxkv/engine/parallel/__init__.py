"""Tensor parallel over `mlx.launch`'s processes (the model is split by `models/sharding.py`).

`step_plan` is what rank 0 sends the other ranks each step (`StepPlan`, `PlanChannel`); `rank_zero`
is rank 0's side, each plan sent before its forward pass starts; `follower` is what every other rank
runs; `rank_watchdog` ends rank 0 with a clear error when the others stop answering;
`launcher_watch` ends every rank once its launcher is gone.
"""
