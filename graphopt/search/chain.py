"""`chain`: checkpoint selection on layer chains, after Hong, Tsai, Wang, Liu and Wu,
"GPU Memory Usage Optimization for Backward Propagation in Deep Network Training"
(arXiv 2502.12499).

Source note. Only the paper's abstract could be found with the search tools (arXiv listing,
aggregator summaries); its full text, equations and pseudo-code were not available. What the
abstract states: (1) from the backprop equations, identify exactly which data each layer's
backward needs; (2) an O(n^3) dynamic program for the checkpoint subset with the least peak
memory; (3) an objective revised from real memory traces and an O(n)-time algorithm. Everything
below (the objective, both algorithms, the exactness argument) is derived here from that
description and from OUR cost model (graphopt.costmodel); it is not a transcription of the paper.

The abstract problem (pure numbers, no graph)
---------------------------------------------
A chain of layers 1..n; layer i reads x_{i-1} and writes x_i (x_0 is the chain's input, resident
or kept by someone else). Per layer (lists indexed 0..n, index 0 unused except ``a[0]``):

* ``a[i]``     bytes of x_i (aliases already folded in: an op that shares its input's buffer
               belongs to the same layer and adds no bytes);
* ``need[i]``  whether the backward pass reads x_i (the backward of layer i reads its output,
               or the backward of layer i+1 reads its input; "only shapes" = not needed);
* ``f[i]``     extra bytes while layer i runs forward (kernel work buffer);
* ``g[i]``     bytes that are not forward activations and live while layer i's backward runs
               (the incoming and outgoing gradients, kernel work buffer);
* ``t[i]``     forward seconds of layer i (what recomputing it costs);
* ``forced[i]`` x_i must be kept (not recomputable, a graph output, read off the chain).

A checkpoint set C is a subset of positions 1..n-1 (containing every forced one). Positions 0
and n bound the first and last segment. Between consecutive boundaries s < e the segment
(s, e] is run forward once, then (during the backward pass) its needed tensors are recomputed
from x_s — layers s+1..M where M = the last needed position in (s, e) — and held until their
backward reader, as graphopt.search.plan's lazy schedule does.

Objective (peak bytes) J(C) = max over segments (s, e] of  P_s + seg(s, e), where
P_s = sum of a[c] for checkpoints c <= s (checkpoints before the segment are still alive,
later ones were freed by the backward of their segments) and

  seg(s, e) = max( FWD, STASH + G, REPEAK + G )
  FWD    = max_{s<i<=e} ( a[i-1]*[i-1>s] + a[i] + f[i] )            forward pass in the segment
  STASH  = sum_{s<m<e, need[m]} a[m] + a[e]*need[e]                  recomputed data held, plus x_e
  REPEAK = max_{s<k<=M} ( sum_{s<m<k, need[m]} a[m]
                          + a[k-1]*[k-1>s and not need[k-1]] + a[k] + f[k] )  re-forward transient
  G      = max_{s<j<=e} g[j]                                          gradients alive

i.e. "kept checkpoint bytes + the largest segment re-forward + the gradients alive". The
forward phase is included (FWD), so J bounds the whole step. It is conservative in two places:
the whole stash is charged against the largest gradient of the segment, and a needed x_e is
charged for the whole segment. It ignores x_e during the re-forward (REPEAK), which makes
``seg`` monotone: non-decreasing in e and non-increasing in s. J is a model; `chain` returns
plans evaluated by the one cost model (simulate), never by J.

Algorithms
----------
* `chain_dp` — O(n^3): D(s) = min_{s<e} max(seg(s,e), a[e] + D(e)) (D(n) = 0, e may not skip
  a forced position), each seg(s, e) computed from scratch in O(n). Exact: segments after s
  see P = P_s + (checkpoints in (s, segment start]), so P_s factors out of every later term.
* `chain_linear` — O(n) per probe: for a peak bound B, F(e) = least checkpoint bytes P_e of a
  prefix ending with a checkpoint at e whose segments all fit B. Only P_e matters for the rest
  of the chain, so F(e) = a[e] + min{F(s) : F(s) + seg(s, e) <= B}. Keep candidates s in a
  deque with F increasing along it: a later s with F no larger dominates an earlier one forever
  (seg non-increasing in s), and once F(s) + seg(s, e) > B it stays so for every later e (seg
  non-decreasing in e), so the front is popped for good. Each position enters and leaves once;
  seg(s, e) is O(1) from prefix sums and sparse-table range maxima. Feasibility is monotone in
  B, so a binary search on the integer B gives the exact optimum: O(n log n) to build the
  tables and O(n log(sum bytes)) in all (at most ~64 probes). It equals `chain_dp` exactly
  whenever ``seg`` is monotone, which the objective above guarantees by construction
  (tested against `chain_dp` and `chain_brute_force` on random chains).
* `chain_budget` — least recompute seconds with J <= B: forward Pareto sets of (P_e, seconds),
  O(n^2 * front) (exact; fronts are small in practice; ``max_front`` caps them for very
  long chains, then it is a heuristic).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ..costgraph import CostGraph

from .plan import Plan, make_plan

INF = float("inf")


@dataclass
class ChainCosts:
    """Abstract costs of a chain of ``n`` layers (lists of length n + 1, see module doc)."""
    a: list
    need: list
    f: list
    g: list
    t: list = None
    forced: list = None

    def __post_init__(self):
        n = len(self.a) - 1
        if self.t is None:
            self.t = [0.0] * (n + 1)
        if self.forced is None:
            self.forced = [False] * (n + 1)
        for name in ("need", "f", "g", "t", "forced"):
            if len(getattr(self, name)) != n + 1:
                raise ValueError(f"{name} must have {n + 1} entries")

    @property
    def n(self) -> int:
        return len(self.a) - 1


# ---------------------------------------------------------------- objective, by definition

def segment_cost(c: ChainCosts, s: int, e: int) -> float:
    """seg(s, e) of the module docstring, straight from the definition (O(e - s))."""
    a, need, f, g = c.a, c.need, c.f, c.g
    fwd = max((a[i - 1] if i - 1 > s else 0) + a[i] + f[i] for i in range(s + 1, e + 1))
    held = [m for m in range(s + 1, e) if need[m]]
    stash = sum(a[m] for m in held) + (a[e] if need[e] else 0)
    repeak = 0
    if held:
        last = held[-1]
        for k in range(s + 1, last + 1):
            kept = sum(a[m] for m in range(s + 1, k) if need[m])
            prev = a[k - 1] if (k - 1 > s and not need[k - 1]) else 0
            repeak = max(repeak, kept + prev + a[k] + f[k])
    grads = max(g[j] for j in range(s + 1, e + 1))
    return max(fwd, max(stash, repeak) + grads)


def segment_recompute(c: ChainCosts, s: int, e: int) -> float:
    """Seconds of re-running layers s+1..M, M the last needed position in (s, e)."""
    last = max((m for m in range(s + 1, e) if c.need[m]), default=None)
    return 0.0 if last is None else sum(c.t[k] for k in range(s + 1, last + 1))


def _boundaries(c: ChainCosts, checkpoints) -> list[int]:
    cps = sorted(set(checkpoints))
    if any(not 0 < x < c.n for x in cps):
        raise ValueError("checkpoints are positions 1..n-1")
    missing = [i for i in range(1, c.n) if c.forced[i] and i not in cps]
    if missing:
        raise ValueError(f"forced positions not kept: {missing}")
    return [0] + cps + [c.n]


def chain_objective(c: ChainCosts, checkpoints) -> float:
    """J(C): the peak the abstract model predicts for checkpoint positions `checkpoints`."""
    if c.n == 0:
        return 0
    bounds = _boundaries(c, checkpoints)
    peak, kept = 0, 0
    for s, e in zip(bounds, bounds[1:]):
        peak = max(peak, kept + segment_cost(c, s, e))
        kept += c.a[e]
    return peak


def chain_recompute_seconds(c: ChainCosts, checkpoints) -> float:
    if c.n == 0:
        return 0.0
    bounds = _boundaries(c, checkpoints)
    return sum(segment_recompute(c, s, e) for s, e in zip(bounds, bounds[1:]))


def chain_brute_force(c: ChainCosts) -> tuple[float, tuple[int, ...]]:
    """Least J over all checkpoint subsets (2^free; for tests)."""
    if c.n == 0:
        return 0, ()
    forced = [i for i in range(1, c.n) if c.forced[i]]
    free = [i for i in range(1, c.n) if not c.forced[i]]
    best = (INF, ())
    for r in range(len(free) + 1):
        for subset in itertools.combinations(free, r):
            cps = tuple(sorted(forced + list(subset)))
            value = chain_objective(c, cps)
            if value < best[0]:
                best = (value, cps)
    return best


# ---------------------------------------------------------------- O(n^3) dynamic program

def chain_dp(c: ChainCosts) -> tuple[float, tuple[int, ...]]:
    """Least J and a checkpoint set achieving it: O(n^2) pairs, seg from scratch in O(n)."""
    n = c.n
    if n == 0:
        return 0, ()
    best = [INF] * (n + 1)
    nxt = [n] * (n + 1)
    best[n] = 0
    for s in range(n - 1, -1, -1):
        for e in range(s + 1, n + 1):
            value = segment_cost(c, s, e)
            if e < n:
                value = max(value, c.a[e] + best[e])
            if value < best[s]:
                best[s], nxt[s] = value, e
            if e < n and c.forced[e]:
                break                      # a segment cannot run past a forced checkpoint
    cps, s = [], 0
    while nxt[s] < n:
        s = nxt[s]
        cps.append(s)
    return best[0], tuple(cps)


# ---------------------------------------------------------------- O(n) probes, exact optimum

class _RangeMax:
    """Sparse table: max of values[lo..hi] (inclusive) in O(1); -inf for an empty range."""

    def __init__(self, values):
        self.table = [list(values)]
        k = 1
        while 2 * k <= len(values):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
            k *= 2

    def __call__(self, lo, hi):
        if hi < lo:
            return -INF
        level = (hi - lo + 1).bit_length() - 1
        row = self.table[level]
        return max(row[lo], row[hi - (1 << level) + 1])


class _FastSegments:
    """seg(s, e) in O(1) after O(n log n) preprocessing (same values as `segment_cost`)."""

    def __init__(self, c: ChainCosts):
        n, a, need, f = c.n, c.a, c.need, c.f
        self.c = c
        S = [0] * (n + 1)                   # S[k] = sum of needed a[m], m <= k (m >= 1)
        last_need = [0] * (n + 1)           # largest needed m <= k (0: none)
        for k in range(1, n + 1):
            S[k] = S[k - 1] + (a[k] if need[k] else 0)
            last_need[k] = k if need[k] else last_need[k - 1]
        self.S, self.last_need = S, last_need
        h = [-INF] * (n + 1)
        q = [-INF] * (n + 1)
        for i in range(2, n + 1):
            h[i] = a[i - 1] + a[i] + f[i]
            q[i] = S[i - 1] + (0 if need[i - 1] else a[i - 1]) + a[i] + f[i]
        self.fwd = _RangeMax(h)
        self.re = _RangeMax(q)
        self.grad = _RangeMax([-INF] + list(c.g[1:]))

    def __call__(self, s, e):
        c, S = self.c, self.S
        a, f = c.a, c.f
        first = a[s + 1] + f[s + 1]
        fwd = max(first, self.fwd(s + 2, e))
        stash = S[e - 1] - S[s] + (a[e] if c.need[e] else 0)
        last = self.last_need[e - 1]
        repeak = 0
        if last > s:
            repeak = max(first, self.re(s + 2, last) - S[s])
        return max(fwd, max(stash, repeak) + self.grad(s + 1, e))


def _probe(c: ChainCosts, seg, bound):
    """Checkpoints of a set with J <= bound and least checkpoint bytes, or None (O(n))."""
    n = c.n
    F = [INF] * (n + 1)
    parent = [-1] * (n + 1)
    F[0] = 0
    deque = [0]
    head = 0
    for e in range(1, n + 1):
        while head < len(deque) and F[deque[head]] + seg(deque[head], e) > bound:
            head += 1
        if head == len(deque):
            if e == n or c.forced[e]:
                return None                 # nothing can reach the end / a forced position
            continue
        s = deque[head]
        if e == n:
            parent[n] = s
            break
        F[e] = c.a[e] + F[s]
        parent[e] = s
        if c.forced[e]:
            deque, head = [e], 0            # no later segment may start before e
            continue
        while len(deque) > head and F[deque[-1]] >= F[e]:
            deque.pop()
        deque.append(e)
    cps, x = [], parent[n]
    while x > 0:
        cps.append(x)
        x = parent[x]
    return tuple(reversed(cps))


def chain_linear(c: ChainCosts) -> tuple[float, tuple[int, ...]]:
    """Least J (integer bytes) by binary search on O(n) feasibility probes (module doc)."""
    n = c.n
    if n == 0:
        return 0, ()
    seg = _FastSegments(c)
    forced = tuple(i for i in range(1, n) if c.forced[i])
    hi_set = tuple(range(1, n))
    hi = chain_objective(c, hi_set) if n < 64 else _objective_fast(c, seg, hi_set)
    lo_set = forced
    lo_value = _objective_fast(c, seg, lo_set)
    hi, best = (lo_value, lo_set) if lo_value <= hi else (hi, hi_set)
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        found = _probe(c, seg, mid)
        if found is None:
            lo = mid + 1
        else:
            hi, best = _objective_fast(c, seg, found), found
    return hi, best


def _objective_fast(c, seg, checkpoints):
    bounds = [0] + sorted(checkpoints) + [c.n]
    peak, kept = 0, 0
    for s, e in zip(bounds, bounds[1:]):
        peak = max(peak, kept + seg(s, e))
        kept += c.a[e]
    return peak


# ---------------------------------------------------------------- least time under a bound

def chain_budget(c: ChainCosts, bound, max_front: int | None = None):
    """Least recompute seconds over checkpoint sets with J <= bound: (seconds, checkpoints),
    or None if no set fits. Exact unless ``max_front`` truncates the Pareto sets."""
    n = c.n
    if n == 0:
        return 0.0, ()
    seg = _FastSegments(c)
    rec_prefix = [0.0] * (n + 1)
    for k in range(1, n + 1):
        rec_prefix[k] = rec_prefix[k - 1] + c.t[k]
    last_need = seg.last_need
    # front[e]: list of (P_e, seconds, parent e', index in front[e']) Pareto-optimal
    front: list[list] = [[] for _ in range(n + 1)]
    front[0] = [(0, 0.0, -1, -1)]
    lowest = [INF] * (n + 1)
    lowest[0] = 0
    start = 0                                  # segments may not start before a forced position
    for e in range(1, n + 1):
        cands = []
        for s in range(e - 1, start - 1, -1):
            cost = seg(s, e)
            if cost > bound:
                break                           # seg grows as s moves left: none fit further
            if not front[s] or lowest[s] + cost > bound:
                continue
            last = last_need[e - 1]
            rec = rec_prefix[last] - rec_prefix[s] if last > s else 0.0
            add = c.a[e] if e < n else 0
            for idx, (P, sec, _, _) in enumerate(front[s]):
                if P + cost > bound:
                    break                       # front sorted by P ascending
                cands.append((P + add, sec + rec, s, idx))
        cands.sort(key=lambda x: (x[0], x[1]))
        pareto, best_sec = [], INF
        for item in cands:
            if item[1] < best_sec - 1e-15:
                pareto.append(item)
                best_sec = item[1]
        if max_front and len(pareto) > max_front:
            step = (len(pareto) - 1) / (max_front - 1)
            pareto = [pareto[round(i * step)] for i in range(max_front)]
        front[e] = pareto
        lowest[e] = pareto[0][0] if pareto else INF
        if e < n and c.forced[e]:
            if not pareto:
                return None
            start = e
    if not front[n]:
        return None
    end = min(front[n], key=lambda x: x[1])
    cps, (_, sec, s, idx) = [], end
    while s > 0:
        cps.append(s)
        _, _, s, idx = front[s][idx]
    return sec, tuple(reversed(cps))


# ---------------------------------------------------------------- our cost graph

def _effective_forward(graph: CostGraph):
    nodes = graph.ops
    order = [op for op in graph.forward_order if not nodes[op].folded]
    resident = set(graph.resident)
    for op in graph.forward_order:
        if nodes[op].folded:
            resident.update(nodes[op].outputs)
    return order, resident


def _layers(graph: CostGraph):
    """Forward ops grouped into layers: an aliasing op joins the op whose output it aliases
    when that op is the previous layer's last op (same buffer, no new bytes)."""
    nodes = graph.ops
    order, resident = _effective_forward(graph)
    layers: list[list[str]] = []
    for op in order:
        attrs = nodes[op]
        if (layers and attrs.alias and attrs.inputs
                and attrs.inputs[0] in nodes[layers[-1][-1]].outputs):
            layers[-1].append(op)
        else:
            layers.append([op])
    return layers, resident


