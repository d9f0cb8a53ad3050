"""What the engine tests read: a config from configs/ and the records of a run's metrics.jsonl."""
import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(module: str, arg: str = ""):
    """configs/<module>'s get_config(arg), e.g. config("task_distill.py", "sst2_pred")."""
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(REPO, "configs", module))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def records(workdir, prefix: str) -> list:
    """The metrics.jsonl records of `workdir` with a key under `prefix/` (e.g. "train")."""
    out = []
    with open(os.path.join(workdir, "metrics.jsonl")) as fh:
        for line in fh:
            r = json.loads(line)
            if any(k.startswith(prefix + "/") for k in r):
                out.append(r)
    return out
