"""Length-bucketed, per-process sharded, exactly resumable batches (the batch format of docs/design.md).

The whole epoch plan (which examples form which global batch, at which bucket length) is a pure
function of (dataset lengths, seed, epoch), so every process computes the same plan without
communicating and then reads only its own rows of each global batch: process p takes rows
[p*b, (p+1)*b) of every global batch of size P*b. Shards are disjoint and together cover the
global batch. Resuming needs only (epoch, step).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

DEFAULT_BUCKETS = (32, 64, 128)


def assign_buckets(lengths: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """Index of the smallest bucket >= each length. int64 [n]. Raises if one does not fit."""
    b = np.asarray(sorted(buckets))
    lengths = np.asarray(lengths)
    which = np.searchsorted(b, lengths, side="left")
    if len(lengths) and which.max() >= len(b):
        i = int(np.argmax(which >= len(b)))
        raise ValueError(f"example {i} has {int(lengths[i])} tokens, more than the largest bucket "
                         f"{int(b[-1])}; tokenize with max_len <= {int(b[-1])} or add a bucket")
    return which


def padded_tokens(lengths: np.ndarray, buckets: Sequence[int]) -> int:
    """Token positions a pass forwards with each example padded to its bucket."""
    b = np.asarray(sorted(buckets), np.int64)
    return int(b[assign_buckets(lengths, b)].sum())


def padding_waste(lengths: np.ndarray, buckets: Sequence[int] = DEFAULT_BUCKETS,
                  fixed_len: Optional[int] = None) -> Dict[str, float]:
    """Padding waste of bucketing vs one fixed length (default: the largest bucket).

    Returns `bucketed` / `fixed` (fraction of processed positions that are padding) and
    `ratio` = positions processed with buckets / positions processed at fixed_len (< 1 = saving).
    Filler rows of incomplete batches are not counted.
    """
    lengths = np.asarray(lengths, np.int64)
    b = np.asarray(sorted(buckets))
    fixed_len = int(fixed_len or b[-1])
    padded = padded_tokens(lengths, b)
    real = lengths.sum()
    return {"bucketed": float(1 - real / padded),
            "fixed": float(1 - real / (fixed_len * len(lengths))),
            "ratio": float(padded / (fixed_len * len(lengths)))}


def chunk_rows(batch_size: int, seq_len: int, max_tokens: int, min_rows: int = 8) -> int:
    """Rows per chunk of a forward over a [batch_size, seq_len] batch: the batch halved while it
    holds more than `max_tokens` tokens, down to `min_rows` rows. Always a divisor of
    batch_size, so every chunk has one shape (one compiled program). On CPU a forward of about
    1,024 tokens runs fastest: its [rows, H, T, T] attention tensors stay in cache."""
    b = int(batch_size)
    while b % 2 == 0 and b // 2 >= min_rows and b * int(seq_len) > max_tokens:
        b //= 2
    return b


def row_cost(row_len, attention_len: int = 256):
    """Relative compute of a row of `row_len` tokens (a number or an array of them):
    T + T^2 / attention_len (see `bucket_cost`)."""
    return row_len + row_len * row_len / attention_len


def bucket_cost(lengths: np.ndarray, buckets: Sequence[int], attention_len: int = 256) -> float:
    """Relative compute of one pass over `lengths` padded to `buckets`: sum over examples of
    T + T^2 / attention_len (T = the example's bucket). The T^2 term is the attention scores'
    work ([H, T, T] per layer: softmax, dropout, attention loss), worth one token of the
    T-linear work (matmuls, layer norms) at T = attention_len."""
    b = np.asarray(sorted(buckets), np.float64)
    t = b[assign_buckets(lengths, buckets)]
    return float(np.sum(row_cost(t, attention_len)))


def choose_buckets(lengths: np.ndarray, max_len: int, max_buckets: int = 6, multiple: int = 8,
                   attention_len: int = 256, tolerance: float = 0.02, passes: float = 1.0,
                   compile_cost: float = 0.0) -> Tuple[int, ...]:
    """Length buckets for a dataset, from its length histogram, under a compile budget.

    Every bucket is one more compilation of the train step (and of the eval step and the
    teacher-cache forward), so the number of buckets is the budget: for each k <= max_buckets
    an exact dynamic program over the histogram picks the k bucket lengths (multiples of
    `multiple`, the last = max_len) minimising `bucket_cost`; then k is chosen to minimise
    `passes` x that cost + k x `compile_cost` (a bucket's compilations in `bucket_cost` units,
    0 = free), the smallest k within `tolerance` of the best total winning (more buckets past
    that point buy little). A small data set run for few passes thus gets fewer buckets: on
    MRPC (3,668 pairs, one epoch) a compilation outweighs the padding it saves. max_len is
    always the last bucket, outside the budget when no example needs it (it is then never
    compiled for training; longer eval examples still fit).
    lengths: int [n] token counts (<= max_len). Returns sorted bucket lengths ending in max_len.
    E.g. SST-2 (mean 13.3 tokens) at max_len 64, 6 buckets: (8, 16, 24, 32, 40, 64), 16.9
    tokens per example after padding against 33.8 with (32, 64).
    """
    lengths = np.asarray(lengths, np.int64)
    max_len = int(max_len)
    if len(lengths) and int(lengths.max()) > max_len:
        raise ValueError(f"choose_buckets: an example has {int(lengths.max())} tokens > max_len "
                         f"{max_len}")
    if max_buckets < 1:
        raise ValueError(f"choose_buckets: max_buckets={max_buckets} must be >= 1")
    if passes <= 0 or compile_cost < 0:
        raise ValueError(f"choose_buckets: passes={passes} must be > 0 and "
                         f"compile_cost={compile_cost} >= 0")
    if not len(lengths):
        return (max_len,)
    # The last candidate covers the longest example; max_len is added after (empty in this
    # data, so never compiled for it, but longer eval examples still fit).
    top = min(max_len, -(-int(lengths.max()) // multiple) * multiple)
    cands = sorted({c for c in range(multiple, top, multiple)} | {top})
    # cnt[j] = examples whose smallest candidate >= length is cands[j].
    cnt = np.bincount(np.searchsorted(cands, lengths, side="left"), minlength=len(cands))
    unit = np.asarray([c + c * c / attention_len for c in cands], np.float64)
    m = len(cands)
    # cost(i, j): examples of candidates i..j all padded to cands[j].
    csum = np.concatenate([[0], np.cumsum(cnt)])
    inf = float("inf")
    # best[k][j]: min cost covering candidates 0..j with k buckets, the last at cands[j].
    best = np.full((max_buckets + 1, m), inf)
    back = np.zeros((max_buckets + 1, m), np.int64)
    for j in range(m):
        best[1][j] = csum[j + 1] * unit[j]
    for k in range(2, max_buckets + 1):
        for j in range(m):
            for i in range(j):  # previous bucket at cands[i]
                c = best[k - 1][i] + (csum[j + 1] - csum[i + 1]) * unit[j]
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    totals = [float(passes) * best[k][m - 1] + k * float(compile_cost)
              for k in range(1, max_buckets + 1)]
    target = min(totals) * (1 + tolerance)
    k = next(k for k in range(1, max_buckets + 1) if totals[k - 1] <= target)
    out, j = [], m - 1
    for kk in range(k, 0, -1):
        out.append(cands[j])
        j = back[kk][j]
    # Drop buckets no example falls in (possible when k exceeds the distinct lengths).
    used = set(np.asarray(sorted(out))[assign_buckets(lengths, sorted(out))].tolist())
    return tuple(int(b) for b in sorted(used | {max_len}))


def resolve_buckets(buckets: Sequence[int], max_len: int, lengths=None,
                    max_buckets: int = 6, passes: float = 1.0,
                    compile_cost: float = 0.0) -> Tuple[int, ...]:
    """The buckets a run uses: the configured ones below max_len plus max_len; or, when
    `buckets` is empty, `choose_buckets(lengths, max_len, max_buckets, passes=,
    compile_cost=)` (lengths: the token counts of the set the buckets are for)."""
    if not buckets:
        if lengths is None:
            raise ValueError("resolve_buckets: buckets=() (choose from the data) needs lengths")
        return choose_buckets(lengths, max_len, max_buckets=int(max_buckets), passes=passes,
                              compile_cost=compile_cost)
    return tuple(sorted({int(b) for b in buckets if b < max_len} | {int(max_len)}))


def compile_cost(steps: float, batch_size: int, length: int, attention_len: int = 256) -> float:
    """A bucket's compilations worth `steps` steps of `batch_size` rows at `length`, in
    `bucket_cost` units (what `choose_buckets(compile_cost=)` takes)."""
    return float(steps) * int(batch_size) * (length + length * length / attention_len)


def _process_defaults(process_index, process_count):
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    return int(process_index), int(process_count)


@dataclasses.dataclass
class _Plan:
    seq_lens: np.ndarray  # int32 [steps]
    rows: np.ndarray      # int64 [steps, global_batch]; -1 = filler


class BucketedBatcher:
    """Iterator over per-process batches of a dataset with `lengths` and `gather(idx, T)`.

    Args:
      dataset: e.g. `tokenize.EncodedDataset` (GLUE) or a packed corpus.
      global_batch_size: rows per step summed over all processes (divisible by process_count).
      buckets: allowed sequence lengths T; each example goes to the smallest that fits and
        batches never mix buckets, so the step compiles once per bucket.
      train: True -> shuffle by (seed, epoch), repeat for `num_epochs` (None = forever), drop
        each bucket's incomplete last batch unless drop_remainder=False. False (eval) -> dataset
        order, one pass, incomplete batches filled with filler rows (`valid` 0, `example_id` -1,
        a copy of a real row so no row is all padding).
    Yields dicts: input_ids/attention_mask/token_type_ids int32 [b, T], labels [b] if the dataset
    has labels, example_id int64 [b], valid float32 [b]; b = global_batch_size / process_count.
    """

    def __init__(self, dataset, global_batch_size: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 *, train: bool = True, seed: int = 0, drop_remainder: Optional[bool] = None,
                 num_epochs: Optional[int] = None, process_index: Optional[int] = None,
                 process_count: Optional[int] = None):
        self.dataset = dataset
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.global_batch_size = int(global_batch_size)
        self.train = bool(train)
        self.seed = int(seed)
        self.drop_remainder = self.train if drop_remainder is None else bool(drop_remainder)
        self.num_epochs = num_epochs if train else (1 if num_epochs is None else num_epochs)
        self.process_index, self.process_count = _process_defaults(process_index, process_count)
        if self.global_batch_size % self.process_count:
            raise ValueError(f"global batch {self.global_batch_size} not divisible by "
                             f"{self.process_count} processes")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} not in [0, {self.process_count})")
        self.local_batch_size = self.global_batch_size // self.process_count
        self.lengths = np.asarray(dataset.lengths)
        self._bucket = assign_buckets(self.lengths, self.buckets)
        self._members = [np.flatnonzero(self._bucket == k) for k in range(len(self.buckets))]
        self.epoch = 0
        self.step = 0
        self._plan_epoch = None
        self._plan: Optional[_Plan] = None
        if self.steps_per_epoch == 0:
            raise ValueError(f"dataset of {len(self.lengths)} examples gives no full batch of "
                             f"{self.global_batch_size}; use drop_remainder=False or a smaller batch")

    # -- planning ---------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Global steps in one epoch (the same on every process and every epoch)."""
        g = self.global_batch_size
        f = (lambda n: n // g) if self.drop_remainder else (lambda n: -(-n // g))
        return int(sum(f(len(m)) for m in self._members))

    def epoch_plan(self, epoch: int) -> _Plan:
        """The global plan of one epoch: bucket length and example rows of every step."""
        if self._plan_epoch == epoch and self._plan is not None:
            return self._plan
        g = self.global_batch_size
        rng = np.random.default_rng([self.seed, epoch]) if self.train else None
        lens, rows = [], []
        for k, members in enumerate(self._members):
            idx = rng.permutation(members) if rng is not None else members
            n_full = len(idx) // g
            for s in range(n_full):
                rows.append(idx[s * g:(s + 1) * g])
                lens.append(self.buckets[k])
            rest = len(idx) - n_full * g
            if rest and not self.drop_remainder:
                rows.append(np.concatenate([idx[n_full * g:], np.full(g - rest, -1, np.int64)]))
                lens.append(self.buckets[k])
        seq_lens = np.asarray(lens, np.int32)
        rows = np.stack(rows).astype(np.int64) if rows else np.zeros((0, g), np.int64)
        if rng is not None:
            order = rng.permutation(len(rows))
            seq_lens, rows = seq_lens[order], rows[order]
        self._plan_epoch, self._plan = epoch, _Plan(seq_lens, rows)
        return self._plan

    def rows_read(self, num_steps: int) -> np.ndarray:
        """Sorted distinct example rows (int64 [R]) that global steps [0, num_steps) read, over
        all processes and epochs; R = len(dataset) once the steps cover every example."""
        n, spe = len(self.lengths), self.steps_per_epoch
        seen = np.zeros((n,), bool)
        for epoch in range(-(-int(num_steps) // spe)):
            rows = self.epoch_plan(epoch).rows[:int(num_steps) - epoch * spe]
            seen[rows[rows >= 0]] = True
            if seen.all():
                break
        return np.flatnonzero(seen).astype(np.int64)

    def batch_at(self, epoch: int, step: int) -> Dict[str, np.ndarray]:
        """This process's batch for global step `step` of `epoch`."""
        plan = self.epoch_plan(epoch)
        rows = plan.rows[step]
        b = self.local_batch_size
        local = rows[self.process_index * b:(self.process_index + 1) * b]
        valid = local >= 0
        filler_src = rows[rows >= 0][0]
        idx = np.where(valid, local, filler_src)
        batch = self.dataset.gather(idx, int(plan.seq_lens[step]))
        batch["example_id"] = np.where(valid, local, -1).astype(np.int64)
        batch["valid"] = valid.astype(np.float32)
        return batch

    # -- iteration / resume -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        batch = self.batch_at(self.epoch, self.step)
        self.step += 1
        return batch

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("infinite iterator (num_epochs=None) has no len()")
        return self.steps_per_epoch * self.num_epochs

    def reset(self) -> None:
        """Back to the start (epoch 0, step 0); for repeated eval passes."""
        self.epoch, self.step = 0, 0

    def state_dict(self) -> Dict[str, int]:
        """Position to resume from: the next batch is step `step` of epoch `epoch`."""
        return {"epoch": int(self.epoch), "step": int(self.step), "seed": self.seed,
                "num_examples": int(len(self.lengths)),
                "global_batch_size": self.global_batch_size,
                "steps_per_epoch": int(self.steps_per_epoch), "buckets": list(self.buckets)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restores a `state_dict()`; the next batch is the one that would have come next."""
        for k in ("seed", "num_examples", "global_batch_size"):
            mine = self.state_dict()[k]
            if k in state and int(state[k]) != mine:
                raise ValueError(f"cannot resume: saved {k}={state[k]} but this iterator has {mine}")
        # Buckets chosen from the data depend on the run's length (data.bucket_compile_steps):
        # other buckets would give another epoch plan, i.e. silently other batches.
        if "buckets" in state and tuple(int(b) for b in state["buckets"]) != self.buckets:
            saved = tuple(int(b) for b in state["buckets"])
            raise ValueError(f"cannot resume: the run was saved with buckets={saved} but this one "
                             f"has buckets={self.buckets}; rerun with "
                             f"--config.data.buckets='{saved}' (or the settings it was started "
                             f"with)")
        if "buckets" not in state and "steps_per_epoch" in state and \
                int(state["steps_per_epoch"]) != self.steps_per_epoch:
            # Saved before buckets were recorded: another epoch length means other buckets.
            raise ValueError(f"cannot resume: the run was saved with {state['steps_per_epoch']} "
                             f"steps per epoch but this one has {self.steps_per_epoch} (other "
                             f"length buckets); rerun with the data.buckets it was started with")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