def _layer_io(graph, layers, resident):
    nodes = graph.ops
    outputs = [set(t for op in layer for t in nodes[op].outputs) for layer in layers]
    inputs = [set(t for op in layer for t in nodes[op].inputs if t not in resident) - outputs[i]
              for i, layer in enumerate(layers)]
    producer = {}
    for i, outs in enumerate(outputs):
        for t in outs:
            producer[t] = i
    readers: dict[int, set[int]] = {i: set() for i in range(len(layers))}
    for j, ins in enumerate(inputs):
        for t in ins:
            if t in producer:
                readers[producer[t]].add(j)
    return outputs, inputs, producer, readers


def chain_segments(graph: CostGraph) -> list[list[str]]:
    """Maximal chain runs of the forward order (folded ops left out): consecutive layers where
    each layer reads, besides resident tensors, only the previous layer's outputs, and those
    outputs are read by no other forward op. Aliasing ops are part of their input's layer.
    The runs partition the non-folded forward ops, in order (a run may be a single layer)."""
    layers, resident = _layers(graph)
    if not layers:
        return []
    outputs, inputs, producer, readers = _layer_io(graph, layers, resident)
    runs = [list(layers[0])]
    for j in range(1, len(layers)):
        i = j - 1
        linked = (inputs[j] and inputs[j] <= outputs[i] and readers[i] == {j})
        if linked:
            runs[-1].extend(layers[j])
        else:
            runs.append(list(layers[j]))
    return runs


