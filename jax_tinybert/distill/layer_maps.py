"""Student -> teacher layer mappings g(m) (docs/losses.md).

Layers are 1-based; hidden layer 0 is the embedding output. A `LayerMap` holds two lists of
(student, teacher) pairs: `attention` (layers >= 1, attention scores exist only there) and
`hidden` (layers >= 0; for PKD maps these are the [CLS] patience pairs).

    uniform(4, 12)    attention (1,3) (2,6) (3,9) (4,12); hidden (0,0) (1,3) ... (4,12)
    uniform(4, 6)     g(m) = round(m * 6 / 4), halves up: hidden (0,0) (1,2) (2,3) (3,5) (4,6)
    pkd_skip(6, 12)   hidden (1,2) (2,4) (3,6) (4,8) (5,10)
    pkd_last(6, 12)   hidden (1,7) (2,8) (3,9) (4,10) (5,11)
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any, Iterable, Mapping, Sequence, Tuple, Union

from jax_tinybert.errors import UserError

Pairs = Tuple[Tuple[int, int], ...]

NAMES = ("uniform", "top", "bottom", "pkd_skip", "pkd_last")


class LayerMapError(UserError, ValueError):
    """A layer map that does not fit the models, or a layer_map value that does not parse."""


@dataclasses.dataclass(frozen=True)
class LayerMap:
    """Which teacher layer each student layer learns from.

    num_student_layers (M), num_teacher_layers (N); attention: ((s, t), ...) with 1 <= s <= M,
    1 <= t <= N; hidden: ((s, t), ...) with 0 <= s <= M, 0 <= t <= N. name: how it was built.
    """

    num_student_layers: int
    num_teacher_layers: int
    attention: Pairs
    hidden: Pairs
    name: str = "explicit"

    def __post_init__(self):
        object.__setattr__(self, "attention", _as_pairs(self.attention, "attention"))
        object.__setattr__(self, "hidden", _as_pairs(self.hidden, "hidden"))
        _check_counts(self.num_student_layers, self.num_teacher_layers)
        M, N = self.num_student_layers, self.num_teacher_layers
        for field, pairs, lo in (("hidden", self.hidden, 0), ("attention", self.attention, 1)):
            for s, t in pairs:
                if not lo <= s <= M:
                    raise LayerMapError(
                        f"layer map '{self.name}': {field} pair ({s}, {t}) names student layer {s}, "
                        f"but the student has layers {lo}..{M}"
                        + (" (layer 0, the embeddings, has no attention)" if field == "attention"
                           and s == 0 else "") + "; fix the pair or the student's num_hidden_layers")
                if not lo <= t <= N:
                    raise LayerMapError(
                        f"layer map '{self.name}': {field} pair ({s}, {t}) names teacher layer {t}, "
                        f"but the teacher has layers {lo}..{N}; fix the pair or the teacher's "
                        "num_hidden_layers")

    @property
    def student_attention_layers(self) -> Tuple[int, ...]:
        return tuple(s for s, _ in self.attention)

    @property
    def teacher_attention_layers(self) -> Tuple[int, ...]:
        return tuple(t for _, t in self.attention)

    @property
    def student_hidden_layers(self) -> Tuple[int, ...]:
        return tuple(s for s, _ in self.hidden)

    @property
    def teacher_hidden_layers(self) -> Tuple[int, ...]:
        return tuple(t for _, t in self.hidden)

    def to_spec(self) -> dict:
        """JSON-friendly form accepted by `from_spec`."""
        return {"attention": [list(p) for p in self.attention],
                "hidden": [list(p) for p in self.hidden]}


def _as_pairs(pairs: Any, field: str) -> Pairs:
    out = []
    for p in pairs:
        try:
            s, t = p
            s, t = int(s), int(t)
        except (TypeError, ValueError):
            raise LayerMapError(f"layer map {field}: each entry must be a (student_layer, "
                             f"teacher_layer) pair of integers, got {p!r}") from None
        out.append((s, t))
    return tuple(out)


def _check_counts(M: int, N: int) -> None:
    for name, v in (("num_student_layers", M), ("num_teacher_layers", N)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayerMapError(f"layer map: {name} must be a positive integer, got {v!r}")


def _step(M: int, N: int, name: str) -> int:
    _check_counts(M, N)
    if N % M:
        divisors = [d for d in range(1, N + 1) if N % d == 0]
        pairs = ",".join(f"{m}:{_round_map(m, M, N)}" for m in range(M + 1)) if M <= N else \
            "0:0,1:1,..."
        raise LayerMapError(
            f"layer map '{name}': teacher layers ({N}) must be a multiple of student layers ({M}); "
            f"use a student num_hidden_layers in {divisors}, or give explicit pairs, e.g. "
            f"--config.objective.layer_map={pairs}")
    return N // M


def _round_map(m: int, M: int, N: int) -> int:
    """round(m * N / M) with halves rounded up, in integers (exact, no float ties)."""
    return (2 * m * N + M) // (2 * M)


def _check_not_deeper(M: int, N: int, name: str) -> None:
    _check_counts(M, N)
    if M > N:
        raise LayerMapError(f"layer map '{name}': the student ({M} layers) is deeper than the teacher "
                         f"({N} layers); use explicit pairs")


def uniform(num_student_layers: int, num_teacher_layers: int, strict: bool = False) -> LayerMap:
    """TinyBERT's uniform map: attention (m, g(m)) for m = 1..M, hidden (m, g(m)) for m = 0..M.

    g(m) = m * N / M rounded to the nearest integer, halves up. When N is a multiple of M this
    is TinyBERT's g(m) = k m, k = N / M (the official code: 0-based teacher attention
    j*k + k - 1). Otherwise the teacher layers are still distinct, increasing, spread evenly
    and end at g(M) = N: 4 -> 6 layers gives (1,2) (2,3) (3,5) (4,6). strict=True (parity mode
    'tinybert') refuses non-multiples, as the official code asserts. The student must not be
    deeper than the teacher.
    """
    M, N = num_student_layers, num_teacher_layers
    _check_counts(M, N)
    if strict or N % M == 0:
        k = _step(M, N, "uniform")
        g = lambda m: k * m  # noqa: E731
    else:
        _check_not_deeper(M, N, "uniform")
        g = lambda m: _round_map(m, M, N)  # noqa: E731
    return LayerMap(M, N, attention=[(m, g(m)) for m in range(1, M + 1)],
                    hidden=[(m, g(m)) for m in range(M + 1)], name="uniform")


def top(num_student_layers: int, num_teacher_layers: int) -> LayerMap:
    """The last M teacher layers: (m, N - M + m) for m >= 1; embeddings map to embeddings."""
    M, N = num_student_layers, num_teacher_layers
    _check_not_deeper(M, N, "top")
    return LayerMap(M, N, attention=[(m, N - M + m) for m in range(1, M + 1)],
                    hidden=[(0, 0)] + [(m, N - M + m) for m in range(1, M + 1)], name="top")


def bottom(num_student_layers: int, num_teacher_layers: int) -> LayerMap:
    """The first M teacher layers: (m, m) for m = 0..M."""
    M, N = num_student_layers, num_teacher_layers
    _check_not_deeper(M, N, "bottom")
    return LayerMap(M, N, attention=[(m, m) for m in range(1, M + 1)],
                    hidden=[(m, m) for m in range(M + 1)], name="bottom")


def pkd_skip(num_student_layers: int, num_teacher_layers: int) -> LayerMap:
    """PKD-Skip: student layers 1..M-1 against teacher layers k, 2k, ..., (M-1) k.

    12 -> 6: teacher 2, 4, 6, 8, 10 (the official `--fc_layer_idx 1,3,5,7,9`, 0-based).
    The last student layer is covered by the KD term, so it is not in the map.
    """
    M, N = num_student_layers, num_teacher_layers
    k = _step(M, N, "pkd_skip")
    pairs = [(m, k * m) for m in range(1, M)]
    return LayerMap(M, N, attention=pairs, hidden=pairs, name="pkd_skip")


def pkd_last(num_student_layers: int, num_teacher_layers: int) -> LayerMap:
    """PKD-Last: student layers 1..M-1 against the M-1 teacher layers below the top.

    12 -> 6: teacher 7, 8, 9, 10, 11.
    """
    M, N = num_student_layers, num_teacher_layers
    _check_not_deeper(M, N, "pkd_last")
    pairs = [(m, N - M + m) for m in range(1, M)]
    return LayerMap(M, N, attention=pairs, hidden=pairs, name="pkd_last")


_BUILDERS = {"uniform": uniform, "top": top, "bottom": bottom, "pkd_skip": pkd_skip,
             "pkd_last": pkd_last}


def explicit(pairs: Iterable[Sequence[int]], num_student_layers: int, num_teacher_layers: int,
             attention: Iterable[Sequence[int]] = None) -> LayerMap:
    """Hidden pairs as given; attention pairs = `attention`, or the hidden pairs with s >= 1."""
    hidden = _as_pairs(pairs, "hidden")
    att = _as_pairs(attention, "attention") if attention is not None else tuple(
        p for p in hidden if p[0] >= 1)
    return LayerMap(num_student_layers, num_teacher_layers, attention=att, hidden=hidden,
                    name="explicit")


LayerSpec = Union[str, LayerMap, Mapping, Sequence]


def parse_pairs(text: str) -> Pairs:
    """'0:0,1:2,2:3' -> ((0, 0), (1, 2), (2, 3)) (the command line's compact pair syntax)."""
    out = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        s, sep, t = item.partition(":")
        if not sep or not s.isdigit() or not t.isdigit():
            raise LayerMapError(f"layer_map={text!r}: {item!r} is not a student:teacher pair of "
                                "layer numbers; write e.g. --config.objective.layer_map="
                                "0:0,1:2,2:3,3:5,4:6 (layer 0 = the embeddings)")
        out.append((int(s), int(t)))
    if not out:
        raise LayerMapError(f"layer_map={text!r} holds no pairs; write e.g. 0:0,1:2,2:3,3:5,4:6")
    return tuple(out)


def from_spec(spec: LayerSpec, num_student_layers: int, num_teacher_layers: int,
              strict: bool = False) -> LayerMap:
    """Builds a map from a config value.

    spec: a name in NAMES; a LayerMap (checked against M, N); a list of (student, teacher)
    pairs (see `explicit`), also as the string "0:0,1:2,2:3" or a Python literal
    "((0,0),(1,2))"; or a dict {"hidden": pairs, "attention": pairs}. strict: named maps
    refuse what the official code refuses (uniform needs N a multiple of M).
    """
    M, N = num_student_layers, num_teacher_layers
    if isinstance(spec, LayerMap):
        if (spec.num_student_layers, spec.num_teacher_layers) != (M, N):
            raise LayerMapError(
                f"layer_map was built for {spec.num_student_layers} -> {spec.num_teacher_layers} "
                f"layers but the models have {M} -> {N}; rebuild it for these models")
        return spec
    if isinstance(spec, str) and spec.strip()[:1] in "([{":
        # Explicit pairs given on the command line (a config string field).
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError) as e:
            raise LayerMapError(f"layer_map={spec!r} does not parse as (student, teacher) pairs "
                                f"({e}); write e.g. 0:0,1:2,2:3 or ((0,0),(1,2),(2,3))") from None
        return from_spec(spec, M, N)
    if isinstance(spec, str) and ":" in spec:
        return explicit(parse_pairs(spec), M, N)
    if isinstance(spec, str):
        if spec == "uniform":
            return uniform(M, N, strict=strict)
        if spec not in _BUILDERS:
            raise LayerMapError(f"layer_map={spec!r} is not a known map; expected one of {NAMES} "
                             "or explicit student:teacher pairs such as 0:0,1:2,2:3")
        return _BUILDERS[spec](M, N)
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"hidden", "attention"}
        if unknown or "hidden" not in spec:
            raise LayerMapError(f"layer_map dict must have keys 'hidden' (and optionally "
                             f"'attention'), got {sorted(spec)}")
        return explicit(spec["hidden"], M, N, attention=spec.get("attention"))
    if isinstance(spec, (list, tuple)):
        return explicit(spec, M, N)
    raise LayerMapError(f"layer_map must be a name in {NAMES}, a list of (student, teacher) pairs or "
                     f"a dict with 'hidden'/'attention', got {type(spec).__name__}: {spec!r}")


def check_attention_heads(student_heads: int, teacher_heads: int) -> None:
    """Attention-score losses compare [B, H, T, T] tensors: the head counts must be equal."""
    if student_heads != teacher_heads:
        raise LayerMapError(
            f"attention losses need equal head counts: student num_attention_heads="
            f"{student_heads}, teacher num_attention_heads={teacher_heads}; set the student's "
            f"num_attention_heads to {teacher_heads}, or drop the attention term (w_attn=0)")


__all__ = ["LayerMap", "LayerMapError", "NAMES", "parse_pairs", "uniform", "top", "bottom", "pkd_skip", "pkd_last", "explicit",
           "from_spec", "check_attention_heads"]
