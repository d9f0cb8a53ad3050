"""Entity-level precision, recall and F1 for NER, by conlleval's chunk rules (what `seqeval`
computes in its default mode): a chunk is a maximal run opened by B-X, or by I-X after O or a
chunk of another type, and continued by I-X; a predicted chunk counts when its span and type
are exactly a gold one's."""
from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

Chunk = Tuple[str, int, int]   # (type, first word, last word), per sentence


def _split(tag: str) -> Tuple[str, str]:
    return ("O", "") if tag == "O" else (tag[0], tag[2:])


def chunks(tags: Sequence[str]) -> List[Chunk]:
    """The chunks of one sentence's IOB tags (IOB1 or IOB2), conlleval's rules."""
    out, start, ctype = [], None, ""
    prev_tag, prev_type = "O", ""
    for i, tag in enumerate(list(tags) + ["O"]):
        t, typ = _split(tag)
        ends = start is not None and (t in ("B", "O") or typ != prev_type)
        if ends:
            out.append((ctype, start, i - 1))
            start = None
        opens = t == "B" or (t == "I" and (prev_tag == "O" or typ != prev_type))
        if opens and start is None:
            start, ctype = i, typ
        prev_tag, prev_type = t, typ
    return out


def entity_scores(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]
                  ) -> Dict[str, float]:
    """Micro precision / recall / f1 over all sentences' chunks (fractions in [0, 1]), and
    f1 per entity type as `f1_<TYPE>`."""
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences, {len(pred)} predicted")
    g: Set[Tuple[int, Chunk]] = set()
    p: Set[Tuple[int, Chunk]] = set()
    for k, (a, b) in enumerate(zip(gold, pred)):
        if len(a) != len(b):
            raise ValueError(f"sentence {k}: {len(a)} gold tags, {len(b)} predicted")
        g.update((k, c) for c in chunks(a))
        p.update((k, c) for c in chunks(b))

    def prf(gs, ps):
        tp = len(gs & ps)
        prec = tp / len(ps) if ps else 0.0
        rec = tp / len(gs) if gs else 0.0
        return prec, rec, (2 * prec * rec / (prec + rec) if prec + rec else 0.0)

    prec, rec, f1 = prf(g, p)
    out = {"precision": prec, "recall": rec, "f1": f1}
    for typ in sorted({c[1][0] for c in g | p}):
        out[f"f1_{typ}"] = prf({c for c in g if c[1][0] == typ}, {c for c in p if c[1][0] == typ})[2]
    return out
