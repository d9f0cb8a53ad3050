"""Trim a large vocabulary to the pieces a corpus uses: a smaller tokenizer and model folder.

A multilingual teacher's 250,002-piece embedding table is most of a small student's parameters
and Adam state; a task or a language uses a fraction of it. `trim` keeps the pieces the corpus
tokenizes into (plus every special and added token), in their old order, and writes a new
tokenizer folder and the model folder with the word-embedding rows (and a masked-LM head's bias)
sliced. On the corpus the trimmed tokenizer gives the same pieces, so its ids map to the same
embedding vectors: Unigram's best segmentation only uses kept pieces and keeps its scores;
WordPiece's longest match is a kept piece. Byte-level BPE is refused: its merges name pieces
that the corpus never outputs.

    python -m jax_tinybert.data.trim_vocab --model DIR --corpus FILE_OR_DIR [...] --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Dict, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer

from jax_tinybert import fs
from jax_tinybert.data.corpus import list_text_files
from jax_tinybert.errors import UserError, tool_exit
from jax_tinybert.model import hf
from jax_tinybert.model.export import export_hf

TRIMMABLE = ("WordPiece", "Unigram")


def used_ids(backend: Tokenizer, files: Sequence[str], batch_lines: int = 4096) -> np.ndarray:
    """Sorted ids (int64) the files' lines tokenize into, plus every added/special token."""
    seen = np.zeros(backend.get_vocab_size(with_added_tokens=True), bool)
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            while True:
                lines = [ln for ln in (fh.readline() for _ in range(batch_lines)) if ln]
                if not lines:
                    break
                for e in backend.encode_batch(lines, add_special_tokens=False):
                    seen[e.ids] = True
    seen[list(backend.get_added_tokens_decoder())] = True
    return np.flatnonzero(seen)


