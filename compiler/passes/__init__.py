"""Compiler passes: pure functions ``(GraphModule, CompileContext) -> GraphModule``, one per file.

Each module's docstring states the invariant it establishes for the passes
after it. The default pipeline, in order, is `DEFAULT_PASSES` in
`compiler.passes.pipeline`, which runs them; `contract` says what each requires and
establishes; `compiler.context.CompileContext` is what every pass reads.
"""
