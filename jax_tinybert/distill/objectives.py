"""Objectives: a stage names one (config.objective.name) plus its cfg (the other fields).

    obj = make_objective("tinybert_intermediate", {"mode": "masked"}, student_config, teacher_config)
    proj = obj.init_projection(rng)                 # {} when the objective has no projection
    loss, terms = obj(proj, s_out, t_out, batch)    # pure; t_out may be None for cached stages

Each objective is a small class registered under its name: it declares its cfg `defaults`
(the one source of them: a config field left at None means "the objective's default"), what it
needs of the teacher (`needs_teacher`, `teacher_cacheable`, `compares_logits`) and its `loss`.
A new objective is a subclass with `@register` (see docs/design.md).

- tinybert_intermediate: w_embd L_embd + sum_m lambda_m (w_attn L_attn^m + w_hidn L_hidn^m).
- tinybert_pred: w_pred soft CE to the teacher at temperature T (MSE to the teacher for
  regression; regression_target="gold" reproduces the official STS-B bug, tinybert mode only).
- pkd: (1 - alpha) CE + alpha KD + beta PT, PT on [CLS] of the mapped student layers.
- kd: Hinton, (1 - alpha) CE + alpha KD (regression: MSE to gold and to the teacher).
- finetune: CE (MSE for regression) on gold labels; no teacher.
- minilm: MiniLM's L_AT + L_VR, teacher layer -> the student's last (equal head counts).
- minilmv2: MiniLMv2's QQ + KK + VV relation KL over `relation_heads` relation heads.
"""
from __future__ import annotations

import types
from typing import Any, ClassVar, Dict, Optional, Tuple, Type

import jax
import jax.numpy as jnp

from jax_tinybert.distill import layer_maps as lm
from jax_tinybert.distill.cfg_keys import (ATTN_LOSS_NAMES, CFG_KEYS, HIDN_LOSS_NAMES,  # noqa: F401
                                           KD_LOSSES, PROJECTIONS, ObjectiveConfigError,
                                           resolve_cfg as _resolve_cfg)
from jax_tinybert.distill import losses as L

Array = jax.Array

_COMMON = {"mode": "masked", "temperature": 1.0, "alpha": 0.5, "beta": 0.0, "t2": False,
           "layer_map": "uniform", "projection": "shared", "w_embd": 1.0, "w_attn": 1.0,
           "w_hidn": 1.0, "w_pred": 1.0, "normalize_patience": True, "layer_weights": None,
           "regression_target": "teacher", "attn_loss": "mse", "hidn_loss": "mse",
           "kd_loss": "ce", "probability_shift": False, "teacher_layer": None,
           "relation_heads": None}
ATTN_LOSSES = {"mse": L.attention_mse, "kl": L.attention_kl}
HIDN_LOSSES = {"mse": L.hidden_mse, "cosine": L.cosine_hidden_loss}
assert tuple(ATTN_LOSSES) == ATTN_LOSS_NAMES and tuple(HIDN_LOSSES) == HIDN_LOSS_NAMES
PKD_PUBLISHED_BETA = 500.0  # Sun et al. 2019, for the official mean over B*K*D


def kl_without_masking(cfg: Dict[str, Any]) -> bool:
    """Whether an intermediate-layer cfg asks for attention KL in parity mode (which has none)."""
    return cfg.get("attn_loss") == "kl" and cfg.get("mode") not in (None, "masked")


