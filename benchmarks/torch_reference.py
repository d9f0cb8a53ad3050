"""A PyTorch reference of the jax_tinybert train step, for speed comparisons and loss parity.

Written by us (not the official TinyBERT code): transformers' PyTorch `BertForSequenceClassification`
(attn_implementation="eager") whose self-attention modules are patched to also keep the raw
scores Q K^T / sqrt(d_head) before the additive mask (what TinyBERT distils), the masked-mode
losses of `jax_tinybert.distill.losses` re-written in torch, a shared `fit_dense` projection, AdamW with
the same weight-decay mask (no decay on biases / LayerNorm) and global-norm clipping.
The teacher runs in eval mode under `torch.no_grad()`.

    ref = TorchReference.from_objective(obj, student_config, student_params, teacher_config,
                                        teacher_params, proj_params)
    loss, terms = ref.loss(batch)          # batch: dict of numpy arrays (the library's layout)
    ref.step(batch_tensors)                # one optimizer update; returns the loss (a tensor)

Only mode="masked" and projection "shared" / "none" are implemented (what the benchmark uses).
"""
from __future__ import annotations

import math
import types
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import transformers

Pairs = Tuple[Tuple[int, int], ...]


# ----------------------------------------------------------------------------- models

def _scores_forward(self, hidden_states, attention_mask=None, head_mask=None, *args, **kwargs):
    """BertSelfAttention.forward (eager, absolute positions, no cache) that also keeps the raw
    scores Q K^T / sqrt(d) in `self.raw_scores` when `self.capture` is set."""
    B, T, _ = hidden_states.shape
    H, d = self.num_attention_heads, self.attention_head_size
    q = self.query(hidden_states).view(B, T, H, d).transpose(1, 2)
    k = self.key(hidden_states).view(B, T, H, d).transpose(1, 2)
    v = self.value(hidden_states).view(B, T, H, d).transpose(1, 2)
    if not self.capture and self.sdpa:
        # A layer whose scores no loss reads: PyTorch's fused attention (flash / memory-efficient
        # kernels on a GPU), as ours fuses it there (jax_tinybert/speed/attention.py).
        self.raw_scores = None
        p = self.dropout.p if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p)
        return ctx.permute(0, 2, 1, 3).reshape(B, T, H * d), None
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
    self.raw_scores = scores if self.capture else None
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = self.dropout(F.softmax(scores, dim=-1))
    if head_mask is not None:
        probs = probs * head_mask
    ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(B, T, H * d)
    return ctx, probs


def hf_config(config) -> transformers.BertConfig:
    """jax_tinybert.BertConfig -> transformers.BertConfig with eager attention."""
    d = config.to_dict()
    d.pop("problem_type", None)
    return transformers.BertConfig(**d, attn_implementation="eager")


def build_model(config, params: dict, capture_layers: Sequence[int] = (),
                sdpa: bool = False) -> torch.nn.Module:
    """A transformers BertForSequenceClassification holding `params` (flax, {"bert", "classifier"})
    whose 1-based layers `capture_layers` keep their raw attention scores; with `sdpa` the
    others run F.scaled_dot_product_attention."""
    from jax_tinybert.model.hf import params_to_torch_state_dict

    model = transformers.BertForSequenceClassification(hf_config(config))
    sd = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in
          params_to_torch_state_dict(params).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the PyTorch model: missing {missing}, "
                         f"unexpected {unexpected}")
    for i, layer in enumerate(model.bert.encoder.layer):
        sa = layer.attention.self
        sa.forward = types.MethodType(_scores_forward, sa)
        sa.capture = (i + 1) in set(capture_layers)
        sa.sdpa, sa.raw_scores = sdpa, None
    return model


def _scores(model) -> Tuple[Optional[torch.Tensor], ...]:
    return tuple(layer.attention.self.raw_scores for layer in model.bert.encoder.layer)


# ----------------------------------------------------------------------------- losses (masked)

def _example_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (valid * x).sum() / valid.sum()


def attention_mse(s, t, mask, valid):
    """s, t [B, H, T, T]: mean over heads and (query, key) pairs of real tokens."""
    H = s.shape[1]
    m = mask.to(s.dtype)
    pair = (valid[:, None, None] * m[:, :, None] * m[:, None, :])[:, None]
    return (pair * (s - t) ** 2).sum() / (H * pair.sum())


def hidden_mse(s, t, mask, valid):
    """s, t [B, T, D]: mean over real tokens and hidden units."""
    w = valid[:, None] * mask.to(s.dtype)
    return (w[:, :, None] * (s - t) ** 2).sum() / (s.shape[-1] * w.sum())


