"""Documents of a general-distillation corpus, from local files or a Hugging Face dataset.

A document is a list of non-empty, stripped lines (its sentences), in reading order:

    plain text (.txt, WikiExtractor's extensionless wiki_NN, .gz/.bz2 of them): mode="sentences"
        one sentence per line, a blank line or a file end ends a document; mode="documents"
        one document per line. WikiExtractor's `<doc ...>` / `</doc>` lines end a document and
        are not text.
    .jsonl (and .gz/.bz2): one document per record, its `text_field` (lines split on "\\n").
    gs://bucket/prefix or a glob: the same files in a bucket (through jax_tinybert.fs).
    hf:NAME_OR_PATH[?name=..&split=..&data_files=a,b&data_dir=..&revision=..&streaming=1]:
        `datasets.load_dataset(...)`, one document per row, its `text_field`.
    tfds:NAME[/CONFIG][:VERSION][?split=..&data_dir=..]: `tfds.load(...)`, one document per
        example, its `text_field` (bytes decoded as UTF-8).

A folder is read recursively in sorted order of its relative paths; sources in the order given.
`identity` describes the content (sha256 of each file's bytes, relative names), never absolute
paths or mtimes: a moved or touched corpus is the same corpus.
"""
from __future__ import annotations

import bz2
import gzip
import json
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

from jax_tinybert import fs
from jax_tinybert.data import tokenize
from jax_tinybert.errors import PathError, UserError

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open}
# WikiExtractor names its output files wiki_00, wiki_01, ... (no extension).
WIKIEXTRACTOR_NAME = re.compile(r"^wiki_\d+$")
_DOC_TAG = re.compile(r"^(<doc\b[^>]*>|</doc>)$")


class SourceError(UserError, ValueError):
    """A corpus source that cannot be read as documents (no files, a missing field, bad JSON)."""


@dataclass
class LocalFile:
    path: str          # as found (absolute or relative to the working folder), or a gs:// URL
    name: str          # relative to its source root: the part of the identity that is a name
    kind: str          # "text" | "jsonl"
    size: int = 0
    digest: str = ""   # a bucket object's own content hash ("crc32c:..."), so none is computed


@dataclass
class Source:
    """One --source: local or bucket files (a file, a folder, a glob), a Hugging Face dataset
    or a TFDS dataset."""
    spec: str
    files: List[LocalFile] = field(default_factory=list)
    hf: Optional[Dict] = None    # load_dataset arguments for an hf: source
    tfds: Optional[Dict] = None  # tfds.load arguments for a tfds: source

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _kind(name: str) -> Optional[str]:
    base = name
    for ext in COMPRESSED:
        if base.endswith(ext):
            base = base[:-len(ext)]
    if base.endswith(TEXT_SUFFIXES) or WIKIEXTRACTOR_NAME.match(os.path.basename(base)):
        return "text"
    if base.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def parse_hf(spec: str) -> Dict:
    """'hf:PATH?key=value&...' -> load_dataset arguments (split default 'train')."""
    rest = spec[len("hf:"):]
    path, _, query = rest.partition("?")
    if not path:
        raise SourceError(f"--source {spec!r}: name a dataset, e.g. hf:wikipedia?name=20220301.en")
    args: Dict = {"path": path, "split": "train", "streaming": False}
    for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if k == "streaming":
            args[k] = v.lower() in ("1", "true", "yes")
        elif k == "data_files":
            args[k] = [x for x in v.split(",") if x]
        elif k in ("name", "split", "data_dir", "revision"):
            args[k] = v
        else:
            raise SourceError(f"--source {spec!r}: unknown option {k!r} (name, split, data_files, "
                              "data_dir, revision, streaming)")
    return args


def parse_tfds(spec: str) -> Dict:
    """'tfds:NAME[/CONFIG][:VERSION]?split=..&data_dir=..' -> tfds.load arguments."""
    name, _, query = spec[len("tfds:"):].partition("?")
    if not name:
        raise SourceError(f"--source {spec!r}: name a dataset, e.g. tfds:wikipedia/20230601.en")
    args: Dict = {"name": name, "split": "train"}
    for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if k not in ("split", "data_dir"):
            raise SourceError(f"--source {spec!r}: unknown option {k!r} (split, data_dir)")
        args[k] = v
    return args


def resolve(specs: Sequence[str]) -> List[Source]:
    """--source values -> Sources with their files listed (sorted, recursive). Raises PathError
    for a path that does not exist and SourceError for a folder without readable files."""
    out = []
    for spec in specs:
        if spec.startswith("hf:"):
            out.append(Source(spec, hf=parse_hf(spec)))
            continue
        if spec.startswith("tfds:"):
            out.append(Source(spec, tfds=parse_tfds(spec)))
            continue
        if fs.is_remote(spec):
            out.append(Source(spec, _remote_files(spec)))
            continue
        p = os.path.expanduser(spec)
        if os.path.isfile(p):
            kind = _kind(os.path.basename(p)) or "text"   # a named file is text unless .jsonl
            files = [LocalFile(p, os.path.basename(p), kind)]
        elif os.path.isdir(p):
            files = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for n in sorted(names):
                    kind = _kind(n)
                    if kind:
                        full = os.path.join(root, n)
                        files.append(LocalFile(full, os.path.relpath(full, p), kind))
            files.sort(key=lambda f: f.name)
            if not files:
                raise SourceError(f"--source {spec}: no .txt, .jsonl or wiki_NN files (or .gz/.bz2 "
                                  "of them) in this folder or below")
        else:
            raise PathError(f"--source {spec}: no such file or folder (relative to {os.getcwd()})")
        for f in files:
            f.size = os.path.getsize(f.path)
        out.append(Source(spec, files))
    return out


