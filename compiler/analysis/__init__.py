"""What the schedule predicts, without processes or weights: memory, cost, budgets, formulas, reports.

`memory` plans the bytes each rank holds after every op; `cost` models collectives (alpha-beta)
and compute (FLOPs); `budget` searches recompute under a memory budget; `formulas` gives the
closed-form bytes a schedule must match; `timeline`, `plan_report` and `plan_diff` present them.
"""
