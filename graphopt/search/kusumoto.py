"""`kusumoto`: Kusumoto et al., "A Graph Theoretic Framework of Recomputation Algorithms for
Memory-Efficient Backpropagation" (NeurIPS 2019, arXiv 1905.11722), adapted to our cost graphs.

The plan space
--------------
Let D be the DAG of the forward ops that may be recomputed (``recomputable`` and not
``folded``), with an edge u -> v when v reads an output of u. Non-recomputable ops are not in
D: their outputs are forced checkpoints and act like graph inputs. A *strategy* is a chain of
lower sets of D (a lower set has no edge entering it from outside)

    {} = L_0 < L_1 < ... < L_m <= D        (strictly increasing, m >= 0)

cutting D into the *recomputed segments* V_i = L_i - L_{i-1} (i = 1..m) and the *stored
segment* V_{m+1} = D - L_m (possibly empty). The paper's chain ends with L_k = V and never
recomputes its last segment: that is the case L_m < D; L_m = D (everything recomputed) is
allowed too.

Storage. An aliasing op's output 0 shares its input's buffer, so tensors fall into *storage
classes*: a non-alias output of an op of D and the alias outputs chained on it; a class has
the bytes of its root and is kept or not as a whole. Classes holding a forced tensor (graph
output) or rooted outside D (an alias of a parameter or of a forced tensor), outputs of
folded ops, unread outputs (never freed: constant memory), droppable unread outputs (never
allocated): not decided by the strategy. A class is *stashed* when the backward reads one
of its tensors (`stashed_tensors`).

Kept tensors (the checkpoints handed to `make_plan`): a class rooted in segment V_i is kept
iff an op of D in a later segment reads one of its tensors (the boundary of L_i: what the
later segments' recomputation starts from), or i = m+1 (stored segment) and it is stashed.

Recomputation (what `make_plan`'s lazy schedule does for that kept set): an op v of a
recomputed segment is recomputed iff one of its outputs is in a class that is not kept and
that output is read by the backward or by a recomputed op (necessarily of the same segment).
Recomputation never leaves a segment. Model time = the sum of the recomputed ops' measured
``seconds`` (equals the real ``Plan.recompute_seconds``).

Memory
------
G(b): the plan-independent live bytes while backward op b runs: buffers of backward ops
(gradients; their lifetimes do not depend on the plan), forced forward buffers (graph
outputs, non-recomputable outputs, unread outputs) and b's workspace; G* = the max over all
steps of that part (a floor of every plan's peak). Stage peaks, backward segment by segment
(stored segment first):
- stage i <= m (recompute V_i, then its backward):
      peak_i = KEPT(L_i) + REC(V_i) + max G over [first, last]
  KEPT(L_i): bytes of the kept classes rooted in L_i (earlier checkpoints and V_i's own);
  REC(V_i): bytes of the buffers that the recomputed ops of V_i write and that the backward
  reads (non-alias outputs in stashed classes; transient intermediates are not counted);
  [first, last]: the backward positions between the first and last backward reader of a
  stashed class rooted in V_i (no term when there is none);
- stored stage: KEPT(D) + max G over the stored segment's reader interval.
Model peak = max(G*, all stage peaks). Time-centric: least time with model peak <= budget.
Memory-centric: least model peak, then least time at that peak (the coarsest cut that fits
is what the paper's memory-centric variant aims at).

Differences from the paper: the paper's unit of memory and time is a vertex (one tensor)
with integer costs and every segment recomputed in full, all its values held at once; here
a vertex is an op with measured bytes and seconds, only what the backward reads (directly or
through recomputation) is recomputed and held, aliases cost nothing, the gradients are
measured (G) instead of assumed equal to the activations, and the last segment may also be
recomputed. Checkpoints of earlier segments are assumed live in every later stage (also the
paper's assumption; the real schedule frees a checkpoint after its last reader).

The DP
------
Over lower sets in order of size; each holds a Pareto front of (KEPT so far, time) (time-centric)
or (KEPT so far, peak so far) (memory-centric). Exact: all lower sets of D (when there are at
most `max_lower_sets`); approximate: the n+1 lower sets {} and "ancestor closure of one op"
(plus D). Budget: the DP works in the model; `kusumoto` then checks the real cost model
(`Plan.peak_bytes`) and lowers its internal budget until the real peak fits.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..costgraph import CostGraph

from .plan import Plan, make_plan

DEFAULT_MAX_LOWER_SETS = 1_000   # the exact DP's time grows with its square (see the report)


# ----------------------------------------------------------------------------- the model


@dataclass
class StorageClass:
    root: int                      # index (in Model.ops) of the op producing the root
    nbytes: int
    members: tuple[str, ...]
    readers: int                   # bitmask of D ops reading a member
    stashed: bool
    first: int = -1                # backward position of the first/last reader (stashed)
    last: int = -1


@dataclass
class Model:
    ops: list[str]                 # D, in forward order (a topological order)
    preds: list[int]               # bitmask of D predecessors
    seconds: list[float]
    outputs: list[list[tuple[int, bool, int]]]  # per op: (class, read by backward, D readers mask)
    rec_bufs: list[list[tuple[int, int]]]  # per op: (bytes, last backward reader) of the buffers
                                           # a recomputation of it holds (stashed/unread outputs)
    classes: list[StorageClass]
    classes_of: list[list[int]]    # classes rooted at each op
    g: list[int]                   # G(b) per backward position
    g_star: int
    always_kept: frozenset[str]
    _table: list[list[int]] = field(default_factory=list, repr=False)
    _stages: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.ops)

    @property
    def full(self) -> int:
        return (1 << self.n) - 1

    def g_max(self, lo: int, hi: int) -> int:
        """max G over backward positions lo..hi (0 for an empty range, e.g. no backward)."""
        hi = min(hi, len(self._table[0]) - 1) if self._table else -1
        if lo < 0 or hi < lo:
            return 0
        k = (hi - lo + 1).bit_length() - 1
        row = self._table[k]
        return max(row[lo], row[hi - (1 << k) + 1])


    def window_peak(self, lo: int, hi: int, items) -> int:
        """max over backward positions b in lo..hi of G(b) + the bytes of `items` (bytes,
        last) with last >= b; 0 for an empty range."""
        if lo < 0 or hi < lo:
            return 0
        items = sorted(items, key=lambda item: item[1])
        live = sum(nbytes for nbytes, _ in items)
        best = 0
        start = lo
        k = 0
        while start <= hi:
            while k < len(items) and items[k][1] < start:
                live -= items[k][0]
                k += 1
            stop = min(hi, items[k][1]) if k < len(items) else hi
            best = max(best, live + self.g_max(start, stop))
            start = stop + 1
        return best


def build_model(graph: CostGraph) -> Model:
    nodes = graph.ops
    tensor_bytes = graph.tensor_bytes
    resident = graph.resident
    kept_outputs = graph.kept
    droppable = graph.droppable
    fwd_order = list(graph.forward_order)
    bwd_order = list(graph.backward_order)
    forced = graph.forced_checkpoints

    ops = [op for op in fwd_order if nodes[op].recomputable and not nodes[op].folded]
    index = {op: i for i, op in enumerate(ops)}
    producer: dict[str, str] = {}
    for op in fwd_order:
        for t in nodes[op].outputs:
            producer[t] = op
    fwd_readers: dict[str, list[str]] = {}
    for op in fwd_order:
        for t in nodes[op].inputs:
            fwd_readers.setdefault(t, []).append(op)
    bwd_pos: dict[str, list[int]] = {}
    for j, op in enumerate(bwd_order):
        for t in nodes[op].inputs:
            if t in producer:
                bwd_pos.setdefault(t, []).append(j)

    # storage roots of forward tensors ("ext" = resident, folded, forced or outside D)
    root: dict[str, str | None] = {}
    for op in fwd_order:
        attrs = nodes[op]
        for k, t in enumerate(attrs.outputs):
            if attrs.folded:
                root[t] = None
            elif k == 0 and attrs.alias and attrs.inputs:
                src = attrs.inputs[0]
                root[t] = root.get(src) if src in producer else None
            else:
                root[t] = t
    members: dict[str, list[str]] = {}
    for t, r in root.items():
        if r is not None:
            members.setdefault(r, []).append(t)

    always_kept: set[str] = set()
    classes: list[StorageClass] = []
    class_of: dict[str, int] = {}
    for r, ts in members.items():
        p = producer[r]
        read_anywhere = any(t in fwd_readers or t in bwd_pos for t in ts)
        unread = not read_anywhere
        if p not in index or any(t in forced or t in kept_outputs for t in ts) or unread:
            always_kept.update(t for t in ts if producer[t] in index)
            continue
        readers = 0
        for t in ts:
            for c in fwd_readers.get(t, ()):
                if c in index:
                    readers |= 1 << index[c]
        positions = [j for t in ts for j in bwd_pos.get(t, ())]
        cls = StorageClass(index[p], int(tensor_bytes.get(r, 0)), tuple(ts), readers, bool(positions))
        if positions:
            cls.first, cls.last = min(positions), max(positions)
        for t in ts:
            class_of[t] = len(classes)
        classes.append(cls)
    for op in ops:                       # D outputs outside every class (rooted outside D)
        for t in nodes[op].outputs:
            if t not in class_of:
                always_kept.add(t)

    n = len(ops)
    preds = [0] * n
    outputs: list[list[tuple[int, bool, int]]] = [[] for _ in range(n)]
    rec_bufs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    end = len(bwd_order) - 1
    classes_of: list[list[int]] = [[] for _ in range(n)]
    for c, cls in enumerate(classes):
        classes_of[cls.root].append(c)
    for i, op in enumerate(ops):
        attrs = nodes[op]
        for t in attrs.inputs:
            if t in producer and producer[t] in index:
                preds[i] |= 1 << index[producer[t]]
        for k, t in enumerate(attrs.outputs):
            aliased = k == 0 and attrs.alias and attrs.inputs
            if not aliased and not (t in droppable and t not in fwd_readers and t not in bwd_pos):
                if t not in fwd_readers and t not in bwd_pos:      # a recomputed copy is never freed
                    rec_bufs[i].append((int(tensor_bytes.get(t, 0)), end))
                elif t in class_of and classes[class_of[t]].stashed:
                    rec_bufs[i].append((int(tensor_bytes.get(t, 0)), classes[class_of[t]].last))
            if t in class_of:
                dreaders = 0
                for c in fwd_readers.get(t, ()):
                    if c in index:
                        dreaders |= 1 << index[c]
                outputs[i].append((class_of[t], t in bwd_pos, dreaders))

    g, g_star = _plan_independent_live(graph, producer, root, class_of)
    model = Model(ops, preds, [float(nodes[op].seconds) for op in ops], outputs,
                  rec_bufs, classes, classes_of, g, g_star, frozenset(always_kept))
    table = [list(g)]
    k = 1
    while (1 << k) <= len(g):
        prev = table[-1]
        half = 1 << (k - 1)
        table.append([max(prev[j], prev[j + half]) for j in range(len(g) - (1 << k) + 1)])
        k += 1
    model._table = table
    return model


def _plan_independent_live(graph, producer, root, class_of) -> tuple[list[int], int]:
    """G(b) per backward position and the max over all steps of the plan-independent live
    bytes (the cost model's rules on forward-then-backward order, counting only buffers whose
    lifetime no plan changes: backward buffers and forward buffers not in a storage class)."""
    nodes = graph.ops
    tensor_bytes = graph.tensor_bytes
    resident = graph.resident
    kept = graph.kept
    droppable = graph.droppable
    order = list(graph.forward_order) + list(graph.backward_order)
    n_fwd = len(graph.forward_order)
    storage: dict[str, int] = {}
    born, last, nbytes, counted, keep, read = [], [], [], [], [], []
    for i, op in enumerate(order):
        attrs = nodes[op]
        for t in attrs.inputs:
            s = storage.get(t)
            if s is not None:
                last[s] = max(last[s], i)
                read[s] = True
        if attrs.folded:
            continue
        for k, t in enumerate(attrs.outputs):
            if k == 0 and attrs.alias and attrs.inputs:
                src = attrs.inputs[0]
                if src in storage:
                    s = storage[src]
                    storage[t] = s
                    last[s] = max(last[s], i)
                    if t in kept:
                        keep[s] = True
                    continue
                if src in resident or src in producer:
                    continue                  # aliases a resident or a plan-dependent buffer
            if t in class_of:
                continue                      # plan-dependent forward buffer
            s = len(born)
            storage[t] = s
            born.append(i)
            last.append(i)
            nbytes.append(int(tensor_bytes.get(t, 0)))
            counted.append(True)
            keep.append(t in kept)
            read.append(None if t in droppable else False)
    delta = [0] * (len(order) + 1)
    for s in range(len(born)):
        if read[s] is None:
            continue
        delta[born[s]] += nbytes[s]
        if keep[s] or not read[s]:
            continue
        delta[last[s] + 1] -= nbytes[s]
    live = 0
    g, g_star = [], 0
    for i, op in enumerate(order):
        live += delta[i]
        running = live + int(nodes[op].workspace_bytes or 0)
        g_star = max(g_star, running)
        if i >= n_fwd:
            g.append(running)
    return g, g_star


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass
class Stage:
    kept: int          # bytes of the kept classes rooted in the segment
    rec_seconds: float
    local: int         # stage peak minus the kept bytes of the earlier segments
    rec_ops: int       # bitmask


def stage(model: Model, lower: int, upper: int, stored: bool = False) -> Stage:
    """Costs of segment upper - lower (recomputed, or the stored segment when `stored`)."""
    key = (lower, upper, stored)
    cached = model._stages.get(key)
    if cached is None:
        cached = model._stages[key] = _stage(model, lower, upper, stored)
    return cached


def _stage(model: Model, lower: int, upper: int, stored: bool) -> Stage:
    seg = upper & ~lower
    outside = model.full & ~upper
    kept_bytes = 0
    kept: set[int] = set()
    items: list[tuple[int, int]] = []
    lo, hi = -1, -1
    for i in _bits(seg):
        for c in model.classes_of[i]:
            cls = model.classes[c]
            if (cls.stashed if stored else cls.readers & outside):
                kept.add(c)
                kept_bytes += cls.nbytes
                if cls.stashed:
                    items.append((cls.nbytes, cls.last))
            if cls.stashed:
                lo = cls.first if lo < 0 else min(lo, cls.first)
                hi = max(hi, cls.last)
    rec = 0
    rec_seconds = 0.0
    if stored:
        lo, hi = 0, max(hi, 0)
    else:
        for i in sorted(_bits(seg), reverse=True):
            for c, by_backward, dreaders in model.outputs[i]:
                if c not in kept and (by_backward or dreaders & rec):
                    rec |= 1 << i
                    rec_seconds += model.seconds[i]
                    items.extend(model.rec_bufs[i])
                    break
    return Stage(kept_bytes, rec_seconds, model.window_peak(lo, hi, items), rec)


def is_lower_set(model: Model, mask: int) -> bool:
    return all(model.preds[i] & ~mask == 0 for i in _bits(mask))


def evaluate_chain(model: Model, chain) -> tuple[int, float, frozenset[str]]:
    """(model peak, model recompute seconds, kept tensors) of the strategy whose recomputed
    segments end at the lower sets `chain` (bitmasks or op-name sets, strictly increasing;
    the rest of D is stored). Written directly from the definitions, not with `stage`."""
    masks = []
    for lower in chain:
        if not isinstance(lower, int):
            lower = sum(1 << model.ops.index(op) for op in lower)
        masks.append(lower)
    n = model.n
    segment = [len(masks)] * n           # segment index of each op; len(masks) = stored
    for k in reversed(range(len(masks))):
        if not is_lower_set(model, masks[k]) or (k and masks[k - 1] & ~masks[k]) or \
                (k and masks[k - 1] == masks[k]) or masks[k] == 0:
            raise ValueError("not a strictly increasing chain of non-empty lower sets")
        for i in range(n):
            if masks[k] >> i & 1:
                segment[i] = k
    stored = len(masks)
    kept = set()
    for c, cls in enumerate(model.classes):
        s = segment[cls.root]
        later = any(segment[r] > s for r in range(n) if cls.readers >> r & 1)
        if later or (s == stored and cls.stashed):
            kept.add(c)
    recomputed = [False] * n
    for i in reversed(range(n)):
        if segment[i] == stored:
            continue
        for c, by_backward, dreaders in model.outputs[i]:
            if c in kept:
                continue
            if by_backward or any(recomputed[r] for r in range(n) if dreaders >> r & 1):
                recomputed[i] = True
    seconds = sum(model.seconds[i] for i in range(n) if recomputed[i])
    peak = model.g_star
    for k in range(stored + 1):
        before = sum(model.classes[c].nbytes for c in kept if segment[model.classes[c].root] < k)
        mine = [model.classes[c] for c in range(len(model.classes)) if segment[model.classes[c].root] == k]
        stashed = [cls for cls in mine if cls.stashed]
        if k == stored:
            lo, hi = 0, max([0] + [cls.last for cls in stashed])
        elif stashed:
            lo, hi = min(cls.first for cls in stashed), max(cls.last for cls in stashed)
        else:
            lo, hi = 0, -1
        live = []   # (bytes, last) held during the stage
        for c in kept:
            cls = model.classes[c]
            if segment[cls.root] == k and cls.stashed:
                live.append((cls.nbytes, cls.last))
        for i in range(n):
            if recomputed[i] and segment[i] == k:
                live.extend(model.rec_bufs[i])
        local = 0
        for b in range(lo, hi + 1):
            local = max(local, model.g[b] + sum(nbytes for nbytes, last in live if last >= b))
        peak = max(peak, before + local)
    tensors = set(model.always_kept)
    for c in kept:
        tensors.update(model.classes[c].members)
    return peak, seconds, frozenset(tensors)


def kept_tensors(model: Model, kept_classes) -> frozenset[str]:
    tensors = set(model.always_kept)
    for c in kept_classes:
        tensors.update(model.classes[c].members)
    return frozenset(tensors)


# ----------------------------------------------------------------------------- lower sets


def lower_sets(model: Model, limit: int | None = None) -> list[int] | None:
    """All lower sets of D as bitmasks, by size; None when there are more than `limit`."""
    seen = {0}
    frontier = [0]
    n = model.n
    while frontier:
        nxt = []
        for lower in frontier:
            for i in range(n):
                if not lower >> i & 1 and model.preds[i] & ~lower == 0:
                    m = lower | (1 << i)
                    if m not in seen:
                        seen.add(m)
                        nxt.append(m)
                        if limit is not None and len(seen) > limit:
                            return None
        frontier = nxt
    return sorted(seen, key=lambda m: (bin(m).count("1"), m))


def closure_lower_sets(model: Model) -> list[int]:
    """{}, D and the ancestor closure of each op (the approximate DP's family)."""
    anc = [0] * model.n
    for i in range(model.n):
        anc[i] = 1 << i
        for j in _bits(model.preds[i]):
            anc[i] |= anc[j]
    family = {0, model.full} | set(anc)
    return sorted(family, key=lambda m: (bin(m).count("1"), m))


# ----------------------------------------------------------------------------- the DP


def _pareto(entries: list) -> list:
    """The entries (a, b, ...) not dominated in (a, b), a ascending (b strictly descending)."""
    entries.sort(key=lambda e: (e[0], e[1]))
    front = []
    for e in entries:
        if not front or e[1] < front[-1][1]:
            front.append(e)
    return front


def _push(fronts: list, k: int, entry) -> None:
    bucket = fronts[k]
    bucket.append(entry)
    if len(bucket) >= 4096 and len(bucket) & (len(bucket) - 1) == 0:   # prune now and then
        fronts[k] = _pareto(bucket)


# A lower set's entries waiting for it (arrays pushed by the lower sets before it) are pruned to
# their Pareto front once they hold this many (memory), and always before it is expanded.
_PENDING_PRUNE = 1 << 16


def _front_of(parts: list) -> tuple:
    """The entries of `parts` (tuples of equal-length arrays: kept, seconds, peak, parent lower
    set, parent index), in the order pushed, reduced to those not dominated in (kept, seconds):
    kept ascending, seconds strictly descending; of equal (kept, seconds) the first pushed (the
    list DP's `_pareto`, a stable sort)."""
    kept, seconds, peak, parent_k, parent_i = (np.concatenate(a) if len(parts) > 1 else a[0]
                                               for a in zip(*parts))
    order = np.lexsort((seconds, kept))          # stable: ties stay in the order pushed
    kept, seconds = kept[order], seconds[order]
    keep = np.empty(len(order), dtype=bool)
    keep[0] = True
    np.less(seconds[1:], np.minimum.accumulate(seconds)[:-1], out=keep[1:])
    order = order[keep]
    return kept[keep], seconds[keep], peak[order], parent_k[order], parent_i[order]


def solve_dp(model: Model, family: list[int], budget: int | None = None):
    """Least model time with model peak <= budget over chains drawn from `family`
    (budget None: least model peak, then least time at it). Returns (peak, seconds, chain) or
    None when no chain fits. Each lower set's Pareto front of (kept bytes, seconds) is held as
    arrays (kept, seconds, peak so far, and where each entry came from), and a transition
    extends the prefix of a front that fits the budget at once."""
    if budget is None:
        best_peak = _least_peak(model, family)
        return solve_dp(model, family, best_peak)
    if model.g_star > budget:
        return None
    full = model.full
    pending: list = [[] for _ in family]
    pending_sizes = [0] * len(family)
    pending[0] = [(np.zeros(1, np.int64), np.zeros(1), np.full(1, model.g_star, np.int64),
                   np.full(1, -1, np.int64), np.full(1, -1, np.int64))]
    fronts: list = [None] * len(family)
    best = None                                   # (seconds, peak, lower set, index in its front)
    for k, lower in enumerate(family):
        if not pending[k]:
            continue
        kept, seconds, peak, _, _ = fronts[k] = _front_of(pending[k])
        pending[k] = None
        # close with the stored segment (the front is sorted by kept ascending)
        st = stage(model, lower, full, stored=True)
        fit = int(np.searchsorted(kept, budget - st.local, side="right"))
        if fit:
            closed = np.maximum(peak[:fit], kept[:fit] + st.local)
            j = int(np.lexsort((closed, seconds[:fit]))[0])     # least (seconds, peak), first of ties
            cand = (float(seconds[j]), int(closed[j]))
            if best is None or cand < best[:2]:
                best = (*cand, k, j)
        for k2 in range(k + 1, len(family)):
            upper = family[k2]
            if upper & lower != lower or upper == lower:
                continue
            st = stage(model, lower, upper)
            if st.local > budget:
                continue
            fit = int(np.searchsorted(kept, budget - st.local, side="right"))
            if not fit:
                continue
            head = kept[:fit]
            pending[k2].append((head + st.kept, seconds[:fit] + st.rec_seconds,
                                np.maximum(peak[:fit], head + st.local), np.full(fit, k, np.int64),
                                np.arange(fit, dtype=np.int64)))
            pending_sizes[k2] += fit
            if pending_sizes[k2] >= _PENDING_PRUNE:
                pending[k2] = [_front_of(pending[k2])]
                pending_sizes[k2] = len(pending[k2][0][0])
    if best is None:
        return None
    seconds, peak, k, j = best
    chain = []
    while k >= 0:
        chain.append(family[k])
        front = fronts[k]
        k, j = int(front[3][j]), int(front[4][j])
    chain = [m for m in reversed(chain) if m]
    return peak, seconds, chain


def _least_peak(model: Model, family: list[int]) -> int:
    """Least model peak over chains from `family`: Pareto fronts of (kept, peak so far)."""
    full = model.full
    fronts: list[list] = [[] for _ in family]
    fronts[0] = [(0, model.g_star)]
    best = None
    for k, lower in enumerate(family):
        if not fronts[k]:
            continue
        front = fronts[k] = _pareto(fronts[k])
        st = stage(model, lower, full, stored=True)
        for kept, peak in front:
            p = max(peak, kept + st.local)
            best = p if best is None else min(best, p)
        for k2 in range(k + 1, len(family)):
            upper = family[k2]
            if upper & lower != lower or upper == lower:
                continue
            st = stage(model, lower, upper)
            if best is not None and st.local >= best:
                continue
            for kept, peak in front:
                p = max(peak, kept + st.local)
                if best is not None and p >= best:
                    continue
                _push(fronts, k2, (kept + st.kept, p))
    return best


# ----------------------------------------------------------------------------- strategies


# per graph, per (exact, max_lower_sets): (model, lower sets, exact, least-peak result, its plan)
_LEAST: "weakref.WeakKeyDictionary[CostGraph, dict]" = weakref.WeakKeyDictionary()


def _plan_for(graph: CostGraph, model: Model, family: list[int], is_exact: bool, result, internal) -> Plan:
    peak, seconds, chain = result
    _, _, kept = evaluate_chain(model, chain)
    return make_plan(graph, "kusumoto", kept, model_peak_bytes=peak, model_recompute_seconds=seconds,
                     exact=is_exact, lower_sets=len(family), segments=len(chain), internal_budget_bytes=internal)


def _solve(graph: CostGraph, budget_bytes: int | None, exact: bool, max_lower_sets: int,
           max_rounds: int = 8) -> Plan:
    started = time.perf_counter()
    if not graph.stashed_tensors:
        # the backward reads no forward tensor: nothing is ever recomputed, every set is the
        # same plan (the model below needs a backward position)
        return make_plan(graph, "kusumoto", graph.candidate_checkpoints, exact=True,
                         search_seconds=time.perf_counter() - started)
    # what no budget changes (the model, its lower sets and stage costs, the least-peak chain)
    # is made once per graph: a step-time limit asks for several budgets on the same graph
    known = _LEAST.setdefault(graph, {})
    if (exact, max_lower_sets) not in known:
        model = build_model(graph)
        family = lower_sets(model, max_lower_sets) if exact else None
        is_exact = family is not None
        if family is None:
            family = closure_lower_sets(model)
        least = solve_dp(model, family, None)
        known[exact, max_lower_sets] = (model, family, is_exact, least, _plan_for(graph, model, family, is_exact,
                                                                                  least, None))
    model, family, is_exact, least, least_plan = known[exact, max_lower_sets]
    least_plan = dataclasses.replace(least_plan, notes=dict(least_plan.notes))

    def plan_for(result, internal):
        return _plan_for(graph, model, family, is_exact, result, internal)
    if budget_bytes is None:
        best = least_plan
    else:
        best = None
        internal = budget_bytes
        tried = [least_plan]
        rounds = 0
        for _ in range(max_rounds):
            result = solve_dp(model, family, internal)
            if result is None:
                break
            plan = plan_for(result, internal)
            tried.append(plan)
            if plan.peak_bytes <= budget_bytes:
                best = plan
                break
            # the model under-estimated this plan: lower the internal budget by the excess,
            # doubling the step each round
            internal -= max(1, plan.peak_bytes - budget_bytes) * 2 ** rounds
            rounds += 1
            if internal < least[0]:
                break
        if best is None:
            fits = [p for p in tried if p.peak_bytes <= budget_bytes]
            best = min(fits, key=lambda p: p.recompute_seconds) if fits else \
                min(tried, key=lambda p: (p.peak_bytes, p.recompute_seconds))
    best.notes.update(search_seconds=time.perf_counter() - started, model_least_peak_bytes=least[0])
    return best


def kusumoto(graph: CostGraph, budget_bytes: int | None = None, *,
             max_lower_sets: int = DEFAULT_MAX_LOWER_SETS) -> Plan:
    """Exact lower-set DP when D has at most `max_lower_sets` lower sets, else the
    approximate DP (Plan.notes["exact"] says which). No budget: memory-centric."""
    return _solve(graph, budget_bytes, True, max_lower_sets)


def kusumoto_approx(graph: CostGraph, budget_bytes: int | None = None) -> Plan:
    """The approximate DP over the ancestor-closure lower sets."""
    return _solve(graph, budget_bytes, False, 0)