def _remote_files(spec: str) -> List[LocalFile]:
    """The corpus files of a bucket URL: a prefix (read recursively) or a glob (* ? [ ])."""
    fsys, p = fs.url_fs(spec)
    scheme = spec.split("://", 1)[0]
    try:
        found = fsys.glob(p, detail=True) if any(c in p for c in "*?[") else \
            fsys.find(p, detail=True)
    except (OSError, ValueError) as e:
        raise PathError(f"--source {spec}: cannot list it ({type(e).__name__}: {e})") from None
    root = p.split("*")[0].split("?")[0].split("[")[0].rstrip("/")
    root = root if not found.get(root) or found[root].get("type") != "file" else \
        root.rsplit("/", 1)[0]
    files = []
    for obj, info in sorted(found.items()):
        if info.get("type", "file") != "file" or not _kind(obj):
            continue
        digest = info.get("crc32c") or info.get("md5Hash") or ""
        kind = "crc32c" if info.get("crc32c") else "md5"
        files.append(LocalFile(f"{scheme}://{obj}", obj[len(root):].lstrip("/") or obj,
                               _kind(obj), int(info.get("size", 0)),
                               f"{kind}:{digest}" if digest else ""))
    if not files:
        raise SourceError(f"--source {spec}: no .txt, .jsonl or wiki_NN objects (or .gz/.bz2 "
                          "of them) there")
    return files


def identity(sources: Sequence[Source], hints: Optional[Dict[str, Dict]] = None) -> List[Dict]:
    """Content identity of the sources: per file its relative name, size and sha256. `hints`
    (a previous manifest's `stat_hints`: real path -> size, mtime_ns, sha256) skip hashing a
    file whose path, size and mtime are unchanged, so a rerun on the same files is instant."""
    hints = hints or {}
    out = []
    for s in sources:
        files = list(s.files)
        if s.hf is not None:
            files = _hf_local_files(s.hf)
        entries = []
        for f in files:
            if fs.is_remote(f.path):    # the bucket's own hash of the object, or its bytes'
                entries.append({"name": f.name, "size": f.size, "digest": f.digest} if f.digest
                               else {"name": f.name, "size": f.size,
                                     "sha256": tokenize.file_fingerprint(f.path)})
                continue
            st = os.stat(f.path)
            hint = hints.get(os.path.realpath(f.path))
            if hint and hint["size"] == st.st_size and hint["mtime_ns"] == st.st_mtime_ns:
                digest = hint["sha256"]
            else:
                digest = tokenize.file_fingerprint(f.path)
            entries.append({"name": f.name, "size": st.st_size, "sha256": digest})
        item = {"files": entries}
        if s.tfds is not None:   # name/config:version and split name a prepared TFDS dataset
            item["tfds"] = {k: v for k, v in s.tfds.items() if k != "data_dir"}
        if s.hf is not None:   # the hub's name/config/split/revision name a hub dataset
            a = s.hf
            item["hf"] = {k: a[k] for k in ("name", "split", "revision") if k in a}
            if not os.path.exists(a["path"]):
                item["hf"]["path"] = a["path"]
        out.append(item)
    return out


