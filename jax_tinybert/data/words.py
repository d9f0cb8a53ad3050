"""Whole words in a tokenizer's pieces, for any of the families' schemes.

WordPiece (BERT): a piece starting with `##` continues the word before it. Byte-level BPE
(RoBERTa, GPT-2): a piece starting with `Ġ` (an encoded space) starts a word. SentencePiece /
Metaspace (XLM-R, Unigram or BPE): a piece starting with `▁` starts a word. A piece's text is
what the tokenizer's own decoder makes of it (byte-level decoding for BPE), its marker dropped.
"""
from __future__ import annotations

import dataclasses
import json
from typing import List, Optional, Sequence

from tokenizers import decoders

WORDPIECE, BYTE_LEVEL, METASPACE = "wordpiece", "byte_level", "metaspace"


@dataclasses.dataclass(frozen=True)
class WordScheme:
    """How a tokenizer's pieces make words: `kind` and its marker (`##`, `Ġ` or `▁`)."""

    kind: str
    marker: str
    decoder: object   # the backend's tokenizers.decoders.Decoder

    def starts_word(self, piece: str) -> bool:
        """Whether `piece` begins a new word (WordPiece: any piece but a `##` one)."""
        if self.kind == WORDPIECE:
            return not piece.startswith(self.marker)
        return piece.startswith(self.marker)

    def word_text(self, word: str) -> str:
        """The text to tokenize for `word` as it stands inside a sentence: byte-level BPE
        marks a word by the space before it, so " word"; the word itself otherwise."""
        return " " + word if self.kind == BYTE_LEVEL else word

    def text(self, pieces: Sequence[str]) -> str:
        """The text of the pieces of one word, decoded as the tokenizer decodes (no marker)."""
        return self.decoder.decode(list(pieces)).strip()

    def word_of_piece(self, piece: str) -> Optional[str]:
        """The whole word a single piece stands for, or None when it does not start a word."""
        return self.text([piece]) if self.starts_word(piece) else None

    def group(self, pieces: Sequence[str]) -> List[List[int]]:
        """Indices of `pieces` grouped into words (a leading continuation piece opens one)."""
        out: List[List[int]] = []
        for i, p in enumerate(pieces):
            if not out or self.starts_word(p):
                out.append([i])
            else:
                out[-1].append(i)
        return out


def _find(state: dict, types: Sequence[str]) -> Optional[dict]:
    """The first component of type `types` in a (Sequence of) pre-tokenizer state(s)."""
    if state is None:
        return None
    if state.get("type") in types:
        return state
    for sub in state.get("pretokenizers") or ():
        hit = _find(sub, types)
        if hit is not None:
            return hit
    return None


def scheme_of(tokenizer) -> WordScheme:
    """The word scheme of a fast tokenizer (or wordpiece.BertWordPiece), read off its Rust
    backend: the model type and the pre-tokenizer. ValueError for a scheme not listed here."""
    backend = tokenizer.backend_tokenizer
    model = type(backend.model).__name__
    decoder = backend.decoder
    if model == "WordPiece":
        marker = getattr(backend.model, "continuing_subword_prefix", "##")
        if decoder is None:
            decoder = decoders.WordPiece(prefix=marker)
        return WordScheme(WORDPIECE, marker, decoder)
    pre = backend.pre_tokenizer
    state = json.loads(pre.__getstate__()) if pre is not None else None
    hit = _find(state, ("ByteLevel", "Metaspace"))
    if hit is not None and decoder is not None:
        if hit["type"] == "ByteLevel":
            return WordScheme(BYTE_LEVEL, "Ġ", decoder)
        return WordScheme(METASPACE, hit.get("replacement", "▁"), decoder)
    raise ValueError(f"{getattr(tokenizer, 'name_or_path', '')}: a {model} tokenizer with neither "
                     "a ByteLevel nor a Metaspace pre-tokenizer (and decoder); whole words are "
                     "known for WordPiece, byte-level BPE and SentencePiece tokenizers")
