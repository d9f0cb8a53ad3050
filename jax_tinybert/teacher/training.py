"""The teacher cache of a training run: which rows its steps read, the pass over them (in the
steps' order, in row chunks, or packed several examples to a row), and its fingerprint.

    cache = build_for_training(models, objective, data, workdir, num_steps=total)
    batch.update(cache.lookup(batch["example_id"], seq_len=T))
"""
from __future__ import annotations

import json
import logging
import tempfile
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_tinybert import fs, speed
from jax_tinybert.config.check import ConfigValueError
from jax_tinybert.data import batching, packing, tokenize
from jax_tinybert.parallel import coordination
from jax_tinybert.teacher import cache as teacher_cache, positions, split as split_lib
from jax_tinybert.teacher.cache import META, MODEL_KEYS, TeacherCache
from jax_tinybert.teacher.fingerprint import (_normalise, arrays_fingerprint, dataset_fingerprint,
                                              params_fingerprint)

log = logging.getLogger(__name__)

# Examples are packed several to a row (data/packing.py) for a forward that reads one output per
# example when that forwards at most this share of the bucketed pass's cost (`packing_plan`).
PACK_GAIN = 0.9
# A span / token task's stored teacher logits hold every layer's [CLS] vectors up to this size.
CLS_BYTES = 256 * 2**20


def token_cache_bytes(obj, seq_lens: np.ndarray, dtype: str = "float16") -> int:
    """Disk bytes of the per-token teacher cache of an intermediate objective for rows padded
    to `seq_lens` (int [R], each row's bucket length): attention logits [K_a, H, T, T] plus
    hidden states [K_h, T, D] per row."""
    tc = obj.teacher_config
    T = np.asarray(seq_lens, np.int64)
    ka = len(obj.teacher_attention_layers) * tc.num_attention_heads
    kh = len(obj.teacher_hidden_layers) * tc.hidden_size
    return int(np.dtype(dtype).itemsize * np.sum(ka * T * T + kh * T))


def teacher_model_id(teacher) -> str:
    """The teacher module's part of a cache fingerprint: its class and compute dtypes."""
    out = f"{type(teacher).__name__}:{getattr(teacher, 'dtype', None)}"
    # Products in another dtype than the activations give other outputs. Named only then, so
    # that the fingerprints of caches built before 16-bit products existed still match.
    dots = getattr(getattr(teacher, "products", None), "dot_dtype", None)
    if dots is not None:
        out += f":dots={dots}"
    return out


def position_logits(models, obj, data, batch_size: int = 64, store=None):
    """A span or token task's teacher logits over its train rows (teacher/positions.py): from
    `store` (a `teacher_store.Store`, or None) when a run of the same teacher on the same rows
    put them there (the prediction, KD and PKD stages of one recipe), else one forward here,
    then published to `store`. -> positions.PositionLogitsCache."""
    layers = tuple(getattr(obj, "teacher_cls_layers", ()) or ())
    # The sequence tasks' cache fingerprint (teacher bytes, module, config, tokenizer, rows),
    # less the [CLS] layers (all are stored where they fit), plus the head.
    fp = dict(_training_fingerprint(models, obj, data, None), layers=[], head=data.head)
    n = len(data.train_dataset.lengths)
    if store is not None and jax.process_count() == 1:
        got = store.find_positions(fp, n, layers)
        if got is not None:
            return got
    # The store keeps every layer's [CLS] vector where that is small (82 MB on SQuAD v1.1's
    # 7.6k windows), so that PKD beside the prediction and KD stages reads the same pass.
    tc = models.teacher_config
    every = layers
    if store is not None and n * (tc.num_hidden_layers + 1) * tc.hidden_size * 4 <= CLS_BYTES:
        every = tuple(range(tc.num_hidden_layers + 1))
    cache = positions.build(models.teacher, models.teacher_params, data.train_dataset,
                            data.train_batches.buckets, data.head, batch_size, every)
    # Several processes compute every row each (positions.py): one writer is enough.
    if store is not None and jax.process_index() == 0:
        store.publish_positions(cache, fp, every)
    return positions.with_cls_layers(cache, every, layers)


