"""Placements on a tensor axis: the stage between tracing and the passes.

`placements` names what a rank holds of a logical value (Replicate, Shard(d),
Partial, and the flats' Flattened and Packed); `rules` says how each aten op may
run on local values (`strategy` chooses among its strategies by what the
redistributions cost); `propagate` places every value of a traced step from its
parameters' placements; `localize` writes the graph each rank runs, with the
redistributions as typed collective nodes; `simulate` runs that graph for every
rank of the axis in one process.
"""
