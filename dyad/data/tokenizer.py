"""Text tokenizer: a thin wrapper over a `tokenizers.Tokenizer` that guarantees the special tokens
the data pipeline relies on.

`<image>` is a special (added) token, so it is matched before pre-tokenization and always encodes
to exactly one id (`image_id`), whatever the model (WordLevel, BPE, ...). `build_sequence` later
expands that one id into as many copies as its image gives tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
UNK = "<unk>"
IMAGE = "<image>"

# Tokens every tokenizer must have; `load_tokenizer` adds the missing ones. <unk> is only needed
# by the word-level tokenizer (byte-level BPE never produces unknowns).
REQUIRED_SPECIAL_TOKENS = (PAD, BOS, EOS, IMAGE)
WORD_SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IMAGE)


class TextTokenizer:
    """Encodes text to ids with no automatic special tokens; `<image>` maps to `image_id`."""

    def __init__(self, tokenizer: Tokenizer):
        # Padding/truncation settings stored in a user's tokenizer.json would silently change
        # sequence lengths; the collator owns padding.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        ids = {token: tokenizer.token_to_id(token) for token in REQUIRED_SPECIAL_TOKENS}
        missing = [token for token, i in ids.items() if i is None]
        assert not missing, f"tokenizer lacks special tokens {missing}"
        self.pad_id: int = ids[PAD]
        self.bos_id: int = ids[BOS]
        self.eos_id: int = ids[EOS]
        self.image_id: int = ids[IMAGE]
        # Max id + 1 rather than the entry count: embedding tables are indexed by id.
        self.vocab_size: int = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        assert self.encode(IMAGE) == [self.image_id], "<image> must encode to one token"

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each token's character span [start, end) in it."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The added tokens marked special (e.g. `<|im_end|>`, `</s>`, `<image>`)."""
        return tuple(t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        self._tokenizer.save(str(path))


def _words(text: str) -> list[str]:
    special = "|".join(re.escape(token) for token in WORD_SPECIAL_TOKENS)
    pre_tokenizer = Whitespace()
    return [
        word
        for chunk in re.split(special, text)
        for word, _ in pre_tokenizer.pre_tokenize_str(chunk)
    ]


def build_word_tokenizer(texts: Iterable[str]) -> TextTokenizer:
    """A WordLevel tokenizer over the words of `texts`: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3,
    `<image>`=4, then the words in sorted order (deterministic for the same set of texts)."""
    words = sorted({word for text in texts for word in _words(text)})
    vocab = {token: i for i, token in enumerate([*WORD_SPECIAL_TOKENS, *words])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in WORD_SPECIAL_TOKENS])
    return TextTokenizer(tokenizer)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load a Hugging Face `tokenizer.json` from a local file (never from the network).

    Any of `<pad>`, `<bos>`, `<eos>`, `<image>` that the file lacks is added as a special token with
    a new id at the end of the vocabulary, so `vocab_size` may grow by up to 4; the model's
    embedding table must be sized from `TextTokenizer.vocab_size`, not from the file.
    """
    if not Path(path).is_file():
        raise ValueError(f"data.tokenizer: file not found: '{path}'")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise ValueError(f"data.tokenizer: cannot load '{path}': {e}") from e
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True) for t in REQUIRED_SPECIAL_TOKENS]
    )
    return TextTokenizer(tokenizer)