def build_for_training(models, obj, data, workdir: str, mesh=None, batch_size: int = 64,
                       num_steps: Optional[int] = None,
                       token_dtype: Optional[str] = None, store=None, live=None,
                       order: Optional[Iterable[Tuple[int, np.ndarray]]] = None,
                       split: str = "auto") -> TeacherCache:
    """The cache for a training run (called by `train.train_and_evaluate`).

    Covers the examples of `data.train_dataset` that the run's `num_steps` training steps read
    (`rows_to_cache`: all of them once num_steps is an epoch or more, or None): a run of fewer
    steps than an epoch of a large (e.g. augmented) train set forwards only the rows it will use. One
    pass in dataset order, no dropped remainder. Several processes split the pass and all read
    the one cache it makes (teacher/split.py) when the workdir is one they all see and split is
    "auto"; else (split "never", or local workdirs on each host) each builds its own whole copy
    under `cache/teacher_p<i>`. token_dtype (float16 | float32): cache the
    objective's per-token features (intermediate stage: attention logits, hidden states), each
    row at its bucket length, in that dtype. store: a `teacher_store.Store` (or None): an
    entry there that covers the rows is copied in instead of running the teacher, and what
    this build computes per example (logits, [CLS] vectors; not the per-token fields) is
    published to it for later runs. live, order: a build beside the steps (teacher_stream.py):
    the `Live` that readers wait on, and (T, example rows [b]) of the steps left, in the order
    they run (`teacher_stream.steps_order`), which an unpacked pass follows before the rows no
    step reads.
    """
    ds = data.train_dataset
    n = len(ds)
    buckets = _train_buckets(data)
    fingerprint = _training_fingerprint(models, obj, data, token_dtype)
    token_fields = obj.token_cache_fields if token_dtype else ()
    rows, lengths, plan = _pass_plan(obj, data, token_dtype, num_steps)
    if rows is not None:
        # Which rows is part of what the cache holds: another step count or seed rebuilds it.
        fingerprint["rows"] = arrays_fingerprint(rows)
        log.info("teacher cache: %d steps read %d of %d train examples; caching those",
                 num_steps, len(rows), n)
    coord = coordination.Coordinator("teacher_cache")
    shared = _split_pass(workdir, split, live, coord)
    name = "teacher" if shared or jax.process_count() == 1 else f"teacher_p{jax.process_index()}"
    path = fs.join(workdir, "cache", name)

    def batches():   # asked for only when the cache is built here
        if plan is None and order is not None:
            return _ordered_row_batches(ds, order, rows, buckets, batch_size)
        if plan is None:
            return _row_batches(ds, rows, buckets, batch_size)
        log.info("teacher cache: %d examples packed into %d rows of %d tokens (up to %d per "
                 "row): %.0f%% of the tokens of padding each to its bucket", len(lengths),
                 len(plan[2]), plan[0], plan[1],
                 100.0 * len(plan[2]) * plan[0] / max(1, batching.padded_tokens(lengths, buckets)))
        return _packed_row_batches(ds, rows, plan, batch_size)

    forward = _training_forward(models, obj, token_dtype,
                                packed_segments=None if plan is None else plan[1])
    # What the per-example outputs depend on, whichever objective asks: the logits-only entry of
    # an intermediate build is the one a prediction or KD run looks for.
    share_fp = dict(fingerprint, layers=[] if token_fields else fingerprint["layers"],
                    num_examples=n)
    from_store = store is not None and not token_fields and not _is_current(path, fingerprint, n)
    if shared:   # process 0's store, for all (another host may have none)
        from_store = coord.from_process_0("1" if from_store else "0", "store") == "1"
    if from_store:
        cache = _from_store(store, share_fp, fingerprint, path, rows, models, obj, data,
                            batch_size, coord if shared else None)
        if cache is not None:
            return cache
    kw = dict(num_rows=None if rows is None else len(rows), token_fields=token_fields,
              token_dtype=token_dtype or "float32",
              work_total=teacher_cache.pass_work(lengths, buckets, plan))
    if shared:
        cache = split_lib.build_shared(path, fingerprint, forward, models.teacher_params,
                                       batches, n, coord, **kw)
    else:
        cache = teacher_cache.build_or_load(path, fingerprint, forward, models.teacher_params,
                                            batches, n, live=live, **kw)
    publishes = not shared or jax.process_index() == 0   # a shared cache: process 0's store
    if store is not None and cache.build_stats is not None and publishes:
        store.publish(cache, share_fp, fields=["teacher_logits"] if token_fields else None)
    cache.fields = _step_fields(cache.fields, token_dtype)
    return cache


