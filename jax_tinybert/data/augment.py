"""TinyBERT data augmentation (Jiao et al. 2020, Alg. 1), batched.

Two candidate sources (`mode`):

"mlm" (the paper). For each whitespace word of a sentence that is alphabetic and not a stop-word:
  * a word that is one piece gets candidates from a masked LM: the sentence with that word
    replaced by the tokenizer's mask token, top-K whole-word predictions (all masked copies of
    many sentences go through the model together, in fixed-shape batches, one forward per batch);
  * a word of several pieces gets its K nearest neighbours (cosine) in an embedding table: a
    GloVe text file when given, else the MLM's input word embeddings (the word's vector being the
    mean of its pieces' vectors; neighbours are whole-word vocab entries).

"embedding" (no masked LM at all): every eligible word gets its K nearest neighbours (cosine) in
the word-embedding table of any BERT encoder (e.g. the teacher), its vector being the mean of its
pieces' vectors. Candidates are whole-word vocab entries only (data/words.py: a WordPiece entry
that is not a "##" piece, a byte-level BPE "Ġ" entry, a SentencePiece "▁" entry, its text
decoded as the tokenizer decodes it): no special tokens, no non-alphabetic entries.
Context-free, so neighbours can be antonyms or other inflections ("good" -> "bad", "goodness"),
as with the paper's GloVe path for multi-piece words.

Then N times: each candidate word is replaced, with probability p, by a uniformly drawn
candidate. Candidates never include the word itself, so "replaced" means "changed".
As in the official script, duplicate outputs are dropped (`dedupe`), so an example yields at
most N new sentences; for sentence-pair tasks each side is augmented separately with the other
side kept. Randomness is drawn per (seed, row, column), so results do not depend on batching.

SQuAD (`augment_squad`): the questions are augmented, the contexts kept, so every answer keeps its
offsets; CoNLL (`augment_conll`): only words tagged O are replaced, one for one, so the tags stay
in place. The file each writes is the stage's `--config.data.train_file`.

CLI: python -m jax_tinybert.data.augment --task SST-2 --glue_dir GLUE --mlm bert-base-uncased \
       --out OUT_DIR_OR_FILE.tsv [--glove_path glove.6B.300d.txt] [--N 20 --K 15 --p 0.4 --seed 42]
     python -m jax_tinybert.data.augment --task SST-2 --glue_dir GLUE --mode embedding \
       --encoder TEACHER_FOLDER --out OUT_DIR
     python -m jax_tinybert.data.augment --task squad11 --data_dir ../shared/data/squad/v1.1 \
       --mode embedding --encoder TEACHER_FOLDER --out runs/squad11/train_aug.json
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_tinybert import fs
from jax_tinybert.model import hf
from jax_tinybert.data import conll, glue, position_tasks, squad, words as word_schemes
from jax_tinybert.data.tokenize import load_tokenizer, special_template, subset_indices
from jax_tinybert.errors import PathError, tool_exit
from jax_tinybert.model.modeling import BertForMaskedLM, BertModel, _MLMHead

log = logging.getLogger(__name__)

# NLTK's English stop-word list (the official TinyBERT script hard-codes the same list).
STOP_WORDS = frozenset("""
i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their
theirs themselves what which who whom this that that'll these those am is are was were be been
being have has had having do does did doing a an the and but if or because as until while of at
by for with about against between into through during before after above below to from up down
in out on off over under again further then once here there when where why how all any both
each few more most other some such no nor not only own same so than too very s t can will just
don don't should should've now d ll m o re ve y ain aren aren't couldn couldn't didn didn't
doesn doesn't hadn hadn't hasn hasn't haven haven't isn isn't ma mightn mightn't mustn mustn't
needn needn't shan shan't shouldn shouldn't wasn wasn't weren weren't won won't wouldn wouldn't
""".split())


def is_candidate_word(word: str) -> bool:
    """Alphabetic and not a stop-word (case-insensitive)."""
    return word.isalpha() and word.lower() not in STOP_WORDS


def _match_case(cand: str, word: str) -> str:
    return cand.capitalize() if word[:1].isupper() and not word.isupper() else (
        cand.upper() if word.isupper() and len(word) > 1 else cand)


class EmbeddingTable:
    """Unit-normalised word vectors [V, D] with their words, for cosine nearest neighbours."""

    def __init__(self, words: Sequence[str], vectors: np.ndarray):
        self.words = list(words)
        v = np.asarray(vectors, np.float32)
        self.vectors = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def from_glove(cls, path: str, max_words: Optional[int] = None) -> "EmbeddingTable":
        """GloVe text format: `word v1 ... vD` per line (most frequent first)."""
        words, vecs = [], []
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.rstrip().split(" ")
                if len(parts) < 3:
                    continue
                try:
                    vecs.append(np.asarray(parts[1:], np.float32))
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: expected 'word v1 ... vD'") from None
                if vecs and len(vecs[-1]) != len(vecs[0]):
                    raise ValueError(f"{path}:{lineno}: {len(vecs[-1])} values, expected "
                                     f"{len(vecs[0])}")
                words.append(parts[0])
                if max_words and len(words) >= max_words:
                    break
        if not words:
            raise ValueError(f"{path}: no vectors read")
        return cls(words, np.stack(vecs))

    def neighbours(self, queries: np.ndarray, k: int, exclude: Sequence[Sequence[str]],
                   chunk: int = 1024) -> List[List[str]]:
        """Top-k words by cosine to each query [m, D], skipping words in `exclude[i]`."""
        q = np.asarray(queries, np.float32)
        q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
        out = []
        for s in range(0, len(q), chunk):
            sims = q[s:s + chunk] @ self.vectors.T
            kk = min(k + 8, sims.shape[1])
            top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]
            for r in range(len(top)):
                order = top[r][np.argsort(-sims[r, top[r]], kind="stable")]
                ex = {w.lower() for w in exclude[s + r]}
                out.append([self.words[j] for j in order if self.words[j].lower() not in ex][:k])
        return out


MODES = ("mlm", "embedding")


class Augmenter:
    """TinyBERT augmentation.

    mode="mlm": a Flax `BertForMaskedLM` (`mlm_params` = {"bert", "cls"}) proposes one-piece
    words. mode="embedding": no MLM; `word_embeddings` [V, D] (any BERT's input word embeddings,
    default: those of `mlm_params`) give cosine neighbours for every word.
    """

    def __init__(self, tokenizer, mlm_model=None, mlm_params=None, *, mode: str = "mlm",
                 word_embeddings: Optional[np.ndarray] = None,
                 glove: Optional[EmbeddingTable] = None,
                 N: int = 20, K: int = 15, p: float = 0.4, seed: int = 42, max_seq_len: int = 128,
                 batch_size: int = 64, buckets: Sequence[int] = (32, 64, 128), dedupe: bool = True):
        if mode not in MODES:
            raise ValueError(f"Augmenter: mode={mode!r}; expected one of {MODES}")
        if mode == "mlm" and (mlm_model is None or mlm_params is None):
            raise ValueError("Augmenter: mode='mlm' needs mlm_model and mlm_params (a BERT with a "
                             "masked-LM head, e.g. one fitted by configs/mlm_head.py); "
                             "mode='embedding' needs only word_embeddings")
        if word_embeddings is None:
            if mlm_params is None:
                raise ValueError("Augmenter: mode='embedding' needs word_embeddings [V, D] (e.g. "
                                 "params['embeddings']['word_embeddings']['embedding'] of the "
                                 "teacher)")
            word_embeddings = mlm_params["bert"]["embeddings"]["word_embeddings"]["embedding"]
        self.mode = mode
        self.word_embeddings = np.asarray(word_embeddings, np.float32)
        if self.word_embeddings.ndim != 2:
            raise ValueError(f"Augmenter: word_embeddings must be [V, D], got "
                             f"{self.word_embeddings.shape}")
        self.tok = tokenizer
        self.N, self.K, self.p, self.seed = int(N), int(K), float(p), int(seed)
        self.max_seq_len = int(max_seq_len)
        self.batch_size = int(batch_size)
        self.buckets = tuple(sorted(b for b in buckets if b < max_seq_len)) + (self.max_seq_len,)
        self.dedupe = dedupe
        self.params = mlm_params
        self.glove = glove
        vocab = tokenizer.get_vocab()
        self.scheme = word_schemes.scheme_of(tokenizer)
        special = set(tokenizer.all_special_ids)
        # Only whole-word (the scheme's word-initial pieces), alphabetic, non-special vocab
        # entries can replace a word; id2word: their text, the marker dropped and decoded.
        ok = np.zeros(max(vocab.values()) + 1, bool)
        self.id2word: Dict[int, str] = {}
        for t, i in vocab.items():
            w = None if i in special else self.scheme.word_of_piece(t)
            if w and w.isalpha():
                ok[i], self.id2word[i] = True, w
        self.whole_word = ok
        self.mask_id = tokenizer.mask_token_id
        if mode == "mlm" and self.mask_id is None:
            raise ValueError("Augmenter: mode='mlm' needs a tokenizer with a mask token")
        self.template = special_template(tokenizer, pair=False)
        self._emb_table = None
        if len(ok) > self.word_embeddings.shape[0]:
            raise ValueError(f"Augmenter: the tokenizer has ids up to {len(ok) - 1} but the word "
                             f"embeddings only {self.word_embeddings.shape[0]} rows: tokenizer and "
                             "model do not belong together")
        if mode == "mlm":
            self._build_mlm(mlm_model)

    def _build_mlm(self, mlm_model) -> None:
        c = mlm_model.config
        dtype = getattr(mlm_model, "dtype", jax.numpy.float32)
        bert = BertModel(c, dtype=dtype, add_pooling_layer=False)
        head = _MLMHead(c, dtype=dtype)
        k = self.K + 16  # spare candidates for the filters below

        def top(params, ids, mask, pos, allowed):
            # The MLM head only at the mask positions: [B, V] instead of [B, T, V] logits.
            out = bert.apply({"params": params["bert"]}, ids, mask, None, deterministic=True,
                             attention_logits=False)
            h = out.hidden_states[-1][jax.numpy.arange(ids.shape[0]), pos]
            logits = head.apply({"params": params["cls"]}, h,
                                params["bert"]["embeddings"]["word_embeddings"]["embedding"])
            logits = jax.numpy.where(allowed, logits, -jax.numpy.inf)
            return jax.lax.top_k(logits, k)[1]

        v, ok = c.vocab_size, self.whole_word
        ok_dev = np.zeros(v, bool)
        ok_dev[:min(v, len(ok))] = ok[:v]
        self._ok_dev = jax.numpy.asarray(ok_dev)
        self._top = jax.jit(top)

    # -- candidates -------------------------------------------------------------------------
    def _word_pieces(self, words: Sequence[str]) -> Dict[str, List[int]]:
        uniq = sorted(set(words))
        # Each word as it stands inside a sentence (byte-level BPE: after a space, "Ġword").
        texts = [self.scheme.word_text(w) for w in uniq]
        enc = self.tok(texts, add_special_tokens=False, return_attention_mask=False,
                       return_token_type_ids=False, verbose=False)["input_ids"] if uniq else []
        return dict(zip(uniq, enc))

    def _mlm_candidates(self, requests: List[Tuple[List[List[int]], int, str]]) -> List[List[str]]:
        """requests: (pieces of every word of the sentence, word index, word). One forward per
        batch of `batch_size` masked sentences."""
        seqs, poss = [], []
        for pieces, idx, _ in requests:
            left = [t for w in pieces[:idx] for t in w]
            right = [t for w in pieces[idx + 1:] for t in w]
            room = self.max_seq_len - 1 - self.template.num_special
            if len(left) + len(right) > room:  # keep a window around the mask
                keep_l = min(len(left), max(room // 2, room - len(right)))
                left, right = left[len(left) - keep_l:], right[:room - keep_l]
            seqs.append(self.template.build(left + [self.mask_id] + right)[0])
            poss.append(len(self.template.ids[0]) + len(left))
        out: List[Optional[List[str]]] = [None] * len(seqs)
        lens = np.array([len(s) for s in seqs])
        bucket = np.searchsorted(np.array(self.buckets), lens)
        for bi, T in enumerate(self.buckets):
            rows = np.flatnonzero(bucket == bi)
            for s in range(0, len(rows), self.batch_size):
                chunk = rows[s:s + self.batch_size]
                ids = np.zeros((self.batch_size, T), np.int32)
                mask = np.zeros((self.batch_size, T), np.int32)
                pos = np.zeros(self.batch_size, np.int32)
                mask[:, 0] = 1
                for r, j in enumerate(chunk):
                    ids[r, :lens[j]] = seqs[j]
                    mask[r, :lens[j]] = 1
                    pos[r] = poss[j]
                top = np.asarray(self._top(self.params, ids, mask, pos, self._ok_dev))
                for r, j in enumerate(chunk):
                    cands = [self.id2word[int(t)] for t in top[r] if int(t) in self.id2word]
                    out[j] = self._filter(cands, requests[j][2])
        return out

    def _embedding_table(self) -> EmbeddingTable:
        if self.glove is not None:
            return self.glove
        if self._emb_table is None:
            emb = self.word_embeddings
            ids = np.flatnonzero(self.whole_word[:emb.shape[0]])
            self._emb_table = EmbeddingTable([self.id2word[int(i)] for i in ids], emb[ids])
        return self._emb_table

    def _embedding_candidates(self, words: List[str], pieces: Dict[str, List[int]]
                              ) -> Dict[str, List[str]]:
        table = self._embedding_table()
        uniq = sorted(set(words))
        if self.glove is not None:
            uniq = [w for w in uniq if w.lower() in table.index or w in table.index]
            q = np.stack([table.vectors[table.index.get(w.lower(), table.index.get(w))]
                          for w in uniq]) if uniq else np.zeros((0, 1))
        else:
            emb = self.word_embeddings
            q = np.stack([emb[pieces[w]].mean(0) for w in uniq]) if uniq else np.zeros((0, 1))
        nn = table.neighbours(q, self.K + 16, [[w] for w in uniq]) if uniq else []
        return {w: self._filter(c, w) for w, c in zip(uniq, nn)}

    def _filter(self, cands: Sequence[str], word: str) -> List[str]:
        """Drops the word itself, non-alphabetic entries and, for an ASCII word, non-ASCII
        ones (e.g. stray CJK characters of a multilingual-ish vocab); keeps the first K."""
        w = word.lower()
        ascii_only = word.isascii()
        return [c for c in cands if c.lower() != w and c.isalpha()
                and (c.isascii() or not ascii_only)][:self.K]

    def candidates(self, sentences: Sequence[str]) -> List[Dict[int, List[str]]]:
        """For each sentence: {word index: candidate replacements (<= K)} over its eligible
        words. All MLM queries of all sentences are batched together."""
        split = [s.split() for s in sentences]
        pieces = self._word_pieces([w for ws in split for w in ws])
        requests, where, multi = [], [], []
        for si, ws in enumerate(split):
            for wi, w in enumerate(ws):
                if not is_candidate_word(w) or not pieces[w]:
                    continue
                if len(pieces[w]) == 1 and self.mode == "mlm":
                    requests.append(([pieces[x] for x in ws], wi, w))
                    where.append((si, wi))
                else:
                    multi.append((si, wi, w))
        result: List[Dict[int, List[str]]] = [{} for _ in split]
        if requests:
            for (si, wi), c in zip(where, self._mlm_candidates(requests)):
                if c:
                    result[si][wi] = [_match_case(x, split[si][wi]) for x in c]
        if multi:
            nn = self._embedding_candidates([w for _, _, w in multi], pieces)
            for si, wi, w in multi:
                c = nn.get(w)
                if c:
                    result[si][wi] = [_match_case(x, w) for x in c]
        return result

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, sentence: str, cands: Dict[int, List[str]], rng: np.random.Generator
               ) -> List[str]:
        """Up to N augmented versions of `sentence` (deduplicated, original excluded, when
        `dedupe`)."""
        words = sentence.split()
        seen = {" ".join(words)}
        out = []
        keys = sorted(cands)
        for _ in range(self.N):
            new = list(words)
            for wi in keys:
                choice = cands[wi][int(rng.integers(len(cands[wi])))]
                if rng.random() < self.p:
                    new[wi] = choice
            s = " ".join(new)
            if self.dedupe:
                if s in seen:
                    continue
                seen.add(s)
            out.append(s)
        return out

    def augment_sentences(self, sentences: Sequence[str], keys: Sequence[Tuple[int, int]]
                          ) -> List[List[str]]:
        """Augments `sentences`; `keys[i]` = (row, column) seeds sentence i's random stream."""
        cands = self.candidates(sentences)
        return [self.sample(s, c, np.random.default_rng([self.seed, r, col]))
                for s, c, (r, col) in zip(sentences, cands, keys)]

    def augment_tsv(self, task, in_path: str, out_path: str, chunk_rows: int = 512,
                    max_rows: Optional[int] = None) -> Dict:
        """Reads a GLUE TSV, writes the augmented TSV (header kept; each original row followed by
        its augmented rows) atomically. max_rows: only the first rows (a quick look). Returns
        counts."""
        spec = glue.get_task(task)
        glue.read_tsv_split(spec, "train", in_path)  # validates the whole file first
        with open(in_path, encoding="utf-8-sig", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        header = [rows.pop(0)] if spec.has_header else []
        if max_rows:
            rows = rows[:max_rows]
        cols = [c for c in (spec.text_a_col, spec.text_b_col) if c is not None]
        fs.clean_stale_temps(out_path)
        n_out = 0
        with fs.atomic_open(out_path, "w", encoding="utf-8", newline="") as f:
            for h in header:
                f.write("\t".join(h) + "\n")
            for s in range(0, len(rows), chunk_rows):
                block = rows[s:s + chunk_rows]
                sents, keys = [], []
                for r, row in enumerate(block, start=s):
                    for c in cols:
                        sents.append(row[c])
                        keys.append((r, c))
                aug = iter(self.augment_sentences(sents, keys))
                for row in block:
                    f.write("\t".join(row) + "\n")
                    n_out += 1
                    for c in cols:
                        for new in next(aug):
                            new_row = list(row)
                            new_row[c] = new
                            f.write("\t".join(new_row) + "\n")
                            n_out += 1
                log.info("augmented %d / %d rows", min(s + chunk_rows, len(rows)), len(rows))
        return {"rows_in": len(rows), "rows_out": n_out}


    def augment_squad(self, in_path: str, out_path: str, subset: int = 0,
                      subset_seed: int = 0) -> Dict:
        """A SQuAD JSON file with its questions augmented, the contexts (and so the answers'
        offsets) kept: each question followed by up to N copies with words replaced, ids
        '<id>_aug<k>', the same answers. Written atomically in the official format. subset > 0:
        only the questions a stage with data.train_subset=subset (train.seed=subset_seed) reads."""
        examples = _take(squad.read_squad_file(in_path), subset, subset_seed)
        v2 = any(e.is_impossible for e in examples) or _squad_version(in_path) == "2.0"
        aug = self.augment_sentences([e.question for e in examples],
                                     [(i, 0) for i in range(len(examples))])
        paragraphs: Dict[Tuple[str, str], List[dict]] = {}
        for e, new in zip(examples, aug):
            qas = paragraphs.setdefault((e.title, e.context), [])
            for k, q in enumerate([e.question] + new):
                qa = {"id": e.id if k == 0 else f"{e.id}_aug{k}", "question": q,
                      "answers": [{"text": t, "answer_start": a}
                                  for t, a in zip(e.answers, e.answer_starts)]}
                if v2:
                    qa["is_impossible"] = e.is_impossible
                qas.append(qa)
        articles: Dict[str, List[dict]] = {}
        for (title, context), qas in paragraphs.items():
            articles.setdefault(title, []).append({"context": context, "qas": qas})
        doc = {"version": "v2.0" if v2 else "1.1",
               "data": [{"title": t, "paragraphs": p} for t, p in articles.items()]}
        fs.clean_stale_temps(out_path)
        with fs.atomic_open(out_path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        n_out = sum(len(q) for q in paragraphs.values())
        return {"rows_in": len(examples), "rows_out": n_out}

    def augment_conll(self, in_path: str, out_path: str, column: int = -1, subset: int = 0,
                      subset_seed: int = 0) -> Dict:
        """A CoNLL file with its sentences augmented where the labels stay true: only words
        tagged O are replaced, one word for one, so every tag keeps its word's place. Written
        as 'word TAG' lines (IOB2; read with ner_column -1), each sentence followed by its
        copies, atomically. subset > 0: only the sentences a stage with that data.train_subset
        reads (as augment_squad)."""
        sents = _take(conll.read_conll(in_path, column), subset, subset_seed)
        texts = [" ".join(s.words) for s in sents]
        cands = self.candidates(texts)
        fs.clean_stale_temps(out_path)
        n_out = 0
        with fs.atomic_open(out_path, "w", encoding="utf-8") as f:
            for i, (sent, text, c) in enumerate(zip(sents, texts, cands)):
                outside = {w: v for w, v in c.items() if sent.tags[w] == "O"}
                rng = np.random.default_rng([self.seed, i, 0])
                for words in [list(sent.words)] + [t.split() for t in
                                                    self.sample(text, outside, rng)]:
                    f.write("".join(f"{w} {t}\n" for w, t in zip(words, sent.tags)) + "\n")
                    n_out += 1
        return {"rows_in": len(sents), "rows_out": n_out}


def _take(rows: list, n: int, seed: int) -> list:
    """The rows a stage with data.train_subset=n reads (position_tasks.load's draw)."""
    idx = subset_indices(len(rows), n, seed)
    return rows if idx is None else [rows[int(i)] for i in idx]


def _squad_version(path: str) -> str:
    with fs.open_file(path, "rb") as fh:
        return str(json.loads(fh.read().decode("utf-8")).get("version", "")).lstrip("v")


def _resolve(flag: str, path_or_name: str) -> str:
    """hf.resolve_path, its error naming `flag` and what works without the hub."""
    try:
        return hf.resolve_path(path_or_name)
    except PathError as e:
        problem = str(e).split("; pass ", 1)[0]   # resolve_path's fix names config values
        raise PathError(f"{flag} {problem}; pass a folder holding config.json and the weights "
                        "(a masked LM for --mode mlm, e.g. the export of configs/mlm_head.py; "
                        "any BERT for --mode embedding --encoder, e.g. the teacher's export), "
                        "or a hub name when online") from e


def _main(argv=None):
    ap = argparse.ArgumentParser(description="TinyBERT data augmentation -> <out>/train_aug.tsv")
    ap.add_argument("--task", required=True)
    ap.add_argument("--glue_dir", default="", help="GLUE folder (<glue_dir>/<Task>/train.tsv)")
    ap.add_argument("--data_dir", default="",
                    help="--task squad11 / squad20 / conll2003: the folder holding train.json / "
                    "train.txt (SQuAD: the questions are augmented; CoNLL: the words tagged O)")
    ap.add_argument("--mode", choices=MODES, default="mlm",
                    help="mlm: masked-LM candidates (the paper); embedding: word-embedding "
                    "neighbours of --encoder, no MLM needed")
    ap.add_argument("--mlm", default=None,
                    help="mode mlm: HF BERT masked-LM folder or hub name (e.g. bert-base-uncased, "
                    "or the export of configs/mlm_head.py)")
    ap.add_argument("--encoder", default=None,
                    help="mode embedding: any HF BERT folder (e.g. the teacher); default --mlm")
    ap.add_argument("--out", required=True,
                    help="output .tsv file, or a folder (writes <folder>/train_aug.tsv)")
    ap.add_argument("--train_file", default=None,
                    help="augment this TSV instead of <glue_dir>/<Task>/train.tsv")
    ap.add_argument("--glove_path", default=None, help="GloVe .txt; default: MLM embeddings")
    ap.add_argument("--glove_max_words", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --mlm/--encoder)")
    ap.add_argument("--N", type=int, default=20)
    ap.add_argument("--K", type=int, default=15)
    ap.add_argument("--p", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max_seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--no_dedupe", action="store_true")
    ap.add_argument("--max_rows", type=int, default=None,
                    help="augment only the first N training rows (a quick look)")
    args = ap.parse_args(argv)
    if args.mode == "mlm" and not args.mlm:
        ap.error("--mode mlm needs --mlm (a BERT with a masked-LM head); without one use "
                 "--mode embedding --encoder TEACHER_FOLDER, or fit a head with configs/mlm_head.py")
    if args.mode == "embedding" and not (args.encoder or args.mlm):
        ap.error("--mode embedding needs --encoder (any HF BERT folder, e.g. the teacher)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    position = position_tasks.get(args.task)
    spec = None if position else glue.get_task(args.task)
    where = "--data_dir" if position else "--glue_dir"
    if not (args.data_dir if position else args.glue_dir) and not args.train_file:
        ap.error(f"--task {args.task} needs {where}")
    glove = EmbeddingTable.from_glove(args.glove_path, args.glove_max_words) if args.glove_path else None
    common = dict(glove=glove, N=args.N, K=args.K, p=args.p, seed=args.seed,
                  max_seq_len=args.max_seq_len, batch_size=args.batch_size,
                  dedupe=not args.no_dedupe)
    # The folder first (a hub name is downloaded here): a path or a hub name that cannot be had
    # is one line naming it, not the tokenizer loader's retries and traceback (offline: ~1 min).
    flag = "--mlm" if args.mode == "mlm" or not args.encoder else "--encoder"
    model = _resolve(flag, args.mlm if flag == "--mlm" else args.encoder)
    tok = load_tokenizer(_resolve("--tokenizer", args.tokenizer) if args.tokenizer else model)
    if args.mode == "mlm":
        config, params = hf.load_pretrained(model, mlm_head=True)
        aug = Augmenter(tok, BertForMaskedLM(config), params, **common)
    else:
        _, params = hf.load_pretrained(model, for_classification=False)
        emb = hf.bert_params(params)["embeddings"]["word_embeddings"]["embedding"]
        aug = Augmenter(tok, mode="embedding", word_embeddings=emb, **common)
    t0 = time.time()
    if position:
        src = args.train_file or position_tasks.file_path(position, "train", args.data_dir)
        ext = os.path.splitext(position.files["train"])[1]
        out = args.out if args.out.endswith(ext) else os.path.join(args.out, "train_aug" + ext)
        stats = (aug.augment_squad(src, out) if position.head == "span"
                 else aug.augment_conll(src, out))
    else:
        src = args.train_file or glue.tsv_path(args.glue_dir, spec, "train")
        out = args.out if args.out.endswith(".tsv") else os.path.join(args.out, "train_aug.tsv")
        stats = aug.augment_tsv(spec, src, out, max_rows=args.max_rows)
    dt = time.time() - t0
    log.info("wrote %s: %d rows from %d in %.1f s (%.1f input rows/s)", out, stats["rows_out"],
             stats["rows_in"], dt, stats["rows_in"] / max(dt, 1e-9))


if __name__ == "__main__":
    sys.exit(tool_exit(_main))
