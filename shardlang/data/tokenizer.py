"""Tokenizers for prepared data: bytes (no dependency), a Hugging Face ``tokenizer.json``, or a BPE trained here.

``--tokenizer`` of ``shardlang data prepare`` names one (`TokenizerChoice.parse`):

- ``byte``: the text's UTF-8 bytes; vocabulary 256; the end-of-document token is
  byte 0 (NUL), so NUL characters in the input are dropped (and counted).
- a path to a Hugging Face ``tokenizer.json``, read by the ``tokenizers`` library;
  the end-of-document token is ``--eod`` or the first of `EOD_CANDIDATES` the
  vocabulary has.
- ``train-bpe:VOCAB``: a byte-level BPE of VOCAB tokens trained on the input's
  training documents with ``tokenizers``, saved as ``tokenizer.json`` next to the
  data; its end-of-document token is ``<|endoftext|>`` (id 0).

Every tokenizer turns a list of texts into a list of NumPy arrays of token ids
(`encode_batch`); the data directory keeps the tokenizer (its ``tokenizer.json``)
so the ids can be decoded later.

Example::

    >>> ByteTokenizer().encode_batch(["hi"])[0].tolist()
    [104, 105]
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import attrs
import numpy as np

from ..errors import DataError

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
TRAINED_EOD = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # the data directory's copy of a Hugging Face tokenizer
MAX_TRAINED_VOCAB = 1 << 20
DATA_EXTRA = "pip install 'shardlang[data]'"


@attrs.frozen
class TokenizerChoice:
    """What ``--tokenizer`` names: ``kind`` is "byte", "file" (a tokenizer.json at ``path``) or "train-bpe"."""

    kind: str
    path: Path | None = None
    vocab_size: int | None = None  # train-bpe's

    @classmethod
    def parse(cls, text: str) -> TokenizerChoice:
        """``byte``, ``train-bpe:VOCAB`` or the path of a ``tokenizer.json``; anything else is a `DataError`."""
        if text == "byte":
            return cls("byte")
        match = re.fullmatch(r"train-bpe:(\d+)", text)
        if match:
            vocab = int(match.group(1))
            if not 257 <= vocab <= MAX_TRAINED_VOCAB:
                raise DataError(f"--tokenizer {text}: a trained BPE's vocabulary must be between 257 (the 256 "
                                f"bytes and the end-of-document token) and {MAX_TRAINED_VOCAB}, e.g. train-bpe:8192")
            return cls("train-bpe", vocab_size=vocab)
        path = Path(text).expanduser()
        if path.is_dir() and (path / TOKENIZER_FILE).is_file():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(f"--tokenizer {text!r} is neither 'byte', 'train-bpe:VOCAB' nor an existing "
                            f"tokenizer.json (looked at {path.resolve()}); valid: byte, train-bpe:8192, "
                            "path/to/tokenizer.json", path=path)
        return cls("file", path=path.resolve())


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, end-of-document byte 0 (a NUL in the text is dropped)."""

    kind = "byte"
    vocab_size = 256
    eod = 0

    def encode_batch(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        """The ids of each text, and how many NUL characters were dropped."""
        out, dropped = [], 0
        for text in texts:
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            if text.count("\0"):
                dropped += text.count("\0")
                ids = ids[ids != 0]
            out.append(ids)
        return out, dropped

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i != self.eod).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` read from ``tokenizer.json``, with its end-of-document token."""

    kind = "huggingface"

    def __init__(self, path: Path, eod: str | None = None):
        tokenizers = _import_tokenizers(f"--tokenizer {path}")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception type for a malformed file
            raise DataError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({exc}); give the tokenizer.json "
                            "that tokenizers' Tokenizer.save or a model's save_pretrained wrote", path=path) from exc
        self.path = path
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod_token = eod if eod is not None else self._find_eod(path)
        eod_id = self.tokenizer.token_to_id(self.eod_token)
        if eod_id is None:
            raise DataError(f"--eod {self.eod_token!r} is not a token of the tokenizer {path}; give a token of "
                            f"its vocabulary, e.g. one of {self._special_tokens()[:6]}", path=path)
        self.eod = eod_id

    def _find_eod(self, path: Path) -> str:
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        for token in EOD_CANDIDATES:
            if token in vocab:
                return token
        raise DataError(f"tokenizer {path} has none of the usual end-of-document tokens {list(EOD_CANDIDATES)}; "
                        f"name its end-of-document token with --eod, e.g. one of {self._special_tokens()[:6]}",
                        path=path)

    def _special_tokens(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]

    def encode_batch(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings], 0

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def train_bpe(texts: Iterable[str], vocab_size: int, path: Path) -> None:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts`` and save it as ``tokenizer.json`` at ``path``.

    GPT-2's scheme: text split by the byte-level pre-tokenizer, every byte in the
    initial alphabet (so any text encodes), ``<|endoftext|>`` as token 0.
    """
    tokenizers = _import_tokenizers("--tokenizer train-bpe")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tmp = path.with_name(path.name + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)


def load_tokenizer(kind: str, path: Path | None, eod: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of ``kind`` ("byte", or "huggingface" read from ``path``)."""
    return ByteTokenizer() if kind == "byte" else HFTokenizer(path, eod)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below ``vocab_size``.

    >>> token_dtype(256), token_dtype(257), token_dtype(100_000)
    (dtype('uint8'), dtype('uint16'), dtype('uint32'))
    """
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit 32-bit ids")


def eod_token_of(path: Path) -> str | None:
    """The end-of-document token a trained tokenizer.json was saved with (its first special token), else None."""
    added = json.loads(path.read_text()).get("added_tokens") or []
    return added[0]["content"] if added else None


def _import_tokenizers(why: str):
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"{why} needs the tokenizers library, which is not installed; {DATA_EXTRA}, or use "
                        "--tokenizer byte (no dependency)") from None
    return tokenizers
