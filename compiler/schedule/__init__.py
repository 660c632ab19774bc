"""The frozen Schedule read off the final graph, its text and JSON formats, and its verifier.

`schedule` reads ordered ops (unit, bytes, phase) off the graph; `schedule_format` prints
the table and the summary; `verify` checks the schedule's invariants after every pass in tests.
"""