def chain_costs(graph: CostGraph):
    """The whole forward order as one abstract chain (see module doc) and, per position,
    the candidate tensors that keeping it means. A position may be left out only if its
    layer's outputs are candidates (or free) and are read in the forward pass by the next
    layer alone: a chain link, slightly relaxed — the next layer may also read kept tensors.
    Every other position is forced (kept), so non-chain regions are stored whole."""
    nodes = graph.ops
    tensor_bytes = graph.tensor_bytes
    layers, resident = _layers(graph)
    outputs, inputs, producer, readers = _layer_io(graph, layers, resident)
    forced_t = graph.forced_checkpoints
    candidates = set(graph.candidate_checkpoints)
    stashed = graph.stashed_tensors
    n = len(layers)
    a, need, f, t, forced, g = ([0] * (n + 1) for _ in range(6))
    a = [0] * (n + 1)
    tensors: list[list[str]] = [[] for _ in range(n + 1)]
    for p, layer in enumerate(layers, start=1):
        nbytes = 0
        for op in layer:
            attrs = nodes[op]
            for k, tensor in enumerate(attrs.outputs):
                if k == 0 and attrs.alias and attrs.inputs:
                    continue
                nbytes += int(tensor_bytes.get(tensor, 0))
        a[p] = nbytes
        need[p] = bool(outputs[p - 1] & stashed)
        f[p] = max(int(nodes[op].workspace_bytes or 0) for op in layer)
        t[p] = sum(float(nodes[op].seconds) for op in layer)
        tensors[p] = [x for x in sorted(outputs[p - 1]) if x in candidates]
        forced[p] = bool(outputs[p - 1] & forced_t) or not readers[p - 1] <= {p}
    # gradients alive at layer p's backward: in and out (the shapes of x_p and x_{p-1}) plus
    # the kept backward outputs (weight gradients) written before it, which pile up to the end
    backward = graph.backward_order
    kept = graph.kept
    first_reader: dict[str, int] = {}
    root: dict[str, tuple[int, str]] = {}      # backward tensor -> (position, buffer) it lives in
    for k, op in enumerate(backward):
        attrs = nodes[op]
        for x in attrs.inputs:
            first_reader.setdefault(x, k)
        for j, x in enumerate(attrs.outputs):
            if j == 0 and attrs.alias and attrs.inputs and attrs.inputs[0] in root:
                root[x] = root[attrs.inputs[0]]
            else:
                root[x] = (k, x)
    births = [0] * (len(backward) + 1)
    for k, buffer in {root[x] for x in kept if x in root}:
        births[k + 1] += int(tensor_bytes.get(buffer, 0))
    piled = list(itertools.accumulate(births))
    position = 0
    for p in range(n, 0, -1):
        reads = [first_reader[x] for x in outputs[p - 1] | (outputs[p - 2] if p > 1 else set())
                 if x in first_reader]
        position = max([position] + reads)
        g[p] = a[p] + a[p - 1] + piled[position]
    forced[n] = False
    return ChainCosts(a, [bool(x) for x in need], f, g, t, [bool(x) for x in forced]), tensors