class Objective:
    """A configured objective; call it as obj(proj, s_out, t_out, batch) -> (loss, terms).

    Class attributes (declared by each registered subclass): name, defaults (every cfg key),
    needs_teacher (the loss reads the teacher's outputs), teacher_cacheable (those outputs are
    per-example logits / [CLS] vectors, computable once: see teacher_cache), compares_logits
    (student and teacher heads must predict the same labels), reads_tokens (the loss reads
    per-token outputs; False: only logits and [CLS] vectors, so the models' last layer need
    compute only its [CLS] row, `cls_only`).
    Instance attributes: cfg (resolved, defaults filled in), mode, layer_map (or None),
    student_attention_layers / teacher_attention_layers (1-based layers whose attention logits
    the models must return), teacher_cls_layers (teacher layers whose [CLS] vectors PKD reads,
    in the order of batch["teacher_cls"]), is_regression.
    """

    name: ClassVar[str] = ""
    defaults: ClassVar[Dict[str, Any]] = _COMMON
    needs_teacher: bool = True
    teacher_cacheable: bool = False
    # Per-token teacher outputs (attention logits, hidden states): cacheable too, but large, so
    # cached only for runs of more than two epochs (config.teacher.cache_tokens).
    teacher_token_cacheable: bool = False
    compares_logits: ClassVar[bool] = False
    reads_tokens: ClassVar[bool] = True
    # Reads intermediate layers only (no labels, no logits): runs on an unlabelled corpus and
    # trains no classifier, so its stage has no dev metrics.
    intermediate: ClassVar[bool] = False

    def __init__(self, cfg: Any, student_config, teacher_config=None, head: str = "sequence"):
        self.cfg = _resolve_cfg(self.name, self.defaults, cfg)
        # span / token: per-position logits, read as rows of classification logits (__call__);
        # the last layer's every row is computed.
        self.head = head   # span / token: their teacher cache is teacher/positions.py
        if head != "sequence":
            self.reads_tokens = True
        self.mode = self.cfg["mode"]
        self.student_config = student_config
        self.teacher_config = teacher_config
        self.layer_map: Optional[lm.LayerMap] = None
        self.student_attention_layers: Tuple[int, ...] = ()
        self.teacher_attention_layers: Tuple[int, ...] = ()
        self.teacher_cls_layers: Tuple[int, ...] = ()
        # 1-based layers whose q, k, v [B, H, T, d_head] the models must return (qkv_layers=).
        self.student_qkv_layers: Tuple[int, ...] = ()
        self.teacher_qkv_layers: Tuple[int, ...] = ()
        self._attn_pairs: Tuple[Tuple[int, int], ...] = ()
        self._hidden_pairs: Tuple[Tuple[int, int], ...] = ()
        self._proj_layers: Tuple[int, ...] = ()
        self.is_regression = student_config.num_labels == 1
        if self.needs_teacher and teacher_config is None:
            raise ObjectiveConfigError(f"objective '{self.name}' needs teacher_config (the teacher's "
                             "BertConfig)")
        if self.compares_logits and teacher_config.num_labels != student_config.num_labels:
            raise ObjectiveConfigError(
                f"objective '{self.name}': student num_labels={student_config.num_labels} != "
                f"teacher num_labels={teacher_config.num_labels}; both heads must predict "
                "the same labels: pass a teacher fine-tuned on this task "
                "(configs/finetune_teacher.py:<task>, then --config.teacher.path="
                "runs/<task>/teacher/export)")
        self.setup()

    def setup(self) -> None:
        """Per-objective checks and layer maps, after the common fields are set."""

    def loss(self, proj, s_out, t_out, batch) -> Tuple[Array, Dict[str, Array]]:
        """(total loss scalar, dict of unweighted scalar terms)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ setup
    def _map(self) -> lm.LayerMap:
        spec = self.cfg["layer_map"]
        if hasattr(spec, "to_dict"):
            spec = spec.to_dict()
        # Parity mode keeps the official code's assertion that N is a multiple of M.
        return lm.from_spec(spec, self.student_config.num_hidden_layers,
                            self.teacher_config.num_hidden_layers, strict=self.mode == "tinybert")

    def _setup_projection(self, layers) -> None:
        ds, dt = self.student_config.hidden_size, self.teacher_config.hidden_size
        if self.cfg["projection"] == "none":
            if layers and ds != dt:
                raise ObjectiveConfigError(
                    f"objective '{self.name}': student hidden_size={ds} != teacher hidden_size="
                    f"{dt} and cfg projection='none'; set projection='shared' or 'per_layer'")
            layers = ()
        self._proj_layers = tuple(sorted(set(layers)))

    # ------------------------------------------------------------------ projection
    def _proj_key(self, s: int) -> str:
        return "fit_dense" if self.cfg["projection"] == "shared" else f"fit_dense_{s}"

    def init_projection(self, rng: Array) -> dict:
        """Projection params {"fit_dense": {"kernel" [d_s, d_t], "bias" [d_t]}} ('shared'),
        {"fit_dense_<m>": ...} per student layer m ('per_layer'), or {}."""
        if not self._proj_layers:
            return {}
        ds, dt = self.student_config.hidden_size, self.teacher_config.hidden_size
        std = float(getattr(self.student_config, "initializer_range", 0.02))
        keys = sorted({self._proj_key(s) for s in self._proj_layers})
        rngs = jax.random.split(rng, len(keys))
        return {k: L.init_dense(r, ds, dt, std) for k, r in zip(keys, rngs)}

    def _project(self, proj: dict, s: int, x: Array) -> Array:
        if not self._proj_layers:
            return x
        key = self._proj_key(s)
        if key not in proj:
            raise ValueError(f"objective '{self.name}': projection params lack {key!r}; build them "
                             f"with obj.init_projection(rng) (got keys {sorted(proj)})")
        return L.project(proj[key], x)

    # ------------------------------------------------------------------ teacher side
    def teacher_features(self, t_out) -> Dict[str, Array]:
        """What a teacher cache stores per example: teacher_logits [b, C], teacher_cls [b, K, D_t]."""
        out = {"teacher_logits": t_out.logits}
        if self.teacher_cls_layers:
            out["teacher_cls"] = jnp.stack([t_out.hidden_states[t][:, 0]
                                            for t in self.teacher_cls_layers], axis=1)
        return out

    def _teacher_logits(self, t_out, batch) -> Array:
        if t_out is not None and t_out.logits is not None:
            return t_out.logits
        if "teacher_logits" in batch:
            return batch["teacher_logits"]
        raise ValueError(f"objective '{self.name}' needs the teacher's logits: pass t_out from a "
                         "classification teacher or batch['teacher_logits'] from the teacher cache")

    def _soft_term(self, s: Array, t_out, batch, ce) -> Array:
        """A classification soft-label term: `ce` (this objective's soft CE / KL, called as
        ce(s, t, T, mode=, t2=, valid=)) or the logits' MSE (kd_loss='mse'), against the
        teacher's logits (probability_shift: shifted to peak at batch['labels'])."""
        c, valid = self.cfg, batch.get("valid")
        t = self._teacher_logits(t_out, batch)
        if c["probability_shift"]:
            t = L.probability_shift(t, batch["labels"])
        if c["kd_loss"] == "mse":
            return L.logits_mse(s, t, c["temperature"], t2=c["t2"], valid=valid)
        return ce(s, t, c["temperature"], mode=self.mode, t2=c["t2"], valid=valid)

    def _teacher_cls(self, t_out, batch) -> Array:
        if t_out is not None:
            return jnp.stack([t_out.hidden_states[t][:, 0] for t in self.teacher_cls_layers], 1)
        if "teacher_cls" in batch:
            tc = batch["teacher_cls"]
            if tc.shape[1] != len(self.teacher_cls_layers):
                raise ValueError(f"batch['teacher_cls'] has {tc.shape[1]} layers but the layer map "
                                 f"needs {len(self.teacher_cls_layers)} (teacher layers "
                                 f"{self.teacher_cls_layers})")
            return tc
        raise ValueError("objective 'pkd' needs the teacher's [CLS] vectors: pass t_out or "
                         "batch['teacher_cls'] [b, K, D_t]")

    # ------------------------------------------------------------------ the loss
    def __call__(self, proj, s_out, t_out, batch) -> Tuple[Array, Dict[str, Array]]:
        """Returns (total loss scalar, dict of unweighted scalar terms)."""
        proj = proj or {}
        if (self.needs_teacher and t_out is None and not self.teacher_cacheable
                and not (self.teacher_token_cacheable
                         and any(k in batch for k in CACHED_TOKEN_KEYS))):
            raise ValueError(f"objective '{self.name}' needs the teacher's outputs (t_out)")
        if self.head != "sequence" and not self.intermediate:
            s_out, t_out, batch = self._as_rows(s_out, t_out, batch)
        return self.loss(proj, s_out, t_out, batch)

    def _as_rows(self, s_out, t_out, batch):
        """Span / token logits and labels as rows (losses.position_rows); the batch's `valid`:
        the rows' weights, its example weights kept as `example_valid`."""
        rows = lambda out: out if out is None else out.replace(
            logits=L.position_rows(out.logits, self.head))
        b = dict(batch, valid=L.position_weights(self.head, batch["attention_mask"],
                                                 batch.get("valid")), example_valid=batch.get("valid"))
        if "labels" in batch:
            b["labels"] = batch["labels"].reshape(-1)
        if "teacher_logits" in batch:   # teacher/positions.py's, [B, 2, T] / [B, T, C]
            b["teacher_logits"] = L.position_rows(batch["teacher_logits"], self.head)
        return rows(s_out), rows(t_out), b

    def __repr__(self) -> str:
        lmap = f", layer_map={self.layer_map.name}" if self.layer_map else ""
        return f"Objective({self.name!r}, mode={self.mode!r}{lmap})"