def _training_fingerprint(models, obj, data, token_dtype: Optional[str]) -> dict:
    """What a training run's teacher cache holds depends on (the rows it covers aside)."""
    tok = tokenize.load_data_tokenizer(models.tokenizer_dir)
    fingerprint = {
        # build.Models hashes its teacher once a run; other `models` (tests) are hashed here.
        "teacher": (getattr(models, "teacher_fingerprint", None)
                    or params_fingerprint(models.teacher_params)),
        "teacher_model": teacher_model_id(models.teacher),
        "teacher_config": models.teacher_config.to_dict(),
        "data": dataset_fingerprint(data.train_dataset),
        "tokenizer": tokenize.tokenizer_fingerprint(tok),
        "layers": list(getattr(obj, "teacher_cls_layers", ()) or ()),
        "objective": getattr(obj, "name", None),
    }
    if token_dtype:
        # A row's length is its bucket's: other buckets need another cache.
        fingerprint.update(buckets=list(_train_buckets(data)), token_dtype=str(token_dtype),
                           hidden_layers=list(obj.teacher_hidden_layers),
                           attention_layers=list(tuple(obj.teacher_attention_layers)))
    return fingerprint


def _split_pass(workdir: str, split: str, live, coord) -> bool:
    """Whether the processes of this run split one teacher pass (teacher/split.py), logged with
    why on process 0. One process: no."""
    if jax.process_count() == 1:
        return False
    if split == "never" or live is not None:
        why = ("teacher.cache_split=never" if split == "never"
               else "a build beside the steps reads only this process's rows")
        shared = False
    else:
        shared, why = split_lib.shared_workdir(workdir, coord)
    if jax.process_index() == 0:
        log.info("teacher cache: %s (%s)", "one pass split over the %d processes, one cache "
                 "all read" % jax.process_count() if shared else
                 "each process forwards every row into its own copy", why)
    return shared


