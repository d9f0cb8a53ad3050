#!/usr/bin/env python
"""The latest benchmark figures as data, and the tables of benchmarks/RESULTS.md made from them.

`benchmarks/results/<benchmark>-<machine>.json` holds one benchmark's rows on one kind of machine
(`machine_kind()`: cpu-zen4, cpu-intel-emr, gpu-h200, ...), each row keyed by some of its fields
(task, stage, shape, dtype). `record()` merges a new measurement in: a row replaces only the row
with its key, so a rerun of one task leaves the others as they were; the old figures are in git's
history. Each row names its run, whose command, machine and date the file keeps.

RESULTS.md shows them between markers, one table each:

    <!-- table:epoch machines=cpu-* rows=task,measure,target pivot=machine,dtype cell={ratio}{unit} -->
    <!-- end -->

Options (all optional): `machines=` glob patterns of machine kinds (listed ones keep their order),
`where=field:value,...`, `cols=` the columns in order, or `pivot=` fields whose values become the
columns, `rows=` the fields naming a row and `cell=` a template of field names. Values show as
stored: the benchmarks round what they record.

    python benchmarks/results.py render       # rewrite RESULTS.md's tables from the JSON files
    python benchmarks/results.py check        # exit 1 when a table and its JSON files disagree
    python benchmarks/results.py merge F...   # result files written elsewhere (a lent GPU machine)
    python benchmarks/results.py kind         # this machine's kind

The standard library and jax_tinybert.speed.cpu, which loads no JAX: benchmarks call it before JAX
starts, and tests run it without JAX.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import re
import shlex
import string
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.cpu import cpu_name, cpuinfo  # noqa: E402  (imports no JAX)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")
DOC = os.path.join(HERE, "RESULTS.md")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.]*$")
_MACHINE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
_MARKER = re.compile(r"^<!-- table:(\S+)(.*?)-->\n(.*?)^<!-- end -->$", re.M | re.S)


class ResultsError(ValueError):
    """Bad input to the results store: the message is one line naming the problem."""


# ----------------------------------------------------------------------------- machines

def _int(text: Optional[str]) -> Optional[int]:
    try:
        return int(text or "")
    except ValueError:
        return None


# Intel family 6 server models by their code names (Intel's model numbers).
_INTEL_6 = {85: "skx", 106: "icx", 108: "icx", 143: "spr", 207: "emr", 173: "gnr", 174: "gnr"}


def cpu_kind(info: Mapping[str, str]) -> str:
    """The CPU's kind from its cpuinfo fields: cpu-zen3/4/5 (AMD family 25 and 26 by model),
    cpu-intel-spr/emr/gnr/... (Intel family 6 by model), else cpu-<vendor>-f<family>m<model>."""
    vendor = info.get("vendor_id", "")
    fam, model = _int(info.get("cpu family")), _int(info.get("model"))
    if fam is None or model is None:
        return "cpu-unknown"
    if vendor == "AuthenticAMD":
        if fam == 23:
            return "cpu-zen2" if model >= 0x30 else "cpu-zen1"
        if fam == 25:
            zen4 = 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF
            return "cpu-zen4" if zen4 else "cpu-zen3"
        if fam == 26:
            return "cpu-zen5"
        return f"cpu-amd-f{fam}m{model}"
    if vendor == "GenuineIntel":
        if fam == 6 and model in _INTEL_6:
            return f"cpu-intel-{_INTEL_6[model]}"
        return f"cpu-intel-f{fam}m{model}"
    slug = re.sub(r"[^a-z0-9]+", "", vendor.lower()) or "unknown"
    return f"cpu-{slug}-f{fam}m{model}"


def accelerator_kind(device: str) -> str:
    """gpu-h200 for 'NVIDIA H200', gpu-h100 for 'NVIDIA H100 80GB HBM3', tpu-v4 for 'TPU v4'."""
    words = re.findall(r"[a-z0-9]+", device.lower())
    if words and words[0] == "tpu":
        return "tpu-" + "-".join(words[1:]) if len(words) > 1 else "tpu"
    words = [w for w in words if w not in ("nvidia", "tesla", "geforce", "amd", "instinct")]
    picked = []
    for w in words:
        picked.append(w)
        if any(c.isdigit() for c in w):
            break
    return "gpu-" + ("-".join(picked) or "unknown")


def machine_kind(device: Optional[str] = None, info: Optional[Mapping[str, str]] = None) -> str:
    """The kind of machine a figure is measured on. device: the accelerator's name (JAX's
    device_kind, nvidia-smi's name); None or 'cpu' for the CPU, read from /proc/cpuinfo.
    JTB_MACHINE_KIND overrides both (a host whose cpuinfo misnames its CPU)."""
    forced = os.environ.get("JTB_MACHINE_KIND")
    if forced:
        return forced
    if device and device.strip().lower() != "cpu":
        return accelerator_kind(device)
    return cpu_kind(cpuinfo() if info is None else info)


def gpu_name() -> Optional[str]:
    """The first GPU's name as nvidia-smi gives it ('NVIDIA H200'); None without one, or where
    JAX_PLATFORMS keeps JAX on the CPU."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    return names[0] if out.returncode == 0 and names else None