REGISTRY: Dict[str, Type[Objective]] = {}


def register(cls: Type[Objective]) -> Type[Objective]:
    """Class decorator: makes `cls` available as config.objective.name = cls.name."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"objective class {cls.__name__}: name {cls.name!r} is empty or taken")
    missing = sorted(set(CFG_KEYS) - set(cls.defaults))
    if missing:
        raise ValueError(f"objective {cls.name!r}: defaults lack {missing}")
    REGISTRY[cls.name] = cls
    return cls


# ---------------------------------------------------------------------- the objectives

# Batch keys a teacher cache fills for the intermediate objective (teacher_cache.py).
CACHED_TOKEN_KEYS = ("teacher_attn", "teacher_hidden")


@register
class TinyBertIntermediate(Objective):
    """TinyBERT's intermediate-layer loss (general distillation and task stage 1)."""
    name = "tinybert_intermediate"
    defaults = dict(_COMMON)
    teacher_token_cacheable = True
    intermediate = True

    def setup(self) -> None:
        c = self.cfg
        if kl_without_masking(c):
            raise ObjectiveConfigError(
                f"objective '{self.name}': cfg attn_loss='kl' has no counterpart in the official "
                "TinyBERT code, so it runs in mode='masked' only; pass mode=masked or "
                "attn_loss=mse")
        self.layer_map = self._map()
        if c["w_attn"] != 0.0 and self.layer_map.attention:
            lm.check_attention_heads(self.student_config.num_attention_heads,
                                     self.teacher_config.num_attention_heads)
            self._attn_pairs = self.layer_map.attention
        self._hidden_pairs = tuple(
            (s, t) for s, t in self.layer_map.hidden
            if (c["w_embd"] if s == 0 else c["w_hidn"]) != 0.0)
        self.student_attention_layers = tuple(sorted({s for s, _ in self._attn_pairs}))
        self.teacher_attention_layers = tuple(sorted({t for _, t in self._attn_pairs}))
        lw = c["layer_weights"]
        M = self.student_config.num_hidden_layers
        if lw is not None:
            lw = tuple(float(x) for x in lw)
            if len(lw) != M + 1:
                raise ObjectiveConfigError(f"objective '{self.name}': cfg layer_weights needs M + 1 = "
                                 f"{M + 1} values (student layers 0..{M}), got {len(lw)}")
        self._layer_weights = lw or (1.0,) * (M + 1)
        self._setup_projection([s for s, _ in self._hidden_pairs])
        self.teacher_hidden_layers = tuple(sorted({t for _, t in self._hidden_pairs}))

    @property
    def token_cache_fields(self) -> Tuple[str, ...]:
        """The per-token fields `teacher_features` returns (those some layer pair reads)."""
        return tuple(k for k, layers in zip(CACHED_TOKEN_KEYS, (self.teacher_attention_layers,
                                                                self.teacher_hidden_layers))
                     if layers)

    def teacher_features(self, t_out) -> Dict[str, Array]:
        """What a teacher cache stores per example: teacher_attn [b, K_a, H, T, T] (the attention
        logits of `teacher_attention_layers`), teacher_hidden [b, K_h, T, D_t] (the hidden states
        of `teacher_hidden_layers`, 0 = embeddings); a field is absent when no pair reads it."""
        out = {}
        if self.teacher_attention_layers:
            out["teacher_attn"] = jnp.stack([t_out.attention_logits[t - 1]
                                             for t in self.teacher_attention_layers], axis=1)
        if self.teacher_hidden_layers:
            out["teacher_hidden"] = jnp.stack([t_out.hidden_states[t]
                                               for t in self.teacher_hidden_layers], axis=1)
        return out

    def _cached_teacher(self, batch):
        """A BertOutput-like view of the cached teacher_attn / teacher_hidden of a batch."""
        L_t = self.teacher_config.num_hidden_layers
        attn, hidden = [None] * L_t, [None] * (L_t + 1)
        for i, t in enumerate(self.teacher_attention_layers):
            attn[t - 1] = batch["teacher_attn"][:, i]
        for i, t in enumerate(self.teacher_hidden_layers):
            hidden[t] = batch["teacher_hidden"][:, i]
        return types.SimpleNamespace(attention_logits=attn, hidden_states=hidden)

    def loss(self, proj, s_out, t_out, batch):
        if t_out is None:
            t_out = self._cached_teacher(batch)
        mode, c, lw = self.mode, self.cfg, self._layer_weights
        attn_loss, hidn_loss = ATTN_LOSSES[c["attn_loss"]], HIDN_LOSSES[c["hidn_loss"]]
        mask, valid = batch["attention_mask"], batch.get("valid")
        terms: Dict[str, Array] = {}
        total = jnp.zeros((), jnp.float32)
        attn = hidn = jnp.zeros((), jnp.float32)
        for s, t in self._attn_pairs:
            sl, tl = s_out.attention_logits[s - 1], t_out.attention_logits[t - 1]
            if sl is None or tl is None:
                raise ValueError(
                    f"attention logits of student layer {s} / teacher layer {t} are missing: apply "
                    f"the models with attention_logits=obj.student_attention_layers / "
                    "obj.teacher_attention_layers")
            v = attn_loss(sl, tl, mask, mode=mode, valid=valid)
            terms[f"attn/{s}"] = terms.get(f"attn/{s}", 0.0) + v
            attn = attn + v
            total = total + lw[s] * c["w_attn"] * v
        for s, t in self._hidden_pairs:
            hs = self._project(proj, s, s_out.hidden_states[s])
            v = hidn_loss(hs, t_out.hidden_states[t], mask, mode=mode, valid=valid)
            if s == 0:
                terms["embd"] = terms.get("embd", 0.0) + v
                total = total + lw[0] * c["w_embd"] * v
            else:
                terms[f"hidn/{s}"] = terms.get(f"hidn/{s}", 0.0) + v
                hidn = hidn + v
                total = total + lw[s] * c["w_hidn"] * v
        if self._attn_pairs:
            terms["attn"] = attn
        if any(s > 0 for s, _ in self._hidden_pairs):
            terms["hidn"] = hidn
        return total, terms


