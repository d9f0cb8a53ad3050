"""Fine-tune the teacher on a GLUE task (the task teacher of task distillation / PKD).

    python -m jax_tinybert.main --config=configs/finetune_teacher.py:sst2 --workdir=runs/sst2/teacher

Variants: any GLUE task name (sst2, mrpc, stsb, cola, qqp, mnli, qnli, rte, wnli), or squad11,
squad20, conll2003 with --config.data.data_dir=DIR (docs/tasks.md). The teacher
starts from `teacher.path` (default: the packaged all-MiniLM-L6-v2; e.g. bert-base-uncased when
online) and the fine-tuned model is exported to <workdir>/export. Data: $GLUE_DIR/<TASK>/*.tsv.
"""
from jax_tinybert.config.schema import base_config, parse_variant, task_lengths


def get_config(arg: str = "sst2"):
    task, _ = parse_variant(arg, "configs/finetune_teacher.py", default="sst2")
    c = base_config()
    c.stage = "finetune_teacher"
    c.objective.name = "finetune"
    c.student.init = "pretrained"
    c.student.path = ""            # = teacher.path
    c.data.task = task
    c.data.max_len, c.data.buckets = task_lengths(c.data.task)
    c.optim.learning_rate = 5e-5 if c.data.task.lower() != "stsb" else 4e-5
    c.train.num_epochs = 3.0
    c.train.batch_size = 32
    c.teacher.cache = False
    return c
