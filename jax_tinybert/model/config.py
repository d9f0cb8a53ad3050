"""A BERT model's hyper-parameters, as Hugging Face's `config.json` holds them."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

from jax_tinybert.errors import UserError
from jax_tinybert.fs import write_json_atomic

# The HF activation names the model implements exactly ("gelu" in HF BERT is the exact erf GELU).
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")
# The encoder families the model implements (model/families.py).
MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "electra", "distilbert")
# DistilBERT's config.json names of BERT's fields.
DISTILBERT_FIELDS = {"dim": "hidden_size", "n_layers": "num_hidden_layers",
                     "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size",
                     "activation": "hidden_act", "dropout": "hidden_dropout_prob",
                     "attention_dropout": "attention_probs_dropout_prob"}


class ConfigError(UserError, ValueError):
    """A model config field has a value the model cannot use."""


@dataclasses.dataclass
class BertConfig:
    """Hyper-parameters of a BERT model; round-trips Hugging Face's `config.json`.

    Unknown keys of an HF config are kept in `extra` and written back unchanged.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 2
    id2label: Optional[dict] = None
    problem_type: Optional[str] = None
    model_type: str = "bert"           # one of MODEL_TYPES (model/families.py)
    embedding_size: Optional[int] = None   # ELECTRA: embedding tables' width; None = hidden_size
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    def validate(self, source: str = "config") -> None:
        """Raises ConfigError naming the field and the expected value."""
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{source}: field '{f}' must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{source}: field 'hidden_size' ({self.hidden_size}) must be divisible by "
                f"'num_attention_heads' ({self.num_attention_heads}); e.g. use "
                f"{self.num_attention_heads * max(1, self.hidden_size // self.num_attention_heads)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"{source}: field 'hidden_act' is {self.hidden_act!r}; expected one of "
                f"{sorted(ACTIVATIONS)}")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: field 'model_type' is {self.model_type!r}; jax_tinybert "
                              f"loads {', '.join(MODEL_TYPES)} checkpoints")
        if self.embedding_size is not None and (not isinstance(self.embedding_size, int)
                                                or self.embedding_size <= 0):
            raise ConfigError(f"{source}: field 'embedding_size' must be a positive integer, "
                              f"got {self.embedding_size!r}")
        if not isinstance(self.num_labels, int) or self.num_labels < 1:
            raise ConfigError(f"{source}: field 'num_labels' must be >= 1 (1 = regression), "
                              f"got {self.num_labels!r}")
        for f in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            v = getattr(self, f)
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"{source}: field '{f}' must be in [0, 1), got {v!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "BertConfig":
        d = dict(d)
        if d.get("model_type") == "distilbert":
            d.update({ours: d.pop(theirs) for theirs, ours in DISTILBERT_FIELDS.items()
                      if theirs in d})
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: d.pop(k) for k in list(d) if k in names}
        if "id2label" in kw and kw["id2label"] is not None:
            kw["id2label"] = {int(k): v for k, v in kw["id2label"].items()}
            kw.setdefault("num_labels", len(kw["id2label"]))
            if "num_labels" not in d and len(kw["id2label"]) != kw["num_labels"]:
                kw["num_labels"] = len(kw["id2label"])
        d.pop("label2id", None)
        kw.setdefault("model_type", "bert")
        if kw.get("embedding_size") == kw.get("hidden_size", cls.hidden_size):
            kw["embedding_size"] = None
        obj = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.name in kw:
                setattr(obj, f.name, kw[f.name])
            elif f.default is not dataclasses.MISSING:
                setattr(obj, f.name, f.default)
            else:
                setattr(obj, f.name, f.default_factory())
        obj.extra = d
        obj.validate(source)
        return obj

    @classmethod
    def from_json_file(cls, path: str) -> "BertConfig":
        with open(path) as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(d, source=path)

    def to_dict(self) -> dict:
        d = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            d[f.name] = getattr(self, f.name)
        if self.model_type == "distilbert":
            d.update({theirs: d.pop(ours) for theirs, ours in DISTILBERT_FIELDS.items()})
            d.pop("type_vocab_size")
        if self.model_type == "electra":   # HF's ELECTRA default is 128, not hidden_size
            d["embedding_size"] = self.embedding_size or self.hidden_size
        elif self.embedding_size is None:
            d.pop("embedding_size")
        if self.id2label is None:
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
        else:
            d["id2label"] = {str(k): v for k, v in self.id2label.items()}
        d["label2id"] = {v: int(k) for k, v in d["id2label"].items()}
        if d.get("problem_type") is None:
            d.pop("problem_type", None)
        return d

    def to_json_file(self, path: str) -> None:
        write_json_atomic(path, self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **kw) -> "BertConfig":
        return dataclasses.replace(self, **kw)