def kind_of(cpu: str, family=None, model=None, device: Optional[str] = None) -> str:
    """The kind of the machine a benchmark's JSON describes by its CPU's name, family and model
    (and its accelerator's name, if it ran on one)."""
    vendor = "AuthenticAMD" if cpu.startswith("AMD") else \
        "GenuineIntel" if cpu.startswith("Intel") else ""
    info = {"vendor_id": vendor, "cpu family": str(family), "model": str(model)}
    return machine_kind(device or "cpu", info)


def cpu_description(info: Optional[Mapping[str, str]] = None) -> str:
    """'model name (family F model M, N cores)': what a result's run records of its CPU."""
    return cpu_name(info)


def command_line(argv: Optional[Sequence[str]] = None,
                 drop: Iterable[str] = ("--json", "--record"),
                 switches: Iterable[str] = ("--record",)) -> str:
    """The command a benchmark ran as, `python benchmarks/x.py ...`, without the options that
    only say where its output went (`drop`; each with its value, but `switches` take none)."""
    argv = list(sys.argv if argv is None else argv)
    script = argv[0] if argv else "?"
    if os.path.isfile(script):
        script = os.path.relpath(os.path.abspath(script), REPO)
    out, skip = [], False
    drop, switches = tuple(drop), tuple(switches)
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a and name not in switches
            continue
        out.append(a)
    return " ".join(["python", script] + [_quote(a) for a in out])


def _quote(arg: str) -> str:
    # Placeholders such as $OFF stay readable; anything the shell would split or expand is quoted.
    return arg if re.fullmatch(r"[\w@%+=:,./$-]+", arg) else shlex.quote(arg)


def default_meta() -> dict:
    """A run's meta data when its benchmark gives none: the date (UTC), the command, the CPU."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "command": command_line(),
            "cpu": cpu_description()}


# ----------------------------------------------------------------------------- the store

def results_dir(root: Optional[str] = None) -> str:
    """Where result files live: `root`, else $JTB_RESULTS_DIR, else benchmarks/results."""
    return root or os.environ.get("JTB_RESULTS_DIR") or RESULTS_DIR


def result_path(benchmark: str, machine: str, root: Optional[str] = None) -> str:
    if not _NAME.match(benchmark):
        raise ResultsError(f"benchmark name {benchmark!r}: use lower-case letters, digits and _")
    if not _MACHINE.match(machine):
        raise ResultsError(f"machine kind {machine!r}: use lower-case letters, digits and -")
    return os.path.join(results_dir(root), f"{benchmark}-{machine}.json")


def load(path: str) -> dict:
    """A result file, checked: its rows carry their key fields and name a run it holds."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ResultsError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e})") from None
    for field in ("benchmark", "machine", "key", "runs", "rows"):
        if field not in data:
            raise ResultsError(f"{path}: no '{field}' field (not a result file)")
    name = f"{data['benchmark']}-{data['machine']}.json"
    if os.path.basename(path) != name:
        raise ResultsError(f"{path}: holds {data['benchmark']} on {data['machine']}, so its name "
                           f"must be {name}")
    runs = {r["id"] for r in data["runs"]}
    seen = set()
    for r in data["rows"]:
        k = _row_key(r, data["key"], path)
        if k in seen:
            raise ResultsError(f"{path}: two rows with the key {dict(zip(data['key'], k))}")
        seen.add(k)
        if r.get("run") not in runs:
            raise ResultsError(f"{path}: a row names run {r.get('run')!r}, which the file lacks")
    return data