def stat_hints(sources: Sequence[Source], ident: Sequence[Dict]) -> Dict[str, Dict]:
    """real path -> size, mtime_ns, sha256 of every local file (a manifest keeps them to make
    a rerun's `identity` instant; they are not part of the key)."""
    out = {}
    for s, item in zip(sources, ident):
        files = s.files if s.hf is None else _hf_local_files(s.hf)
        for f, e in zip(files, item["files"]):
            if fs.is_remote(f.path):
                continue
            st = os.stat(f.path)
            out[os.path.realpath(f.path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                             "sha256": e["sha256"]}
    return out


def _hf_local_files(args: Dict) -> List[LocalFile]:
    """The local files an hf: source reads (its data_files, or every file of a local folder)."""
    import glob

    out = []
    base = args["path"] if os.path.isdir(args["path"]) else ""
    for pattern in args.get("data_files") or []:
        full = pattern if os.path.isabs(pattern) or not base else os.path.join(base, pattern)
        for p in sorted(glob.glob(full)):
            out.append(LocalFile(p, os.path.basename(p), "hf"))
    if not out and base:
        for root, dirs, names in os.walk(base):
            dirs.sort()
            for n in sorted(names):
                if not n.startswith("."):
                    full = os.path.join(root, n)
                    out.append(LocalFile(full, os.path.relpath(full, base), "hf"))
    elif not out and os.path.isfile(args["path"]):
        out.append(LocalFile(args["path"], os.path.basename(args["path"]), "hf"))
    return out


# ----------------------------------------------------------------------------- reading

class _Counter:
    """Bytes of the local files read so far (compressed bytes for .gz/.bz2), for progress."""

    def __init__(self):
        self.done = 0
        self.raw = None

    @property
    def position(self) -> int:
        return self.done + (self.raw.tell() if self.raw is not None and not self.raw.closed else 0)


def _decompressed(f: LocalFile, raw):
    for ext, opener in COMPRESSED.items():
        if f.path.endswith(ext):
            return opener(raw, "rb")
    return raw


def _text_documents(fh, mode: str) -> Iterator[List[str]]:
    doc: List[str] = []
    first = True
    for raw in fh:
        text = raw.decode("utf-8", errors="replace")
        if first:
            first = False
            if text.startswith("\ufeff"):
                text = text[1:]
        text = text.strip()
        if not text or (text[0] == "<" and _DOC_TAG.match(text)):
            if doc:
                yield doc
                doc = []
        elif mode == "documents":
            yield [text]
        else:
            doc.append(text)
    if doc:
        yield doc


def _lines(text, where: str) -> List[str]:
    if not isinstance(text, str):
        raise SourceError(f"{where}: the text field holds {type(text).__name__}, not text")
    return [s for s in (x.strip() for x in text.split("\n")) if s]


def _jsonl_documents(fh, path: str, text_field: str) -> Iterator[List[str]]:
    for lineno, raw in enumerate(fh, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError as e:
            raise SourceError(f"{path}:{lineno}: not a JSON record ({e})") from None
        if not isinstance(rec, dict) or text_field not in rec:
            raise _no_field(f"{path}:{lineno}", text_field,
                            list(rec) if isinstance(rec, dict) else [type(rec).__name__])
        lines = _lines(rec[text_field], f"{path}:{lineno}")
        if lines:
            yield lines


def _no_field(where: str, text_field: str, have) -> SourceError:
    """The one-line error for a record or dataset without the text field."""
    return SourceError(f"{where}: no field {text_field!r} (it has: {', '.join(map(str, have))}); "
                       "pass --text_field NAME")


def _hf_documents(args: Dict, text_field: str, spec: str) -> Iterator[List[str]]:
    try:
        import datasets
    except ImportError:
        raise SourceError(f"--source {spec}: needs the `datasets` package: pip install datasets "
                          "(or pip install 'jax-tinybert[hub]')") from None
    kw = {k: v for k, v in args.items() if k != "path"}
    try:
        ds = datasets.load_dataset(args["path"], **kw)
    except (FileNotFoundError, ValueError) as e:
        raise SourceError(f"--source {spec}: {type(e).__name__}: {e}") from None
    names = ds.column_names
    if names is not None and text_field not in names:
        raise _no_field(f"--source {spec}", text_field, names)
    row = 0
    for batch in ds.iter(batch_size=1024):
        if text_field not in batch:
            raise _no_field(f"--source {spec}: row {row}", text_field, list(batch))
        for text in batch[text_field]:
            lines = _lines(text or "", f"{spec} row {row}")
            row += 1
            if lines:
                yield lines


def _tfds_documents(args: Dict, text_field: str, spec: str) -> Iterator[List[str]]:
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise SourceError(f"--source {spec}: needs tensorflow-datasets (and tensorflow): pip "
                          "install tensorflow-datasets") from None
    try:
        ds = tfds.load(args["name"], split=args["split"], data_dir=args.get("data_dir"),
                       shuffle_files=False)
    except Exception as e:   # TFDS raises its own types for a missing or unbuilt dataset
        raise SourceError(f"--source {spec}: {type(e).__name__}: {e}") from None
    for row, ex in enumerate(tfds.as_numpy(ds)):
        if text_field not in ex:
            raise SourceError(f"--source {spec}: row {row}: no field {text_field!r} (it has: "
                              f"{', '.join(ex)}); pass --text_field NAME")
        text = ex[text_field]
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        lines = _lines(text, f"{spec} row {row}")
        if lines:
            yield lines


def documents(sources: Sequence[Source], mode: str = "sentences", text_field: str = "text",
              counter: Optional[_Counter] = None) -> Iterator[List[str]]:
    """Every document of the sources in order: lists of non-empty stripped lines (module
    docstring). `counter.position`: local bytes read so far."""
    if mode not in ("sentences", "documents"):
        raise ValueError(f"mode must be 'sentences' or 'documents', got {mode!r}")
    counter = counter or _Counter()
    for s in sources:
        if s.hf is not None:
            yield from _hf_documents(s.hf, text_field, s.spec)
            continue
        if s.tfds is not None:
            yield from _tfds_documents(s.tfds, text_field, s.spec)
            continue
        for f in s.files:
            with fs.open_file(f.path, "rb") as raw, _decompressed(f, raw) as fh:
                counter.raw = raw
                if f.kind == "jsonl":
                    yield from _jsonl_documents(fh, f.path, text_field)
                else:
                    yield from _text_documents(fh, mode)
            counter.done += f.size
            counter.raw = None