def _remap_ids(obj, new_id: Dict[int, int], key: str = "id"):
    """Every `{key: old id}` / special-token id list in a post-processor state, renumbered."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("ids", key) and isinstance(v, list):
                obj[k] = [new_id[int(i)] for i in v]
            elif k in ("sep", "cls") and isinstance(v, list) and len(v) == 2:
                obj[k] = [v[0], new_id[int(v[1])]]
            else:
                _remap_ids(v, new_id, key)
    elif isinstance(obj, list):
        for v in obj:
            _remap_ids(v, new_id, key)


def trim_tokenizer_json(tj: dict, keep: np.ndarray) -> dict:
    """tokenizer.json state `tj` with only the ids `keep` (sorted), renumbered 0..n-1 in order."""
    model = tj["model"]
    if model["type"] not in TRIMMABLE:
        raise UserError(f"trim_vocab: a {model['type']} tokenizer cannot be trimmed here (its "
                        "merges name pieces the corpus never outputs); trimming handles "
                        f"{' and '.join(TRIMMABLE)} (BERT, XLM-R / SentencePiece)")
    new_id = {int(o): n for n, o in enumerate(keep)}
    out = json.loads(json.dumps(tj))
    if model["type"] == "WordPiece":
        by_id = {i: p for p, i in model["vocab"].items()}
        out["model"]["vocab"] = {by_id[int(o)]: n for n, o in enumerate(keep) if int(o) in by_id}
    else:
        out["model"]["vocab"] = [model["vocab"][int(o)] for o in keep
                                 if int(o) < len(model["vocab"])]
        if model.get("unk_id") is not None:
            out["model"]["unk_id"] = new_id[int(model["unk_id"])]
    for t in out.get("added_tokens") or []:
        t["id"] = new_id[int(t["id"])]
    if out.get("post_processor"):
        _remap_ids(out["post_processor"], new_id)
    if out.get("padding"):
        out["padding"]["pad_id"] = new_id.get(int(out["padding"]["pad_id"]), 0)
    return out


def _slice_params(params: dict, keep: np.ndarray) -> dict:
    """The word-embedding rows `keep` (and a masked-LM head's bias entries)."""
    bert = hf.bert_params(params)
    emb = bert["embeddings"]["word_embeddings"]
    emb["embedding"] = np.asarray(emb["embedding"])[keep]
    if "cls" in params and "bias" in params["cls"]:
        params["cls"]["bias"] = np.asarray(params["cls"]["bias"])[keep]
    return params


def _write_tokenizer(src: str, out: str, tj: dict, keep: np.ndarray) -> None:
    """tokenizer.json, a renumbered tokenizer_config.json, the special-token map and (WordPiece)
    vocab.txt in `out`; a SentencePiece .model file is left out (it would be stale)."""
    new_id = {int(o): n for n, o in enumerate(keep)}
    with fs.atomic_open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    cj = os.path.join(src, "tokenizer_config.json")
    if os.path.isfile(cj):
        with open(cj, encoding="utf-8") as f:
            cfg = json.load(f)
        dec = cfg.get("added_tokens_decoder") or {}
        cfg["added_tokens_decoder"] = {str(new_id[int(i)]): v for i, v in dec.items()}
        cfg.pop("vocab_file", None)
        with fs.atomic_open(os.path.join(out, "tokenizer_config.json"), "w",
                            encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)
    if os.path.isfile(os.path.join(src, "special_tokens_map.json")):
        shutil.copy(os.path.join(src, "special_tokens_map.json"), out)
    if tj["model"]["type"] == "WordPiece" and os.path.isfile(os.path.join(src, "vocab.txt")):
        pieces = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
        with fs.atomic_open(os.path.join(out, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("".join(p + "\n" for p, _ in pieces))


def trim(model_dir: str, corpus: Sequence[str], out: str) -> Dict:
    """Writes the trimmed model + tokenizer folder `out` from HF BERT-family folder `model_dir`
    and the corpus files/folders; returns {"vocab_before", "vocab_after", "kept_ids"}."""
    tj_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tj_path):
        raise UserError(f"--model {model_dir}: no tokenizer.json; pass a model folder saved with "
                        "a fast tokenizer (AutoTokenizer(...).save_pretrained)")
    with open(tj_path, encoding="utf-8") as f:
        tj = json.load(f)
    if tj["model"]["type"] not in TRIMMABLE:   # before reading the corpus
        trim_tokenizer_json(tj, np.zeros(0, np.int64))
    backend = Tokenizer.from_file(tj_path)
    backend.no_padding()
    backend.no_truncation()
    files = list_text_files(list(corpus))
    keep = used_ids(backend, files)
    new_tj = trim_tokenizer_json(tj, keep)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        arch = " ".join(json.load(f).get("architectures") or [])
    config, params = hf.load_pretrained(model_dir, mlm_head="MaskedLM" in arch)
    if config.vocab_size < len(keep) or int(keep[-1]) >= config.vocab_size:
        raise UserError(f"--model {model_dir}: the tokenizer has ids up to {int(keep[-1])} but the "
                        f"model only {config.vocab_size} embedding rows")
    params, before = _slice_params(params, keep), config.vocab_size
    pad = config.pad_token_id
    config = config.replace(vocab_size=len(keep),
                            pad_token_id=int(np.searchsorted(keep, pad)) if pad in keep else 0)
    export_hf(config, params, out)
    _write_tokenizer(model_dir, out, new_tj, keep)
    return {"vocab_before": int(before), "vocab_after": len(keep), "kept_ids": keep.tolist()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (module docstring); errors as one line `error: ...`, exit status 2."""
    p = argparse.ArgumentParser(prog="python -m jax_tinybert.data.trim_vocab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF BERT-family folder with tokenizer.json")
    p.add_argument("--corpus", action="append", required=True,
                   help="a text file or folder whose pieces to keep; repeat")
    p.add_argument("--out", required=True, help="the trimmed model + tokenizer folder")
    a = p.parse_args(argv)
    if not os.path.isdir(a.model):
        raise UserError(f"--model {a.model}: no such folder; pass a model folder")
    r = trim(a.model, a.corpus, a.out)
    print(f"{a.out}: vocab {r['vocab_before']:,} -> {r['vocab_after']:,} pieces")
    return 0


if __name__ == "__main__":
    sys.exit(tool_exit(main))