def _from_store(store, share_fp: dict, fingerprint: dict, path: str, rows, models, obj, data,
                batch_size: int, coord=None) -> Optional[TeacherCache]:
    """The run's cache from a teacher store entry that covers its rows (the few it lacks
    forwarded here), or None when the store has none. coord: several processes share `path`
    (process 0 adopts the entry; the others open what it wrote)."""
    if coord is not None:
        cache = _from_store(store, share_fp, fingerprint, path, rows, models, obj, data,
                            batch_size) if jax.process_index() == 0 else None
        if coord.from_process_0("1" if cache else "0", "from_store") == "0":
            return None
        return split_lib.mark_shared(cache or TeacherCache(path, verify=False))
    ds, buckets = data.train_dataset, _train_buckets(data)
    need = np.arange(len(ds)) if rows is None else rows
    # An entry of a run with other buckets lacks a few rows (each bucket drops its own
    # incomplete batch): those are forwarded here, up to a quarter of what the run reads.
    entry = store.find(share_fp, rows, max_missing=len(need) // 4)
    if entry is None:
        return None
    missing = need[~np.asarray(entry.filled)[need]]
    log.info("teacher cache: teacher outputs of %d examples from the teacher store %s "
             "(computed by an earlier run with the same teacher and data; "
             "JTB_TEACHER_STORE=off to recompute)%s", len(need) - len(missing),
             entry.path, f"; forwarding the {len(missing)} it lacks" if len(missing) else "")

    def fill(ids):   # a few rows: in buckets, with the forward of unpacked rows
        return _forward_rows(_training_forward(models, obj, None), models.teacher_params,
                             _row_batches(ds, ids, buckets, batch_size), ids)

    cache = store.adopt(entry, path, fingerprint, missing=missing, fill=fill)
    if len(missing):
        store.publish(cache, share_fp)   # the entry grows to the rows of both runs
    return cache


def _pass_plan(obj, data, token_dtype: Optional[str], num_steps: Optional[int]):
    """(rows, lengths, plan) of `build_for_training`'s pass: the rows it caches
    (`rows_to_cache`; None = all), their lengths int [R], and the `packing_plan` of a forward
    that reads one output per example (None: unpacked, each row at its bucket's length)."""
    ds = data.train_dataset
    rows = rows_to_cache(data.train_batches, ds, num_steps)
    lengths = np.asarray(ds.lengths)[slice(None) if rows is None else rows]
    plan = (packing_plan(lengths, _train_buckets(data)) if _reads_cls_only(obj, token_dtype)
            else None)
    return rows, lengths, plan


def _train_buckets(data) -> Tuple[int, ...]:
    """The length buckets of `data`'s train batches (batching.DEFAULT_BUCKETS without any)."""
    return getattr(data.train_batches, "buckets", None) or batching.DEFAULT_BUCKETS


def follows_steps(obj, data, token_dtype: Optional[str], num_steps: Optional[int]) -> bool:
    """Whether `build_for_training(..., order=)` forwards the rows in the order of the steps
    that read them, as a build beside the steps (teacher_stream.py) needs so that a step finds
    its rows written: a per-token cache always; a cache of logits / [CLS] rows when its
    examples are not packed (`packing_plan`: MRPC's pairs are not; SST-2's short sentences are,
    several to a row in no step's order, and would all be waited for by the first step)."""
    return _pass_plan(obj, data, token_dtype, num_steps)[2] is None


def _step_fields(fields: Dict[str, Any], token_dtype: Optional[str]) -> Dict[str, Any]:
    """Of a training cache's fields, those its batches get: a per-token (intermediate) cache
    keeps its logits for the store only, since the intermediate loss reads the per-token fields."""
    return {k: v for k, v in fields.items() if not (token_dtype and k == "teacher_logits")}


def _reads_cls_only(obj, token_dtype: Optional[str]) -> bool:
    """Whether a training cache's forward reads logits and [CLS] rows alone."""
    return not token_dtype and not obj.reads_tokens


def _training_forward(models, obj, token_dtype: Optional[str],
                      packed_segments: Optional[int] = None) -> Callable:
    """The forward a training run's cache is built with (see `build_for_training`);
    packed_segments: for the batches of `_packed_row_batches` (see `make_forward`)."""
    token_fields = tuple(obj.token_cache_fields) if token_dtype else ()

    def with_logits(out):
        # The logits cost one pooler + classifier on the forward that runs anyway: stored so the
        # prediction stage after this one (same teacher, same data) reads them from the store.
        return dict(obj.teacher_features(out), teacher_logits=out.logits)

    return teacher_cache.make_forward(
        models.teacher, with_logits if token_fields else obj.teacher_features,
        attention_layers=obj.teacher_attention_layers if token_fields else (),
        token_fields=token_fields, token_dtype=token_dtype or "float32",
        cls_only=_reads_cls_only(obj, token_dtype), packed_segments=packed_segments)


def lookup_spec(models, obj, batch: Mapping[str, Any],
                token_dtype: Optional[str] = None) -> Dict[str, jax.ShapeDtypeStruct]:
    """What `lookup` adds to `batch` (int [b, T] model inputs) from the cache that
    `build_for_training(models, obj, ..., token_dtype=token_dtype)` builds, as shapes and dtypes,
    without running the teacher: the train step can be compiled for those batches while the cache
    is being built. {field: ShapeDtypeStruct [b, ...]}."""
    forward = _training_forward(models, obj, token_dtype)
    out = jax.eval_shape(forward, models.teacher_params,
                         *(jax.ShapeDtypeStruct(np.shape(batch[k]), np.asarray(batch[k]).dtype)
                           for k in MODEL_KEYS))
    return _step_fields(out, token_dtype)


def rows_per_forward(seq_len: int, batch_size: int) -> int:
    """Rows of a [batch_size, seq_len] batch that one cache-build forward takes: on CPU
    `batching.chunk_rows` of the profile's forward_tokens, the whole batch on accelerators."""
    tokens = speed.current().forward_tokens
    if not tokens:
        return int(batch_size)
    return batching.chunk_rows(batch_size, seq_len, tokens)


def packing_plan(lengths: np.ndarray, buckets: Sequence[int]
                 ) -> Optional[Tuple[int, int, List[np.ndarray]]]:
    """(row_len, max_segments, rows of `packing.pack`) for a teacher pass over examples of
    `lengths` (int [n]) that reads one output per example, or None when packing them would not
    cost at most PACK_GAIN of padding each to its bucket of `buckets` (cost of a token in a
    row of T: 1 + T / PACK_ATTENTION_LEN). row_len: of the buckets that hold the longest
    example, the cheapest. SST-2 train (mean 13.3 tokens, buckets up to 64): rows of 64, 16 segments, 79% of
    the bucketed tokens; MRPC pairs (mean 53) at 128: 94%, not packed."""
    lengths = np.asarray(lengths, np.int64)
    b = np.asarray(sorted(int(x) for x in buckets), np.int64)
    if not len(lengths) or lengths.max() > b[-1]:
        return None
    best, cost = None, PACK_GAIN * teacher_cache.pass_work(lengths, b)
    for P in b[b >= lengths.max()].tolist():   # each bucket long enough for every example
        rows = packing.pack(lengths, P, max(1, P // 4))
        S = max(len(r) for r in rows)
        packed = teacher_cache.pass_work(lengths, b, (P, S, rows))
        if S > 1 and packed <= cost:
            best, cost = (P, S, rows), packed
    return best


def _packed_row_batches(ds, rows: Optional[np.ndarray], plan, batch_size: int):
    """`_row_batches` for a `packing_plan` over dataset rows `rows` (None: all of ds): packed
    batches (data/packing.py) of the profile's forward_tokens on CPU (`rows_per_forward`), of
    batch_size rows elsewhere; example_id = the row's index in ds."""
    P, S, packed = plan
    src = ds if rows is None else tokenize.take(ds, rows)
    for batch in packing.packed_batches(src, packed, P, S, rows_per_forward(P, batch_size)):
        if rows is not None:
            ids = batch["example_id"]
            batch["example_id"] = np.where(ids >= 0, rows[np.maximum(ids, 0)], -1)
        yield batch


def _row_batches(ds, rows: Optional[np.ndarray], buckets, batch_size: int):
    """Eval-mode bucketed batches over dataset rows `rows` (int [R]; None: all of `ds`), no
    row dropped, each split into chunks of `rows_per_forward` rows; example_id = the row's
    index in `ds` (-1 for filler rows)."""
    src = ds if rows is None else tokenize.take(ds, rows)
    it = batching.BucketedBatcher(src, min(batch_size, max(1, len(src))), buckets,
                                  train=False, process_index=0, process_count=1)
    for batch in it:
        if rows is not None:  # subset positions -> the train set's example ids
            ids = batch["example_id"]
            batch["example_id"] = np.where(ids >= 0, rows[np.maximum(ids, 0)], -1)
        n, T = np.shape(batch["input_ids"])
        step = rows_per_forward(T, n)
        for s in range(0, n, step):
            chunk = {k: v[s:s + step] for k, v in batch.items()}
            if np.any(chunk["example_id"] >= 0):   # not filler rows only
                yield chunk


def _ordered_row_batches(ds, order: Iterable[Tuple[int, np.ndarray]], rows: Optional[np.ndarray],
                         buckets, batch_size: int):
    """Batches for a cache build over the rows of `order` ((T, example rows int [g], -1 =
    filler) per step, e.g. `teacher_stream.steps_order`) first, each at its step's T, in that
    order, then over the rows of `rows` (None: all of ds) that no step of it reads, bucket by
    bucket. Chunks of `rows_per_forward(T, g)` rows (g: the steps' batch; `batch_size` without
    steps), the shapes of a build before the steps of batch g; a step's (or a bucket's) last
    chunk is completed with filler rows (example_id -1, valid 0)."""
    done = np.zeros((len(ds),), bool)
    wanted = np.zeros((len(ds),), bool)
    wanted[slice(None) if rows is None else rows] = True
    left, g = int(wanted.sum()), None
    for T, ids in order:
        if left <= 0:
            break
        ids = np.asarray(ids, np.int64)
        g = g or len(ids)
        ids = ids[ids >= 0]   # a step's rows are distinct (a slice of the epoch's permutation)
        ids = ids[wanted[ids] & ~done[ids]]
        done[ids] = True
        left -= len(ids)
        yield from _chunks(ds, ids, int(T), rows_per_forward(int(T), g))
    rest = np.flatnonzero(wanted & ~done)
    if len(rest):
        g = g or int(batch_size)
        b = np.asarray(sorted(buckets), np.int64)
        T_rest = b[batching.assign_buckets(np.asarray(ds.lengths)[rest], b)]
        for T in np.unique(T_rest).tolist():
            yield from _chunks(ds, rest[T_rest == T], int(T), rows_per_forward(int(T), g))


def _chunks(ds, ids: np.ndarray, T: int, step: int):
    """Rows `ids` of ds at length T in chunks of `step` rows, the last completed with filler
    rows (a copy of a real row, example_id -1, valid 0)."""
    for s in range(0, len(ids), step):
        part = ids[s:s + step]
        real = np.arange(step) < len(part)
        fill = np.where(real, np.resize(part, step), part[0])
        chunk = {k: v for k, v in ds.gather(fill, T).items() if k != "labels"}
        chunk["example_id"] = np.where(real, fill, -1)
        chunk["valid"] = real.astype(np.float32)
        yield chunk


def _forward_rows(forward: Callable, params, batches, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """forward's outputs over `batches` (from `_row_batches(ds, rows, ...)`, rows sorted int
    [M]) -> {field: float32 [M, ...]} in the order of `rows`."""
    params = jax.device_put(params)
    out: Dict[str, np.ndarray] = {}

    def positions():
        for batch in batches:
            ids = np.asarray(batch["example_id"])
            keep = (ids >= 0) & (np.asarray(batch["valid"]) > 0)
            yield batch, (keep, np.searchsorted(rows, ids[keep]))

    for (keep, pos), feats in teacher_cache.forwarded(forward, params, positions()):
        for k, v in feats.items():
            if k not in out:
                out[k] = np.zeros((len(rows),) + v.shape[1:], np.float32)
            out[k][pos] = np.asarray(v, np.float32)[keep]
    return out


def _is_current(path: str, fingerprint: Mapping[str, Any], num_examples: int) -> bool:
    """Whether the workdir cache at `path` is already the one for `fingerprint` (meta only)."""
    try:
        with fs.open_file(fs.join(path, META)) as fh:
            old = json.load(fh).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return False
    return old == _normalise(dict(fingerprint, num_examples=int(num_examples)))


def rows_to_cache(batcher, ds, num_steps: Optional[int]) -> Optional[np.ndarray]:
    """The rows of `ds` a training run's teacher cache holds: int64 [R] sorted, the rows that
    `num_steps` steps of `batcher` read, or None for all of them.

    All of them from an epoch on: an epoch leaves only each bucket's incomplete batch unread (at
    most buckets x batch rows), and forwarding those too makes the entry published to the
    teacher store serve a later stage whose buckets or seed leave other rows, which would
    otherwise compile teacher forward programs for a handful of rows (~7 s of an MRPC
    prediction epoch)."""
    if (num_steps is None or not hasattr(batcher, "rows_read")
            or not isinstance(ds, tokenize.EncodedDataset)
            or num_steps >= batcher.steps_per_epoch):
        return None
    rows = batcher.rows_read(num_steps)
    return None if len(rows) == len(ds) else rows


# ----------------------------------------------------------------------------- the per-token plan

def _local_disk(workdir: str) -> str:
    """The local folder whose disk a cache under `workdir` is written to (a bucket workdir's
    files are staged in the temp dir first)."""
    return tempfile.gettempdir() if fs.is_remote(workdir) else fs.existing_dir(workdir)


def token_cache_fits(config, objective, data, total: int,
                     workdir: str) -> Tuple[bool, str]:
    """Whether the per-token teacher cache of this run fits min(teacher.cache_max_gb, 80% of the
    free disk), and how big it is (or why it does not fit)."""
    rows = rows_to_cache(data.train_batches, data.train_dataset, total)
    if rows is None:
        rows = np.arange(len(data.train_dataset))
    lens = batching.assign_buckets(data.train_dataset.lengths[rows], data.train_batches.buckets)
    T = np.asarray(data.train_batches.buckets, np.int64)[lens]
    need = token_cache_bytes(objective, T, config.teacher.cache_dtype)
    free = fs.free_bytes(_local_disk(workdir))
    if need > min(config.teacher.cache_max_gb * 1e9, 0.8 * free):
        return False, (f"the teacher's per-token outputs of {len(rows):,} rows need "
                       f"{need / 1e9:.1f} GB, over min(teacher.cache_max_gb="
                       f"{config.teacher.cache_max_gb:g} GB, 80% of the {free / 1e9:.1f} GB free)")
    return True, f"{need / 1e9:.2f} GB ({config.teacher.cache_dtype}) for {len(rows):,} rows"


def token_cacheable(config, objective, data) -> bool:
    """Whether the intermediate stage's per-token teacher outputs can be cached at all (not for
    span / token heads: the cache stores per-example logits beside them, of one shape)."""
    return bool(objective.teacher_token_cacheable and not config.teacher.dropout
                and getattr(objective, "head", "sequence") == "sequence"
                and isinstance(data.train_dataset, tokenize.EncodedDataset))


def token_cache_plan(config, objective, data, total: int,
                     workdir: str) -> Tuple[bool, str]:
    """Whether this run caches the teacher's per-token outputs (intermediate stage), and why:
    teacher.cache_tokens 'always' (refused when it does not fit: `token_cache_fits`) or
    'never'; 'auto' is made one of them by speed.resolve."""
    mode = config.teacher.cache_tokens
    if mode == "auto":
        raise ValueError("teacher.cache_tokens='auto' reached the build: speed.resolve first")
    if mode == "never" or not token_cacheable(config, objective, data):
        return False, "not cacheable" if mode != "never" else "teacher.cache_tokens='never'"
    fits, why = token_cache_fits(config, objective, data, total, workdir)
    if not fits:
        raise ConfigValueError(f"config.teacher.cache_tokens='always': {why}; raise "
                               "config.teacher.cache_max_gb, free disk space, or pass "
                               "--config.teacher.cache_tokens=auto")
    return True, why