@register
class TinyBertPred(Objective):
    """TinyBERT's prediction-layer loss (task stage 2): soft CE to the teacher's logits."""
    name = "tinybert_pred"
    defaults = dict(_COMMON)
    teacher_cacheable = True
    compares_logits = True
    reads_tokens = False

    def setup(self) -> None:
        if self.is_regression and self.cfg["regression_target"] == "gold":
            if self.mode != "tinybert":
                raise ObjectiveConfigError("regression_target='gold' reproduces the official STS-B bug "
                                 "(the prediction stage fits the gold score, not the teacher); "
                                 "it is only offered with mode='tinybert'")
            self.needs_teacher = False
            self.teacher_cacheable = False

    def loss(self, proj, s_out, t_out, batch):
        c, valid = self.cfg, batch.get("valid")
        s = s_out.logits
        if self.is_regression:
            target = batch["labels"] if c["regression_target"] == "gold" else \
                self._teacher_logits(t_out, batch)
            v = L.regression_mse(s, target, valid=valid)
        else:
            v = self._soft_term(s, t_out, batch, L.soft_cross_entropy)
        return c["w_pred"] * v, {"pred": v}


class _HardAndSoft(Objective):
    """(1 - alpha) hard-label loss + alpha soft loss to the teacher's logits (KD, PKD)."""
    teacher_cacheable = True
    compares_logits = True
    reads_tokens = False   # PKD's patience loss reads [CLS] vectors only

    def _hard_and_soft(self, s_out, t_out, batch):
        c, valid, s = self.cfg, batch.get("valid"), s_out.logits
        if self.is_regression:
            hard = L.regression_mse(s, batch["labels"], valid=valid)
            soft = L.regression_mse(s, self._teacher_logits(t_out, batch), valid=valid)
        else:
            hard = L.cross_entropy(s, batch["labels"], valid=valid)
            soft = self._soft_term(s, t_out, batch, L.kl_divergence)
        # The official PKD order: alpha * KD + (1 - alpha) * CE.
        return c["alpha"] * soft + (1.0 - c["alpha"]) * hard, {"ce": hard, "kd": soft}