def _checkpoint_tensors(graph, costs, tensors, positions):
    keep = set(graph.candidate_checkpoints)
    chosen = set(positions)
    for p in range(1, costs.n):
        if not costs.forced[p] and p not in chosen:
            keep.difference_update(tensors[p])
    return keep


def _plan_objective(plan: Plan, budget_bytes):
    if budget_bytes is None:
        return (plan.peak_bytes, plan.recompute_seconds)
    return (max(0, plan.peak_bytes - budget_bytes), plan.recompute_seconds, plan.peak_bytes)


def chain(graph: CostGraph, budget_bytes: int | None = None, *, bounds: int = 8,
          max_front: int | None = None) -> Plan:
    """Chain checkpointing on our cost graph.

    Builds the abstract chain of the whole forward order (`chain_costs`: non-chain positions
    forced) and finds the least model peak B* with `chain_linear`. Then the least-recompute
    sets under a few model bounds (`chain_budget`): without a budget, bounds from B* up to
    2 B*; with one, bounds around the budget scaled by (model peak / cost-model peak) of the
    B* plan. Each distinct set becomes a plan evaluated by the cost model, store-all among
    them; returned: the least cost-model peak (ties: least recompute), or with a budget, the
    least recompute seconds whose peak fits (else the least peak). ``max_front`` (default:
    64, less on long chains) caps the Pareto sets of `chain_budget`."""
    started = time.perf_counter()
    costs, tensors = chain_costs(graph)
    n = costs.n
    free = sum(1 for p in range(1, n) if not costs.forced[p])
    if max_front is None:
        max_front = max(4, min(64, 12800 // max(1, n)))
    plans: dict[frozenset, Plan] = {}

    def consider(positions, **notes):
        keep = frozenset(_checkpoint_tensors(graph, costs, tensors, positions))
        if keep not in plans:
            plans[keep] = make_plan(graph, "chain", keep, **notes)
        return plans[keep]

    t0 = time.perf_counter()
    model_peak, positions = chain_linear(costs)
    linear_seconds = time.perf_counter() - t0
    first = consider(positions, model_peak=model_peak)
    all_free = tuple(range(1, n))
    consider(all_free)
    top = _objective_fast(costs, _FastSegments(costs), all_free) if n else 0
    levels: set[int] = set()
    if free and top > model_peak:
        if budget_bytes is None:
            high = min(top, 2 * model_peak)
            levels = {round(model_peak + (high - model_peak) * (k / bounds) ** 2)
                      for k in range(bounds + 1)}
        else:
            target = budget_bytes * model_peak / max(1, first.peak_bytes)
            levels = {round(target * r) for r in (0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25)}
            levels = {min(top, max(model_peak, x)) for x in levels} | {model_peak}
    for level in sorted(levels):
        found = chain_budget(costs, level, max_front=max_front)
        if found is not None:
            consider(found[1], model_peak=level)
    best = min(plans.values(), key=lambda p: _plan_objective(p, budget_bytes))
    # without a budget: optimal under the chain model when it is a plan of the least model peak
    best.notes.update(exact=budget_bytes is None and best.notes.get("model_peak") == model_peak,
                      chain_positions=n, free_positions=free, model_peak=model_peak,
                      linear_seconds=linear_seconds, evaluated_plans=len(plans),
                      search_seconds=time.perf_counter() - started)
    return best