def _row_key(row: Mapping, key: Sequence[str], where: str) -> tuple:
    missing = [k for k in key if k not in row]
    if missing:
        raise ResultsError(f"{where}: a row lacks its key field(s) {missing}: {dict(row)}")
    return tuple(json.dumps(row[k]) for k in key)


def _write_text(path: str, text: str) -> None:
    """`text` into `path` atomically: a temporary file beside it, then os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)   # mkstemp's 0600 would stay on the file
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write(path: str, data: dict) -> None:
    _write_text(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def record(benchmark: str, machine: str, rows: Sequence[Mapping], key: Sequence[str],
           meta: Optional[Mapping] = None, root: Optional[str] = None) -> str:
    """Merge one measurement's rows into benchmarks/results/<benchmark>-<machine>.json: each
    replaces the row with the same values of the `key` fields (in place; new keys go last),
    other rows stay. `meta` (command, cpu, date, ...; `default_meta()` fills what it lacks)
    becomes the rows' run. Values must be JSON scalars. Written atomically; returns the path."""
    path = result_path(benchmark, machine, root)
    key = list(key)
    if not key:
        raise ResultsError(f"{benchmark}: give the fields that key its rows (e.g. task, stage)")
    new: Dict[tuple, dict] = {}
    for r in rows:
        bad = {k: v for k, v in r.items()
               if not isinstance(v, (str, int, float, bool, type(None)))}
        if bad or "run" in r:
            raise ResultsError(f"{benchmark}: row values must be JSON scalars and 'run' is the "
                               f"store's own field: {bad or {'run': r['run']}}")
        k = _row_key(r, key, benchmark)
        if k in new:
            raise ResultsError(f"{benchmark}: two rows of one measurement with the key "
                               f"{dict(zip(key, k))}")
        new[k] = dict(r)
    if not new:
        raise ResultsError(f"{benchmark}: no rows to record")
    if os.path.exists(path):
        data = load(path)
        if data["key"] != key:
            raise ResultsError(f"{path} keys its rows by {data['key']}, this record by {key}")
    else:
        data = {"benchmark": benchmark, "machine": machine, "key": key, "runs": [], "rows": []}
    run = max((r["id"] for r in data["runs"]), default=0) + 1
    for r in new.values():
        r["run"] = run
    out = []
    for r in data["rows"]:
        k = _row_key(r, key, path)
        out.append(new.pop(k) if k in new else r)
    out.extend(new.values())
    used = {r["run"] for r in out}
    info = {k: v for k, v in dict(default_meta(), **(meta or {})).items() if k != "id"}
    data["runs"] = [r for r in data["runs"] if r["id"] in used] + [dict(id=run, **info)]
    data["rows"] = out
    _write(path, data)
    return path


def merge(paths: Sequence[str], root: Optional[str] = None) -> List[str]:
    """Record the runs of result files written elsewhere into this store, run by run, oldest
    first: each row replaces the row with its key. Returns the files written."""
    written = []
    for p in paths:
        src = load(p)
        for run in src["runs"]:
            rows = [{k: v for k, v in r.items() if k != "run"} for r in src["rows"]
                    if r["run"] == run["id"]]
            if rows:
                written.append(record(src["benchmark"], src["machine"], rows, src["key"],
                                      meta=run, root=root))
    return sorted(set(written))


def load_all(root: Optional[str] = None) -> Dict[str, List[dict]]:
    """{benchmark: [its files' data, by machine kind]} of every result file."""
    d = results_dir(root)
    out: Dict[str, List[dict]] = {}
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith(".json"):
            data = load(os.path.join(d, name))
            out.setdefault(data["benchmark"], []).append(data)
    return out