@register
class PKD(_HardAndSoft):
    """Patient knowledge distillation: KD + beta * patience loss on mapped [CLS] vectors."""
    name = "pkd"
    # PKD's published recipe: T 10, alpha 0.7, beta 500 for the official mean over B*K*D;
    # beta=None resolves to that, rescaled to the mode (see setup).
    defaults = dict(_COMMON, temperature=10.0, alpha=0.7, beta=None, t2=True,
                    layer_map="pkd_skip", projection="none")

    def setup(self) -> None:
        self.layer_map = self._map()
        if self.cfg["beta"] is None:
            # The published beta is for the official mean over B*K*D; the masked (formula) loss
            # sums over K*D, so the same training signal needs beta / (K*D) there.
            width = (self.teacher_config or self.student_config).hidden_size
            kd_units = max(1, len(self.layer_map.hidden)) * width
            self.cfg["beta"] = PKD_PUBLISHED_BETA / (1.0 if self.mode == "tinybert" else kd_units)
        self._hidden_pairs = self.layer_map.hidden if self.cfg["beta"] != 0.0 else ()
        self.teacher_cls_layers = tuple(t for _, t in self._hidden_pairs)
        self._setup_projection([s for s, _ in self._hidden_pairs])

    def loss(self, proj, s_out, t_out, batch):
        total, terms = self._hard_and_soft(s_out, t_out, batch)
        if not self._hidden_pairs:
            return total, terms
        s_cls = jnp.stack([self._project(proj, s, s_out.hidden_states[s][:, 0])
                           for s, _ in self._hidden_pairs], axis=1)
        pt = L.patience_loss(s_cls, self._teacher_cls(t_out, batch),
                             normalize=self.cfg["normalize_patience"], mode=self.mode,
                             valid=batch.get("example_valid", batch.get("valid")))
        scaled = self.cfg["beta"] * pt
        if self.mode == "tinybert":
            # Official: beta * <float16 tensor> is float16 again, i.e. rounded a second time.
            scaled = L.round_f16(scaled)
        terms["pt"] = pt
        return total + scaled, terms


