"""General distillation: a random student learns the pre-trained teacher's attention and hidden
states on unlabelled text (TinyBERT stage 1; L_embd + sum_m (L_attn + L_hidn)).

    python -m jax_tinybert.main --config=configs/general_distill.py --workdir=runs/general \
        --config.data.corpus=../shared/data/corpus

Variants: "small" (default: 3/384/1536/12, half the packaged 6-layer MiniLM teacher),
"tinybert4" (4 layers, d 312, d_ff 1200, 12 heads) and "tinybert6" (6/768/3072/12) for a
12-layer teacher such as `--config.teacher.path=bert-base-uncased` (the uniform layer map
pairs student layer m with teacher layer round(m N / M): tinybert4 under the 6-layer teacher
gets 0:0,1:2,2:3,3:5,4:6; other pairs: --config.objective.layer_map=0:0,1:2,2:3,3:5,4:6), and
"tiny" (2/32/64/4: checks a pipeline's wiring in seconds; it learns little). Official
recipe: batch 256, lr 1e-4, length 128, 3 epochs; `--config.objective.mode=tinybert` gives the
official reductions (the maintainers' trace: attention 28.8 -> 7.7, hidden 2.0 -> 1.1).
MiniLM instead: `--config.objective.name=minilm` (the teacher's head count) or `minilmv2` (any
head count; `--config.objective.relation_heads`, `--config.objective.teacher_layer`;
docs/losses.md#minilm-and-minilmv2).
"""
from jax_tinybert.config.schema import base_config, parse_variant

SHAPES = {"tinybert4": (4, 312, 1200, 12), "tinybert6": (6, 768, 3072, 12),
          "small": (3, 384, 1536, 12), "tiny": (2, 32, 64, 4)}


def get_config(arg: str = "small"):
    c = base_config()
    c.stage = "general_distill"
    c.objective.name = "tinybert_intermediate"
    c.data.kind = "corpus"
    c.data.corpus = ""
    c.data.seq_len = 128
    c.student.init = "random"
    shape, _ = parse_variant(arg, "configs/general_distill.py", default="small", names=SHAPES)
    (c.student.num_hidden_layers, c.student.hidden_size, c.student.intermediate_size,
     c.student.num_attention_heads) = SHAPES[shape]
    c.optim.learning_rate = 1e-4
    c.optim.schedule = "warmup_linear"
    c.train.batch_size = 256
    c.train.num_epochs = 3.0
    c.train.checkpoint_every = 1000
    return c