# ----------------------------------------------------------------------------- tables

def show(v) -> str:
    """A value as a table shows it: as stored, booleans as yes / no, None as nothing."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        s = repr(v)
        return f"{v:.12f}".rstrip("0").rstrip(".") if "e" in s else s
    return str(v).replace("|", "\\|")


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_options(text: str, where: str = "marker") -> Dict[str, str]:
    """A marker's `key=value` options (shell quoting for values with spaces)."""
    allowed = ("machines", "where", "order", "cols", "pivot", "rows", "cell")
    out = {}
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ResultsError(f"{where}: {e}") from None
    for w in words:
        k, eq, v = w.partition("=")
        if not eq or k not in allowed:
            raise ResultsError(f"{where}: option {w!r}; expected KEY=VALUE with KEY in {allowed}")
        out[k] = v
    if "pivot" in out and "cols" in out:
        raise ResultsError(f"{where}: give cols= or pivot=, not both")
    if ("rows" in out or "cell" in out) and "pivot" not in out:
        raise ResultsError(f"{where}: rows= and cell= go with pivot=")
    return out


def _selected(files: List[dict], opts: Mapping[str, str]) -> List[dict]:
    pats = [p for p in opts.get("machines", "*").split(",") if p]

    def rank(data):
        for i, p in enumerate(pats):
            if fnmatch.fnmatchcase(data["machine"], p):
                return i
        return None

    picked = [f for f in files if rank(f) is not None]
    picked.sort(key=lambda f: (rank(f), f["machine"]))
    where = [w.partition(":") for w in opts.get("where", "").split(",") if w]
    rows = []
    for f in picked:
        runs = {r["id"]: r for r in f["runs"]}
        for r in f["rows"]:
            if all(show(r.get(k)) == v for k, _, v in where):
                rows.append(dict(r, machine=f["machine"], _run=runs[r["run"]]))
    # order=field:a/b/...: within each machine, rows with those values first and in that order
    # (a stable sort), so that a table does not follow the order its rows were recorded in.
    orders = []
    for spec in (o for o in opts.get("order", "").split(",") if o):
        field, _, values = spec.partition(":")
        orders.append((field, {v: i for i, v in enumerate(values.split("/"))}))
    mrank = {f["machine"]: i for i, f in enumerate(picked)}
    rows.sort(key=lambda r: [mrank[r["machine"]]] + [rank.get(show(r.get(field)), len(rank))
                                                      for field, rank in orders])
    return rows


def _run_label(row: Mapping) -> str:
    return f"{row['machine']}#{row['run']}"


