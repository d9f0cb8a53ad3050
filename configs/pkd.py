"""Patient Knowledge Distillation (Sun et al. 2019): the student starts from the teacher's first
k layers and learns (1 - alpha) CE + alpha KD(T) + beta * patience on the [CLS] vectors.

    python -m jax_tinybert.main --config=configs/pkd.py:sst2 --workdir=runs/sst2/pkd \
        --config.teacher.path=runs/sst2/teacher/export

Variants: "<task>" (PKD-Skip, default) or "<task>_last" (PKD-Last). Published recipe: alpha 0.7,
T 10, beta 500 (for the official mean over B*K*D), lr 1e-5, 4 epochs; student = the teacher's
first `student.teacher_layers` layers (default: the first half of the teacher's layers).

T, alpha, t2 and projection are the pkd objective's defaults (jax_tinybert/distill/objectives.py, class
PKD). beta: the clean (masked) patience loss is the paper's sum over the K mapped layers and D
units, the official code's (mode=tinybert) a mean over them, so the published 500 becomes
500 / (K * D) here: K = 2 patience layers (student layers 1..2 of 3), D = 384 (MiniLM-L6), i.e.
0.651. With another teacher pass --config.objective.beta=500/(K*D) for its K and D; with
--config.objective.mode=tinybert pass --config.objective.beta=500. (Left at None, the objective
computes the same from the models' shapes.)
"""
from jax_tinybert.config.schema import base_config, parse_variant, task_lengths

PKD_BETA_TINYBERT = 500.0   # the published beta, for the official mean over B*K*D
PATIENCE_LAYERS = 2         # pkd_skip with a 3-layer student: student layers 1, 2
TEACHER_WIDTH = 384         # the packaged all-MiniLM-L6-v2


def get_config(arg: str = "sst2"):
    task, last = parse_variant(arg, "configs/pkd.py", default="sst2", suffixes=("last",))
    c = base_config()
    c.stage = "pkd"
    c.data.task = task
    c.data.max_len, c.data.buckets = task_lengths(task)
    # T, alpha, t2, projection: the pkd objective's own defaults (objectives.PKD).
    c.objective.name = "pkd"
    c.objective.beta = PKD_BETA_TINYBERT / (PATIENCE_LAYERS * TEACHER_WIDTH)
    c.objective.layer_map = "pkd_last" if last else "pkd_skip"
    c.student.init = "teacher_layers"
    c.student.teacher_layers = (1, 2, 3)   # first half of the 6-layer packaged teacher
    c.optim.learning_rate = 1e-5
    c.train.num_epochs = 4.0
    c.train.batch_size = 32
    return c
