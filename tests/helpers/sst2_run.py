"""tests/test_train_sst2.py's real run, in a process of its own: `python sst2_run.py ROOT GLUE_DIR`.

Fine-tunes the packaged MiniLM teacher on an SST-2 subset, then task-distils a small random
student (intermediate layers, then the prediction layer from the cached teacher). Each stage
writes ROOT/<stage>/summary.json; ROOT/pred_cache_log.json holds what the teacher cache logged
(INFO and up) during the prediction stage. Its own process so that it compiles with the caller's
XLA_FLAGS, as a user's run does (the test processes use XLA's cheapest backend optimisation,
under which this run's steps take 1.6x as long).
"""
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import run_files  # noqa: E402
from jax_tinybert.train import loop as train  # noqa: E402


class _Lines(logging.Handler):
    """Keeps the messages logged (INFO and up) while it is attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(root: str, glue_dir: str) -> None:
    cfg = run_files.config
    # The teacher's buckets (16, 32, 64) pad its 8,000 examples to 22.4 tokens per example
    # against 33.9 with (32, 64): a third less work for one more compilation per step function.
    # The student's steps are cheap (2 layers, teacher cached) and compiling is most of its
    # stages: two buckets, one fewer compilation each of the teacher's forward, the gradient
    # and the eval step.
    common = dict(glue_dir=glue_dir, max_len=64)
    small = dict(common, train_subset=2000, buckets=(32, 64))

    t = cfg("finetune_teacher.py", "sst2")
    t.data.update(common, train_subset=8000, buckets=(16, 32, 64))
    t.train.update(num_steps=120, eval_every=120, log_every=20, checkpoint_every=1000)
    t.optim.learning_rate = 1e-4
    train.train_and_evaluate(t, os.path.join(root, "teacher"))

    student = dict(init="random", num_hidden_layers=2, hidden_size=192, intermediate_size=768,
                   num_attention_heads=12)
    # 150 steps of 32 are 2.4 epochs of the 2,000 examples: the teacher's hidden states and
    # attention scores are cached (train.py's auto rule, the recipe's 10-20 epochs), and the
    # cache build publishes the teacher's logits to the teacher store (tests/conftest.py: the
    # session's own) for the prediction stage.
    i = cfg("task_distill.py", "sst2_intermediate")
    i.data.update(small)
    i.teacher.path = os.path.join(root, "teacher", "export")
    i.student.update(student)
    i.optim.learning_rate = 3e-4
    i.train.update(num_steps=150, log_every=10, checkpoint_every=1000)
    train.train_and_evaluate(i, os.path.join(root, "inter"))

    p = cfg("task_distill.py", "sst2_pred")
    p.data.update(small)
    p.teacher.path = os.path.join(root, "teacher", "export")
    p.student.path = os.path.join(root, "inter", "export")
    p.optim.learning_rate = 3e-4
    p.train.update(num_steps=200, eval_every=100, log_every=10, checkpoint_every=1000)
    said = _Lines()
    log = logging.getLogger("jax_tinybert.teacher")   # cache.py and training.py
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:
        train.train_and_evaluate(p, os.path.join(root, "pred"))
    finally:
        log.removeHandler(said)
    with open(os.path.join(root, "pred_cache_log.json"), "w") as fh:
        json.dump(said.lines, fh)


if __name__ == "__main__":
    main(*sys.argv[1:3])
