"""``shardlang data prepare INPUT... --out DIR [--tokenizer T] [--val-fraction F] [--workers K]``: tokenize once.

Writes token shards and their index into DIR (Note [prepared token data] in
`shardlang.data.index`), with a progress bar on a terminal, in parallel worker
processes; a killed run resumes, and a second run over the same inputs does
nothing. A job then reads DIR with ``sl.data.tokens`` (docs/data.md).

Example::

    $ shardlang data prepare /usr/lib/python3.11 --glob '*.py' --out data/python --tokenizer train-bpe:4096
"""

from __future__ import annotations

from ..data.preparation import prepare
from .args import fraction, positive


def add_parser(subparsers) -> None:
    """Register ``shardlang data`` and its ``prepare`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser("data", help="prepare training data (tokenize text into token shards)",
                                   description="Prepare training data for sl.data.tokens (docs/data.md).")
    verbs = parser.add_subparsers(title="data commands", metavar="COMMAND", required=True)
    prep = verbs.add_parser(
        "prepare", help="tokenize text, JSON lines or Parquet into token shards with an index",
        description="Tokenize INPUT (text files, folders of them, JSON lines with a text field, Parquet) into token "
                    "shards and an index in DIR. Resumable after a kill; a second run over the same inputs is a "
                    "no-op.")
    prep.add_argument("inputs", metavar="INPUT", nargs="+", help="a file or a folder (walked recursively)")
    prep.add_argument("--out", metavar="DIR", required=True, help="the directory of the prepared data")
    prep.add_argument("--tokenizer", metavar="T", default="byte",
                      help="byte (vocabulary 256, no dependency; the default), a Hugging Face tokenizer.json, or "
                           "train-bpe:VOCAB (a byte-level BPE trained on the input, saved next to the data)")
    prep.add_argument("--eod", metavar="TOKEN", default=None,
                      help="the end-of-document token of a tokenizer.json (default: <|endoftext|>, </s>, ... "
                           "whichever its vocabulary has)")
    prep.add_argument("--val-fraction", metavar="F", type=fraction("a fraction of documents"), default=0.01,
                      help="the fraction of documents kept for validation (default 0.01)")
    prep.add_argument("--workers", metavar="K", type=positive("a number of worker processes"), default=None,
                      help="tokenizing processes (default: one per core)")
    prep.add_argument("--glob", metavar="PATTERN", default=None,
                      help="in folders, only the files whose name matches, e.g. '*.py' (default: every file that "
                           "is not hidden)")
    prep.add_argument("--text-field", metavar="NAME", default="text",
                      help="the text field of JSON lines and the text column of Parquet (default: text)")
    prep.set_defaults(command=main)


def main(args) -> int:
    """Prepare the data (``args`` from `add_parser`); prints what was written and how fast."""
    report = prepare(args.inputs, args.out, args.tokenizer, val_fraction=args.val_fraction, workers=args.workers,
                     glob=args.glob, text_field=args.text_field, eod=args.eod)
    print(report.summary(), flush=True)
    return 0