def _table(header: List[str], body: List[List[str]], numeric: List[bool]) -> List[str]:
    lines = ["| " + " | ".join(h.replace("_", " ") for h in header) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def _runs_list(rows: List[dict]) -> List[str]:
    seen: Dict[str, dict] = {}
    for r in rows:
        seen.setdefault(_run_label(r), r["_run"])
    out = ["", "Runs:"]
    for label, run in seen.items():
        where = ", ".join(str(run[k]) for k in ("cpu", "device") if run.get(k))
        note = f" {run['note']}" if run.get("note") else ""
        out.append(f"- {label}: {run.get('date', '?')}; {where}; `{run.get('command', '?')}`."
                   f"{note}")
    return out


def render_table(name: str, files: List[dict], opts: Mapping[str, str]) -> str:
    """The markdown a marker `<!-- table:name ... -->` holds: the table and its runs."""
    if not files:
        raise ResultsError(f"table {name}: no result files benchmarks/results/{name}-*.json")
    rows = _selected(files, opts)
    if not rows:
        raise ResultsError(f"table {name}: no rows match {dict(opts)}")
    key = files[0]["key"]
    if "pivot" in opts:
        piv = [p for p in opts["pivot"].split(",") if p]
        label = [p for p in opts.get("rows", "").split(",") if p] or \
            [k for k in key if k not in piv]
        cell = opts.get("cell") or "{" + next(
            k for k in rows[0] if k not in key + piv + ["run", "_run", "machine"]) + "}"
        fields = [f for _, f, _, _ in string.Formatter().parse(cell) if f]
        cols: List[tuple] = []
        grid: Dict[tuple, Dict[tuple, str]] = {}
        for r in rows:
            c = tuple(show(r.get(p)) for p in piv)
            if c not in cols:
                cols.append(c)
            line = grid.setdefault(tuple(show(r.get(f)) for f in label), {})
            if c in line:
                raise ResultsError(f"table {name}: two rows for {dict(zip(label, line))} under "
                                   f"{c}; add a field to rows= or pivot=")
            ok = all(r.get(f) is not None for f in fields)
            line[c] = cell.format(**{f: show(r.get(f)) for f in fields}) if ok else ""
        header = label + [" ".join(c) for c in cols]
        body = [list(k) + [v.get(c, "") for c in cols] for k, v in grid.items()]
        numeric = [False] * len(label) + [True] * len(cols)
    else:
        cols_f = [c for c in opts.get("cols", "").split(",") if c]
        if not cols_f:
            cols_f = ["machine"] + key
            for r in rows:
                cols_f += [k for k in r if k not in cols_f and k not in ("run", "_run")]
            cols_f.append("run")
        body = [[_run_label(r) if c == "run" else show(r.get(c)) for c in cols_f] for r in rows]
        numeric = [c != "run" and all(_numeric(r.get(c)) or r.get(c) is None for r in rows)
                   and any(_numeric(r.get(c)) for r in rows) for c in cols_f]
        header = cols_f
    return "\n".join(_table(header, body, numeric) + _runs_list(rows))


def render_doc(text: str, root: Optional[str] = None) -> str:
    """`text` with every marked table rendered again from the result files."""
    files = load_all(root)

    def one(m):
        name = m.group(1)
        opts = parse_options(m.group(2), f"table:{name}")
        body = render_table(name, files.get(name, []), opts)
        return f"<!-- table:{name}{m.group(2)}-->\n{body}\n<!-- end -->"

    return _MARKER.sub(one, text)


def check_doc(text: str, root: Optional[str] = None) -> List[str]:
    """What disagrees between a document's tables and the result files (empty: all agree):
    a table that renders otherwise, a result file no table shows."""
    problems = []
    files = load_all(root)
    shown = set()
    for m in _MARKER.finditer(text):
        name = m.group(1)
        try:
            opts = parse_options(m.group(2), f"table:{name}")
            want = render_table(name, files.get(name, []), opts)
        except ResultsError as e:
            problems.append(str(e))
            continue
        shown.add(name)
        have = m.group(3).rstrip("\n")
        if have != want:
            diff = next((f"{a!r} should read {b!r}" for a, b in
                         zip(have.splitlines() + [""] * 999, want.splitlines() + [""] * 999)
                         if a != b), "")
            problems.append(f"table {name}: differs from its JSON files ({diff}); run "
                            "`python benchmarks/results.py render`")
    for name, datas in files.items():
        if name not in shown:
            problems += [f"benchmarks/results/{name}-{d['machine']}.json: no table of "
                         f"RESULTS.md shows it (add <!-- table:{name} --> ... <!-- end -->)"
                         for d in datas]
    return problems


# ----------------------------------------------------------------------------- command line

def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("render", "check", "merge", "kind"))
    p.add_argument("files", nargs="*", help="merge: the result files to merge")
    p.add_argument("--doc", default=DOC, help="the markdown file with the tables")
    p.add_argument("--results", default=None, help="the result files' folder")
    args = p.parse_args(argv)
    try:
        if args.command == "kind":
            print(machine_kind())
            return 0
        if args.command == "merge":
            if not args.files:
                p.error("merge: name the result files to merge")
            for path in merge(args.files, args.results):
                print(f"recorded {os.path.relpath(path)}")
            return 0
        with open(args.doc) as fh:
            text = fh.read()
        if args.command == "render":
            new = render_doc(text, args.results)
            if new != text:
                _write_text(args.doc, new)
                print(f"rendered {os.path.relpath(args.doc)}")
            problems = check_doc(new, args.results)
        else:
            problems = check_doc(text, args.results)
    except (ResultsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0



if __name__ == "__main__":
    sys.exit(main())
