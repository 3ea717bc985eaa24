"""Tokenizers behind one small interface, chosen with Megatron-LM's `--tokenizer-type` names.

    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model="tok/tokenizer.json")
    ids = tokenizer.tokenize("Hello world")          # list[int]
    tokenizer.detokenize(ids), tokenizer.vocab_size, tokenizer.eod

Types:
- `HuggingFaceTokenizer`: a `tokenizers` `tokenizer.json` (or a folder holding one).
- `GPT2BPETokenizer`: GPT-2's `vocab.json` + `merges.txt` (`vocab_file`, `merge_file`).
- `SentencePieceTokenizer`: a SentencePiece `.model`.
- `NullTokenizer`: text is space-separated token ids (for benchmarks; no vocabulary file),
  `eod` = `vocab_size - 1` as in Megatron-LM.

`files` lists the files a tokenizer was built from, so a run can ship them with its checkpoint.
"""

import os
from pathlib import Path

# End-of-document tokens of the common vocabularies, most specific first.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
TOKENIZER_TYPES = (
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
)


class Tokenizer:
    """What the data pipeline needs of a tokenizer. `backend` is the library's own object
    (a `tokenizers.Tokenizer`, a `SentencePieceProcessor`), for tools that export it."""

    files = ()
    backend = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> list:
        raise NotImplementedError

    def tokenize_batch(self, texts) -> list:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids) -> str:
        raise NotImplementedError


class HuggingFaceTokenizer(Tokenizer):
    def __init__(self, tokenizer, files, eod_token=None):
        self.backend = tokenizer
        self.files = tuple(str(f) for f in files)
        candidates = (eod_token,) if eod_token else EOD_CANDIDATES
        for token in candidates:
            token_id = tokenizer.token_to_id(token)
            if token_id is not None:
                self._eod = token_id
                break
        else:
            raise ValueError(
                f"{self.files[0]}: none of the end-of-document tokens {list(candidates)} "
                "is in the vocabulary; name it with eod_token (--eod-token)"
            )

    @classmethod
    def from_file(cls, path, eod_token=None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json at {path}: give the file or the folder that "
                "holds it (train one with tools/train_tokenizer.py)"
            )
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # `tokenizers` raises a bare Exception for a malformed file
            raise ValueError(f"{path}: not a readable tokenizer.json ({error})") from None
        return cls(tokenizer, [path], eod_token)

    @classmethod
    def from_gpt2_files(cls, vocab_file, merge_file, eod_token=None):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for name, path in (("vocab_file", vocab_file), ("merge_file", merge_file)):
            if not path or not Path(path).is_file():
                raise FileNotFoundError(
                    f"GPT2BPETokenizer needs {name} (--{name.replace('_', '-')}), got {path!r}"
                )
        try:
            tokenizer = HFTokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        except Exception as error:  # a bare Exception, as above
            raise ValueError(
                f"{vocab_file}, {merge_file}: not a readable GPT-2 vocab.json and "
                f"merges.txt ({error})"
            ) from None
        # GPT-2's byte-level BPE: no prefix space, bytes mapped to printable characters.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return cls(tokenizer, [vocab_file, merge_file], eod_token)

    @property
    def vocab_size(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self):
        return self._eod

    def tokenize(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts):
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids):
        return self.backend.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file, eod_token=None):
        try:
            import sentencepiece
        except ImportError as error:
            raise ImportError(
                "SentencePieceTokenizer needs the sentencepiece package: pip install sentencepiece"
            ) from error
        if not Path(model_file).is_file():
            raise FileNotFoundError(f"no SentencePiece model at {model_file}")
        self.files = (str(model_file),)
        try:
            self.backend = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        except (RuntimeError, OSError) as error:
            raise ValueError(
                f"{model_file}: not a readable SentencePiece model ({error})"
            ) from None
        if eod_token:
            self._eod = self.backend.piece_to_id(eod_token)
            if self._eod == self.backend.unk_id():
                raise ValueError(f"{model_file}: eod token {eod_token!r} is not in the vocabulary")
        elif self.backend.eos_id() >= 0:
            self._eod = self.backend.eos_id()
        else:
            raise ValueError(f"{model_file} has no end-of-sentence token; name one with eod_token")

    @property
    def vocab_size(self):
        return self.backend.get_piece_size()

    @property
    def eod(self):
        return self._eod

    def tokenize(self, text):
        return self.backend.encode(text)

    def tokenize_batch(self, texts):
        return self.backend.encode(list(texts))

    def detokenize(self, ids):
        return self.backend.decode(list(ids))


class NullTokenizer(Tokenizer):
    """Text is already token ids separated by spaces; `eod` is the last id (Megatron-LM's)."""

    def __init__(self, vocab_size):
        if not vocab_size or vocab_size < 2:
            raise ValueError(
                f"NullTokenizer needs vocab_size >= 2 (--vocab-size), got {vocab_size}"
            )
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self):
        return self._vocab_size

    @property
    def eod(self):
        return self._vocab_size - 1

    def tokenize(self, text):
        ids = [int(token) for token in text.split()]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} are outside [0, {self._vocab_size})")
        return ids

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type,
    tokenizer_model=None,
    vocab_file=None,
    merge_file=None,
    vocab_size=None,
    eod_token=None,
) -> Tokenizer:
    """Megatron-LM's `--tokenizer-type` with its file flags."""
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError(
                "HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or its folder)"
            )
        return HuggingFaceTokenizer.from_file(tokenizer_model, eod_token)
    if tokenizer_type == "GPT2BPETokenizer":
        return HuggingFaceTokenizer.from_gpt2_files(vocab_file, merge_file, eod_token)
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model (a .model file)")
        return SentencePieceTokenizer(tokenizer_model, eod_token)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; one of {list(TOKENIZER_TYPES)}")


def disable_tokenizers_parallelism():
    """Call in forked workers: the Rust thread pool of `tokenizers` must not cross a fork."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
