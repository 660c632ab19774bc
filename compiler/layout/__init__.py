"""Where each parameter's bytes live: placements on the mesh, flat parameters, buckets, the optimizer's updates.

`placement` resolves a parameter's layout on the mesh; `flat` packs a unit's parameters
into flat shards (Note [chunks of a flat shard]); `bucket` groups small collectives;
`member_updates` and `optim` describe the optimizer update of each flat parameter.
"""
