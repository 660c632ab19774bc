"""The spec language: how a model's parameters lie on a mesh, and what each unit does.

`mesh` (the device mesh), `layout` (shard and replicate), `rules` (pattern -> layout, first
match wins), `units` (what is gathered together), `strategy` (ZeRO-3/2/1, DDP per unit),
`recompute`, `precision` (mixed precision), `training` (parameter groups and the training
features), `options` (`Options`) and `spec` (`Spec`, its dict and TOML forms, `resolve`) are what a
user writes; `patterns` reads their (pattern, value) tables, `vocabulary` holds the words the compiler
shares, `resolved` is a spec met with a model (`ResolvedSpec.config`: the compiler's input) and
`toml_text` writes TOML.
"""
