"""A BERT WordPiece tokenizer on the Rust `tokenizers` library alone.

Training only needs a batch of texts -> ids, the special ids, the vocab and a fingerprint. The
`transformers` tokenizer gives them too, but importing it pulls in torch, sklearn and the
generation stack: about 4 s of every CLI run (a 2-core Intel Xeon), against 0.04 s to
load the tokenizer itself. `load` builds the same tokenizer that `AutoTokenizer` would
(BertTokenizerFast) from a local folder's tokenizer.json + tokenizer_config.json, and returns
None for anything it does not reproduce exactly, so the caller falls back to transformers.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Union

from tokenizers import Tokenizer, normalizers

# transformers' SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES, in its order (all_special_ids).
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
BERT_CLASSES = ("BertTokenizer", "BertTokenizerFast")


class BertWordPiece:
    """The subset of a transformers fast tokenizer that jax_tinybert's data path uses."""

    is_fast = True

    def __init__(self, path: str, backend, special_tokens_map: Dict[str, str]):
        self.name_or_path = path
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens_map)

    def __call__(self, texts: Union[str, Sequence[str]], add_special_tokens: bool = True,
                 return_attention_mask: bool = False, return_token_type_ids: bool = False,
                 verbose: bool = False) -> Dict[str, list]:
        """texts -> {"input_ids": ids} (a list per text; one list for a single str)."""
        if return_attention_mask or return_token_type_ids:
            raise ValueError("BertWordPiece returns input_ids only; use "
                             "tokenize.load_tokenizer for masks and token types")
        if isinstance(texts, str):
            return {"input_ids": self.backend_tokenizer.encode(
                texts, add_special_tokens=add_special_tokens).ids}
        enc = self.backend_tokenizer.encode_batch(list(texts),
                                                  add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in enc]}

    def _special_id(self, key: str) -> Optional[int]:
        tok = self.special_tokens_map.get(key)
        return None if tok is None else self.backend_tokenizer.token_to_id(tok)

    cls_token_id = property(lambda self: self._special_id("cls_token"))
    sep_token_id = property(lambda self: self._special_id("sep_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    mask_token_id = property(lambda self: self._special_id("mask_token"))

    @property
    def all_special_ids(self) -> List[int]:
        seen, out = set(), []
        for key in SPECIAL_KEYS:
            tok = self.special_tokens_map.get(key)
            if tok is not None and tok not in seen:
                seen.add(tok)
                out.append(self.backend_tokenizer.token_to_id(tok))
        return out

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> Dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


def _content(v) -> Optional[str]:
    return v.get("content") if isinstance(v, dict) else v


def load(path: str) -> Optional[BertWordPiece]:
    """The BertTokenizerFast of local folder `path`, or None where this would not reproduce it
    exactly (not a local folder, no tokenizer.json / tokenizer_config.json, another tokenizer
    class, extra special tokens, tokens transformers would add)."""
    tj = os.path.join(path, "tokenizer.json")
    cj = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(tj) and os.path.isfile(cj)):
        return None
    with open(cj, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("tokenizer_class") not in BERT_CLASSES:
        return None
    special = {k: _content(cfg.get(k)) for k in SPECIAL_KEYS}
    sj = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(sj):   # from_pretrained lets this file override the config's tokens
        with open(sj, encoding="utf-8") as f:
            smap = json.load(f)
        if smap.get("additional_special_tokens"):
            return None
        special.update({k: _content(v) for k, v in smap.items() if k in SPECIAL_KEYS})
    if cfg.get("additional_special_tokens"):
        return None
    # BertTokenizerFast's defaults when the config leaves a token out.
    defaults = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                "cls_token": "[CLS]", "mask_token": "[MASK]"}
    special = {k: special.get(k) or defaults.get(k) for k in SPECIAL_KEYS}
    special = {k: v for k, v in special.items() if v is not None}

    backend = Tokenizer.from_file(tj)
    if backend.normalizer is None:
        return None
    # As BertTokenizerFast.__init__: the config's casing options win over the file's normalizer.
    state = json.loads(backend.normalizer.__getstate__())
    want = {"lowercase": cfg.get("do_lower_case", True),
            "strip_accents": cfg.get("strip_accents"),
            "handle_chinese_chars": cfg.get("tokenize_chinese_chars", True)}
    if any(state.get(k, v) != v for k, v in want.items()):
        cls = getattr(normalizers, state.pop("type"))
        backend.normalizer = cls(**dict(state, **want))
    # A saved tokenizer.json may carry fixed truncation/padding; transformers turns both off
    # for an untruncated, unpadded call, which is the only call made here.
    backend.no_truncation()
    backend.no_padding()
    added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    for i, t in (cfg.get("added_tokens_decoder") or {}).items():
        if added.get(_content(t)) != int(i):
            return None
    if any(added.get(t) is None for t in special.values()):
        return None   # transformers would add it as a new special token
    return BertWordPiece(path, backend, special)
