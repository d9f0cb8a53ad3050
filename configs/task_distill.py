"""Task distillation (TinyBERT stage 2): first the intermediate layers, then the prediction layer.

    # 1. intermediate layers (L_embd + L_attn + L_hidn) from the general student
    python -m jax_tinybert.main --config=configs/task_distill.py:sst2_intermediate \
        --workdir=runs/sst2/inter --config.teacher.path=runs/sst2/teacher/export \
        --config.student.path=runs/general/export
    # 2. prediction layer (soft cross-entropy to the teacher's logits, teacher cached)
    python -m jax_tinybert.main --config=configs/task_distill.py:sst2_pred \
        --workdir=runs/sst2/pred --config.teacher.path=runs/sst2/teacher/export \
        --config.student.path=runs/sst2/inter/export

Variants: "<task>_intermediate" / "<task>_pred" for every GLUE task (sst2, mrpc, stsb, cola, qqp,
mnli, qnli, rte, wnli) and squad11, squad20, conll2003 (docs/tasks.md). Official recipe: batch 32, length 64 (single sentence) / 128 (pairs);
intermediate lr 5e-5 constant, ~10-20 epochs on augmented data (--config.data.train_file=
.../train_aug.tsv); pred lr 3e-5, warmup 10% + linear decay, 3 epochs, T = 1.
`--config.objective.mode=tinybert --config.optim.name=bertadam` reproduces the official code.
In the intermediate stage `--config.objective.name=minilm` / `minilmv2` distils MiniLM's
self-attention relations instead (docs/losses.md#minilm-and-minilmv2).
"""
from jax_tinybert.config.schema import base_config, parse_variant, task_lengths


def get_config(arg: str = "sst2_intermediate"):
    task, phase = parse_variant(arg, "configs/task_distill.py", default="sst2_intermediate",
                                suffixes=("intermediate", "pred"), suffix_required=True)
    c = base_config()
    c.stage = "task_distill"
    c.data.task = task
    c.data.max_len, c.data.buckets = task_lengths(task)
    c.student.init = "pretrained"
    c.train.batch_size = 32
    if phase == "intermediate":
        c.objective.name = "tinybert_intermediate"
        c.optim.learning_rate = 5e-5
        c.optim.schedule = "constant"
        c.optim.warmup_ratio = 0.0
        c.train.num_epochs = 10.0
    else:
        c.objective.name = "tinybert_pred"   # T = 1: the objective's default, as official
        c.optim.learning_rate = 3e-5
        c.optim.schedule = "warmup_linear"
        c.optim.warmup_ratio = 0.1
        c.train.num_epochs = 3.0
    return c
