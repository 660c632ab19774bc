"""The spec language: how a model's parameters lie on a mesh, and what each unit does.

`mesh` (the device mesh), `layout` (shard and replicate), `rules` (pattern -> layout, first
match wins), `units` (what is gathered together), `strategy` (ZeRO-3/2/1, DDP per unit),
`recompute`, `precision` (mixed precision), `training` (parameter groups and the training
features) and `spec` (`Spec`, `Options`, TOML) are the vocabulary a user writes.
"""