def soft_cross_entropy(s, t, temperature, valid, t2=False):
    p = F.softmax(t / temperature, -1)
    per_ex = -(p * F.log_softmax(s / temperature, -1)).sum(-1)
    loss = _example_mean(per_ex, valid)
    return loss * temperature ** 2 if t2 else loss


def kl_divergence(s, t, temperature, valid, t2=True):
    log_q = F.log_softmax(s / temperature, -1)
    log_p = F.log_softmax(t / temperature, -1)
    per_ex = (log_p.exp() * (log_p - log_q)).sum(-1)
    loss = _example_mean(per_ex, valid)
    return loss * temperature ** 2 if t2 else loss


def cross_entropy(logits, labels, valid):
    return _example_mean(F.cross_entropy(logits, labels, reduction="none"), valid)


def patience_loss(s_cls, t_cls, valid, normalize=True):
    """The paper's patience loss (masked mode): sum over the K layers and D units, mean over
    examples."""
    if normalize:
        s_cls, t_cls = F.normalize(s_cls, dim=-1), F.normalize(t_cls, dim=-1)
    return _example_mean(((s_cls - t_cls) ** 2).sum(dim=(1, 2)), valid)


# ----------------------------------------------------------------------------- the step

def to_torch_batch(batch: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(np.asarray(batch[k]).astype(np.int64))
           for k in ("input_ids", "attention_mask", "token_type_ids")}
    if "labels" in batch:
        out["labels"] = torch.from_numpy(np.asarray(batch["labels"]).astype(np.int64))
    B = out["input_ids"].shape[0]
    out["valid"] = torch.from_numpy(np.asarray(batch["valid"], np.float32)) if "valid" in batch \
        else torch.ones(B)
    return out