@register
class KD(_HardAndSoft):
    """Hinton et al.'s knowledge distillation."""
    name = "kd"
    defaults = dict(_COMMON, temperature=2.0, alpha=0.5, t2=True)

    def loss(self, proj, s_out, t_out, batch):
        return self._hard_and_soft(s_out, t_out, batch)


@register
class Finetune(Objective):
    """Plain fine-tuning on gold labels (the teacher's own training); no teacher."""
    name = "finetune"
    defaults = dict(_COMMON)
    needs_teacher = False
    reads_tokens = False

    def loss(self, proj, s_out, t_out, batch):
        valid = batch.get("valid")
        if self.is_regression:
            v = L.regression_mse(s_out.logits, batch["labels"], valid=valid)
            return v, {"mse": v}
        v = L.cross_entropy(s_out.logits, batch["labels"], valid=valid)
        return v, {"ce": v}


class _SelfAttentionRelations(Objective):
    """MiniLM / MiniLMv2: relations of one teacher layer's q, k, v (cfg teacher_layer, default
    the last) to the student's last layer's; the teacher runs in the step (no cache)."""
    intermediate = True

    def setup(self) -> None:
        c, n_t = self.cfg, self.teacher_config.num_hidden_layers
        if self.mode != "masked":
            raise ObjectiveConfigError(f"objective '{self.name}' has no official TinyBERT "
                                       "reduction; pass --config.objective.mode=masked")
        t = n_t if c["teacher_layer"] is None else c["teacher_layer"]
        if not (isinstance(t, int) and 1 <= t <= n_t):
            raise ObjectiveConfigError(f"objective '{self.name}': objective.teacher_layer={t!r}; "
                                       f"expected a teacher layer in 1..{n_t}")
        c["teacher_layer"] = t
        self.teacher_qkv_layers = (t,)
        self.student_qkv_layers = (self.student_config.num_hidden_layers,)

    def _pair(self, s_out, t_out):
        s, t = s_out.qkv, t_out.qkv
        if s is None or t is None or s[-1] is None or t[self.cfg["teacher_layer"] - 1] is None:
            raise ValueError(f"objective '{self.name}' needs q, k, v: apply the models with "
                             "qkv_layers=obj.student_qkv_layers / obj.teacher_qkv_layers")
        return s[-1], t[self.cfg["teacher_layer"] - 1]


