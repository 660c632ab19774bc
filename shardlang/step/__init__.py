"""The compiled step a rank runs, and the training state it owns.

`step` (`Step`: the bound graph over this rank's state), `state` (the `TrainState`),
`variants` (other batch shapes), `evaluate` (the evaluation graph), `materialize` and
`weights` (a meta-built model filled shard by shard), `ownership` (the user's module
handed over), `random_state`, `lr` (schedules) and `batch` (splitting and checking batches).
"""