class TorchReference:
    """The train step of one stage in PyTorch.

    stage: finetune | tinybert_intermediate | tinybert_pred | pkd. cfg: the resolved objective
    cfg (`Objective.cfg`: temperature, alpha, beta, t2, w_*, normalize_patience, projection).
    attn_pairs / hidden_pairs: (student, teacher) 1-based layers (hidden 0 = embeddings; for pkd
    the hidden pairs are the [CLS] patience pairs). proj_params: {"fit_dense": {"kernel", "bias"}}
    or {} (flax layout, kernel [d_s, d_t]). device: where the models live (default CPU); batches
    passed to `step` / `loss` must already be there. fast: the layers whose scores no loss
    reads run F.scaled_dot_product_attention and the step is torch.compile'd (the fastest
    PyTorch step to compare with; the default is the eager one the equivalence tests read).
    """

    def __init__(self, stage: str, cfg: dict, student_config, student_params, teacher_config=None,
                 teacher_params=None, proj_params=None, attn_pairs: Pairs = (),
                 hidden_pairs: Pairs = (), lr: float = 5e-5, weight_decay: float = 0.01,
                 clip_norm: Optional[float] = 1.0, student_dropout: bool = True,
                 device=None, fast: bool = False):
        if cfg.get("mode", "masked") != "masked":
            raise ValueError("the PyTorch reference implements mode='masked' only")
        self.stage, self.cfg = stage, dict(cfg)
        self.attn_pairs, self.hidden_pairs = tuple(attn_pairs), tuple(hidden_pairs)
        self.student = build_model(student_config, student_params,
                                   [s for s, _ in self.attn_pairs], sdpa=fast)
        self.student.train(student_dropout)
        self.teacher = None
        if stage != "finetune":
            self.teacher = build_model(teacher_config, teacher_params,
                                       [t for _, t in self.attn_pairs], sdpa=fast).eval()
            for p in self.teacher.parameters():
                p.requires_grad_(False)
        self.fit_dense = None
        proj_params = proj_params or {}
        if set(proj_params) - {"fit_dense"}:
            raise ValueError(f"only a shared fit_dense projection is implemented, got "
                             f"{sorted(proj_params)}")
        if proj_params:
            k = np.asarray(proj_params["fit_dense"]["kernel"], np.float32)
            self.fit_dense = torch.nn.Linear(k.shape[0], k.shape[1])
            with torch.no_grad():
                self.fit_dense.weight.copy_(torch.from_numpy(np.ascontiguousarray(k.T)))
                self.fit_dense.bias.copy_(torch.from_numpy(
                    np.array(proj_params["fit_dense"]["bias"], np.float32)))
        if device is not None:  # before the optimizer, so it holds the moved parameters
            self.student.to(device)
            if self.teacher is not None:
                self.teacher.to(device)
            if self.fit_dense is not None:
                self.fit_dense.to(device)
        named = list(self.student.named_parameters(prefix="student"))
        if self.fit_dense is not None:
            named += list(self.fit_dense.named_parameters(prefix="fit_dense"))
        self.params = [p for _, p in named]
        no_decay = lambda n: n.endswith("bias") or "LayerNorm" in n
        groups = [{"params": [p for n, p in named if not no_decay(n)],
                   "weight_decay": weight_decay},
                  {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                     foreach=True)
        self.clip_norm = clip_norm
        # The forward and backward compiled (the optimizer's foreach update stays eager).
        self._grad_step = torch.compile(self._grad) if fast else self._grad

    @classmethod
    def from_objective(cls, obj, student_config, student_params, teacher_config=None,
                       teacher_params=None, proj_params=None, **kw) -> "TorchReference":
        """Takes the stage, cfg and layer pairs from a `jax_tinybert.distill.objectives.Objective`."""
        attn = hidden = ()
        if obj.name == "tinybert_intermediate":
            attn, hidden = obj.layer_map.attention, obj.layer_map.hidden
        elif obj.name == "pkd" and obj.cfg["beta"] != 0.0:
            hidden = obj.layer_map.hidden
        return cls(obj.name, obj.cfg, student_config, student_params, teacher_config,
                   teacher_params, proj_params, attn, hidden, **kw)

    def _project(self, x):
        return self.fit_dense(x) if self.fit_dense is not None else x

    def loss(self, batch) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(total loss, unweighted terms) of the current params on `batch` (torch tensors)."""
        if isinstance(next(iter(batch.values())), np.ndarray):
            batch = to_torch_batch(batch)
        c = self.cfg
        ids, mask, tt, valid = (batch["input_ids"], batch["attention_mask"],
                                batch["token_type_ids"], batch["valid"])
        t_out = None
        if self.teacher is not None:
            with torch.no_grad():
                t_out = self.teacher(input_ids=ids, attention_mask=mask, token_type_ids=tt,
                                     output_hidden_states=True)
                t_scores = _scores(self.teacher)
        s_out = self.student(input_ids=ids, attention_mask=mask, token_type_ids=tt,
                             output_hidden_states=self.stage in ("tinybert_intermediate", "pkd"))
        terms: Dict[str, torch.Tensor] = {}
        if self.stage == "finetune":
            v = cross_entropy(s_out.logits, batch["labels"], valid)
            return v, {"ce": v}
        if self.stage == "tinybert_pred":
            v = soft_cross_entropy(s_out.logits, t_out.logits, c["temperature"], valid, c["t2"])
            return c["w_pred"] * v, {"pred": v}
        if self.stage == "tinybert_intermediate":
            s_scores = _scores(self.student)
            total = s_out.logits.new_zeros(())
            attn = hidn = s_out.logits.new_zeros(())
            for s, t in self.attn_pairs:
                v = attention_mse(s_scores[s - 1], t_scores[t - 1], mask, valid)
                attn = attn + v
                total = total + c["w_attn"] * v
            for s, t in self.hidden_pairs:
                v = hidden_mse(self._project(s_out.hidden_states[s]), t_out.hidden_states[t],
                               mask, valid)
                if s == 0:
                    terms["embd"] = v
                    total = total + c["w_embd"] * v
                else:
                    hidn = hidn + v
                    total = total + c["w_hidn"] * v
            terms.update(attn=attn, hidn=hidn)
            return total, terms
        if self.stage == "pkd":
            ce = cross_entropy(s_out.logits, batch["labels"], valid)
            kd = kl_divergence(s_out.logits, t_out.logits, c["temperature"], valid, c["t2"])
            total = c["alpha"] * kd + (1.0 - c["alpha"]) * ce
            terms.update(ce=ce, kd=kd)
            if self.hidden_pairs:
                s_cls = torch.stack([self._project(s_out.hidden_states[s][:, 0])
                                     for s, _ in self.hidden_pairs], 1)
                t_cls = torch.stack([t_out.hidden_states[t][:, 0]
                                     for _, t in self.hidden_pairs], 1)
                pt = patience_loss(s_cls, t_cls, valid, c["normalize_patience"])
                terms["pt"] = pt
                total = total + c["beta"] * pt
            return total, terms
        raise ValueError(f"stage {self.stage!r} not implemented in the PyTorch reference")

    def _grad(self, batch) -> torch.Tensor:
        loss, _ = self.loss(batch)
        loss.backward()
        return loss.detach()

    def step(self, batch) -> torch.Tensor:
        """One AdamW update on `batch` (torch tensors, see `to_torch_batch`); returns the loss."""
        self.opt.zero_grad(set_to_none=True)
        loss = self._grad_step(batch)
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm, foreach=True)
        self.opt.step()
        return loss


__all__ = ["TorchReference", "build_model", "hf_config", "to_torch_batch", "attention_mse",
           "hidden_mse", "soft_cross_entropy", "kl_divergence", "cross_entropy", "patience_loss"]
