"""Tensor parallel over `mlx.launch`'s processes (the model is split by `models/sharding.py`).

`step_plan` is what rank 0 sends the other ranks each step (`StepPlan`, `PlanChannel`); `rank_zero`
is rank 0's side, each plan sent before its forward pass starts; `follower` is what every other rank
runs; `naps` keeps an idle group off the CPU; `rank_watchdog` ends a rank with a clear error when
another stops answering; `launcher_watch` ends every rank once its launcher is gone.
"""