@register
class MiniLM(_SelfAttentionRelations):
    """MiniLM (Wang et al. 2020): attention-distribution + value-relation KL, equal heads."""
    name = "minilm"
    defaults = dict(_COMMON)

    def setup(self) -> None:
        super().setup()
        hs, ht = self.student_config.num_attention_heads, self.teacher_config.num_attention_heads
        if hs != ht:
            raise ObjectiveConfigError(
                f"objective 'minilm': student num_attention_heads={hs} != teacher's {ht}; MiniLM "
                "compares per head: give the student the teacher's head count or use minilmv2")

    def loss(self, proj, s_out, t_out, batch):
        return L.minilm_loss(*self._pair(s_out, t_out), batch["attention_mask"],
                             valid=batch.get("valid"))


@register
class MiniLMv2(_SelfAttentionRelations):
    """MiniLMv2 (Wang et al. 2021): Q-Q, K-K and V-V relation KL over relation heads."""
    name = "minilmv2"
    defaults = dict(_COMMON)

    def setup(self) -> None:
        super().setup()
        ds, tc = self.student_config.hidden_size, self.teacher_config
        heads = self.cfg["relation_heads"]
        if heads is None:   # the paper: 12 for base-size teachers, 64 for large ones
            heads = 64 if tc.hidden_size >= 1024 else tc.num_attention_heads
        if not (isinstance(heads, int) and heads >= 1 and ds % heads == 0
                and tc.hidden_size % heads == 0):
            ok = [a for a in range(1, min(ds, tc.hidden_size) + 1)
                  if ds % a == 0 and tc.hidden_size % a == 0]
            raise ObjectiveConfigError(
                f"objective 'minilmv2': objective.relation_heads={heads!r} must divide the student "
                f"width {ds} and the teacher width {tc.hidden_size}; valid values: {ok}")
        self.cfg["relation_heads"] = heads

    def loss(self, proj, s_out, t_out, batch):
        return L.minilmv2_loss(*self._pair(s_out, t_out), batch["attention_mask"],
                               self.cfg["relation_heads"], valid=batch.get("valid"))


OBJECTIVES = tuple(REGISTRY)
# Those that read intermediate layers only: the ones general distillation (a corpus) can run.
INTERMEDIATE = tuple(n for n, cls in REGISTRY.items() if cls.intermediate)
# Read-only view of each objective's declared defaults (docs, tests).
DEFAULTS = {n: dict(cls.defaults) for n, cls in REGISTRY.items()}


def make_objective(name: str, cfg: Any, student_config, teacher_config=None,
                   head: str = "sequence") -> Objective:
    """Builds a registered objective (one of OBJECTIVES) from its cfg (dict or ConfigDict;
    None values take the objective's defaults) for a model with `head` (sequence, span, token)."""
    if name not in REGISTRY:
        raise ObjectiveConfigError(f"unknown objective {name!r}; expected one of "
                                   f"{tuple(REGISTRY)}")
    return REGISTRY[name](cfg, student_config, teacher_config, head)


__all__ = ["OBJECTIVES", "CFG_KEYS", "DEFAULTS", "REGISTRY", "Objective", "make_objective",
           "register"]
