"""Training data: token datasets prepared on disk, and the global batches a job reads from them.

- ``shardlang data prepare INPUT... --out DIR`` (`preparation.prepare`) tokenizes
  text, JSON lines or Parquet into token shards with an index
  (Note [prepared token data]).
- ``sl.data.tokens(DIR, seq_len=..., global_batch=...)`` (`tokens.tokens`) is a
  job's ``make_batch``: global batch ``k`` is a function of the data, the seed
  and ``k`` alone, each rank reads only its rows (Note [token batches]).

docs/data.md is the user's guide.

Example::

    import shardlang as sl
    make_batch = sl.data.tokens("data/python", seq_len=256, global_batch=16)
"""

from .index import TokenIndex, read_index
from .preparation import Report, prepare
from .tokens import TokenBatches, tokens

__all__ = ["Report", "TokenBatches", "TokenIndex", "prepare", "read_index", "tokens"]
