"""shardlang's compiler: trace -> annotate -> passes -> schedule -> emit.

It never imports the runtime (`shardlang.runtime`); it consumes plain data
(`placement.ParamInfo`, `placement.MeshShape`) and produces a GraphModule and a
`Schedule`.
"""
