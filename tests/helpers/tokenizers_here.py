"""Tokenizers of the RoBERTa and XLM-R families trained here, on the shared corpus (no download).

`roberta_bpe(out)`: byte-level BPE with RoBERTa's specials (`<s>`=0, `<pad>`=1, `</s>`=2,
`<unk>`=3, `<mask>`=4), `Ġ`-prefixed pieces, saved as a RobertaTokenizerFast (RobertaProcessing
post-processor). `xlmr_unigram(out)`: a SentencePiece-style Unigram (`▁` Metaspace) with XLM-R's
layout (`<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3, `<mask>` last), saved as an
XLMRobertaTokenizerFast with XLM-R's template. Both folders load with `AutoTokenizer`.
Training takes seconds: tests get them once per session (conftest.py fixtures).
"""
from __future__ import annotations

import os
import pathlib
import tempfile
from typing import List

CORPUS = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "corpus"
# About 1.9 MB of text: a novel and a Wikipedia split.
TRAIN_FILES = ("gutenberg_pg1342_austen_pride_and_prejudice.txt", "wikitext2_valid_tokens.txt")
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def corpus_files(corpus: pathlib.Path = CORPUS) -> List[str]:
    """The training text files (checked to exist)."""
    files = [str(corpus / f) for f in TRAIN_FILES]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"missing corpus files {missing}; see shared/data/corpus")
    return files


def roberta_bpe(out: str, vocab_size: int = 3000, corpus: pathlib.Path = CORPUS) -> str:
    """Trains a byte-level BPE into folder `out` as a RobertaTokenizerFast; returns `out`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train(corpus_files(corpus), vocab_size=vocab_size, min_frequency=2,
              special_tokens=ROBERTA_SPECIALS, show_progress=False)
    with tempfile.TemporaryDirectory() as raw:
        vocab, merges = bpe.save_model(raw)
        # From vocab.json + merges.txt, as the hub's roberta-base: transformers' converter
        # builds the ByteLevel pre-tokenizer/decoder and the RobertaProcessing post-processor.
        tok = RobertaTokenizerFast(vocab_file=vocab, merges_file=merges)
        tok.save_pretrained(out)
    return out


def xlmr_unigram(out: str, vocab_size: int = 3000, corpus: pathlib.Path = CORPUS) -> str:
    """Trains a Unigram (SentencePiece-style) into folder `out` as an XLMRobertaTokenizerFast;
    returns `out`."""
    from tokenizers import AddedToken, SentencePieceUnigramTokenizer, processors
    from transformers import XLMRobertaTokenizerFast

    sp = SentencePieceUnigramTokenizer()
    sp.train(corpus_files(corpus), vocab_size=vocab_size - 1, show_progress=False,
             special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>")
    backend = sp._tokenizer
    # XLM-R's <mask> is the last id, stripping the space before it.
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    # XLM-R's template (transformers' XLMRobertaConverter): every token type 0.
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    tok = XLMRobertaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                  pad_token="<pad>", mask_token="<mask>")
    tok.save_pretrained(out)
    return out
