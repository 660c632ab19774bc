"""Lowering the compiled graph to what runs: process groups bound, collectives, the backends.

`emit` binds the graph to process groups (`bind`), swapping the IR's collectives
(`ir.collectives`) for torch's; `backend` runs the bound graph eagerly or through inductor, with
`step_scalars` moving the step's 0-d arithmetic into an eager prologue.
"""
