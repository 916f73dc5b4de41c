"""`milp`: the exact MILP of kusumoto's model, solved with HiGHS (small graphs; a test oracle).

It solves exactly the problem of `kusumoto`'s exact DP (see graphopt/search/kusumoto.py for
the model): the same plan space (chains of lower sets of D, the recomputable forward ops),
the same kept tensors, recomputation, stage memory and time, so that both give the same
optimal objective. Checkmate-style (Jain et al., MLSys 2020): binary variables per stage and
op, memory constraints per stage and backward step.

Variables (S = |D| stages: a chain of at most |D| recomputed segments; stages may repeat)
- x[s,v] in {0,1}: op v is in the lower set L_s (s = 1..S; L_0 = {}). seg[s,v] =
  x[s,v] - x[s-1,v] (v in the s-th recomputed segment); stored[v] = 1 - x[S,v].
  x[s-1,v] <= x[s,v] (a chain), x[s,v] <= x[s,u] for u -> v (lower sets); symmetry
  breaking: the empty stages come last (sum_v seg[s+1,v] <= |D| sum_v seg[s,v]).
- keep[k] in {0,1} per storage class k rooted at op p: exactly "an op r of D reading k lies
  in a later segment, or p is stored and k is stashed":
      keep[k] >= x[s,p] - x[s,r] for every reader r and stage s, keep[k] >= 1 - x[S,p] (stashed k),
      keep[k] <= sum_{r,s} (x[s,p] - x[s,r]) + (1 - x[S,p] if stashed).
  (The upper bound keeps the plan space that of the DP: Checkmate may keep anything.)
- rec[v] in {0,1}: v is recomputed. rec[v] >= x[S,v] - keep[k] for an output of v in class k
  read by the backward, rec[v] >= rec[r] - keep[k] for an output read by r in D; rec[v] <= x[S,v].
  Minimizing time makes rec the least fixpoint, i.e. the lazy recomputation of `make_plan`.
- Products (continuous in [0,1], bounded below only, they only appear on the left of <= rows):
  kb[s,k] >= keep[k] + x[s,p] - 1 (kept and in L_s), ks[s,k] >= keep[k] + seg[s,p] - 1,
  rx[s,v] >= rec[v] + seg[s,v] - 1, and the stage window indicators
  A[s,b] >= seg[s,p] (first(k) <= b), Z[s,b] >= seg[s,p] (last(k) >= b), act[s,b] >= A + Z - 1.
- Memory, for each recomputed stage s and backward position b (M_b a big-M):
      sum_k bytes_k kb[s-1,k] + sum_{k: last(k)>=b} bytes_k ks[s,k]
        + sum_v sum_{bufs of v with last>=b} bytes rx[s,v] + G(b) - M_b (1 - act[s,b]) <= P
  and for the stored stage (active at b = 0 and wherever a stored stashed class is read later):
      sum_k bytes_k keep[k] - ... (only the stored classes' bytes depend on b) + G(b) <= P;
  P >= G*. Objective: with a budget, P <= budget and minimize sum_v seconds_v rec[v]; without,
  minimize P, then fix P at its optimum and minimize time (the DP's memory-centric order).

Checkmate's MILP (R, S, FREE per stage and op over the joint forward+backward graph in a fixed
order) allows any recomputation schedule, several copies and frees at any point; this one
only allows the DP's lower-set chains with single-level lazy recomputation, so its optimum is
kusumoto's, not Checkmate's (which can only be lower or equal under an exact memory model).
"""
from __future__ import annotations

import time

from ..costgraph import CostGraph
import numpy as np

from .kusumoto import Model, build_model, evaluate_chain
from .plan import Plan, make_plan


class _Builder:
    def __init__(self):
        self.lb, self.ub, self.cost, self.integer = [], [], [], []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def var(self, lb=0.0, ub=1.0, integer=False, cost=0.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.lb) - 1

    def row(self, terms: dict, lo=-np.inf, hi=np.inf):
        self.rows.append((lo, hi, terms))


def _add(terms: dict, var, coef):
    terms[var] = terms.get(var, 0.0) + coef


def _formulate(model: Model):
    n = model.n
    S = max(1, n)
    nb = len(model.g)
    B = _Builder()
    x = [[None] * n] + [[B.var(integer=True) for _ in range(n)] for _ in range(S)]
    for s in range(1, S + 1):
        for v in range(n):
            if s > 1:
                B.row({x[s - 1][v]: 1.0, x[s][v]: -1.0}, hi=0.0)
            for u in range(n):
                if model.preds[v] >> u & 1:
                    B.row({x[s][v]: 1.0, x[s][u]: -1.0}, hi=0.0)

    def seg_terms(s, v, coef, terms):  # coef * seg[s,v]
        _add(terms, x[s][v], coef)
        if s > 1:
            _add(terms, x[s - 1][v], -coef)
        return terms

    # symmetry: the empty stages come last (sum seg[s+1] <= n sum seg[s])
    for s in range(1, S):
        terms = {}
        for v in range(n):
            seg_terms(s + 1, v, 1.0, terms)
            seg_terms(s, v, -float(n), terms)
        B.row(terms, hi=0.0)

    classes = model.classes
    keep = [B.var(integer=True) for _ in classes]
    for k, cls in enumerate(classes):
        p = cls.root
        upper = {keep[k]: 1.0}
        const = 0.0
        for r in range(n):
            if cls.readers >> r & 1:
                for s in range(1, S + 1):
                    B.row({keep[k]: 1.0, x[s][p]: -1.0, x[s][r]: 1.0}, lo=0.0)
                    _add(upper, x[s][p], -1.0)
                    _add(upper, x[s][r], 1.0)
        if cls.stashed:
            B.row({keep[k]: 1.0, x[S][p]: 1.0}, lo=1.0)       # keep >= 1 - x[S,p]
            _add(upper, x[S][p], 1.0)                         # ... + (1 - x[S,p])
            const = 1.0
        B.row(upper, hi=const)
    rec = [B.var(integer=True, cost=model.seconds[v]) for v in range(n)]
    for v in range(n):
        B.row({rec[v]: 1.0, x[S][v]: -1.0}, hi=0.0)
        for c, by_backward, dreaders in model.outputs[v]:
            if by_backward:
                B.row({rec[v]: 1.0, x[S][v]: -1.0, keep[c]: 1.0}, lo=0.0)
            for r in range(n):
                if dreaders >> r & 1:
                    B.row({rec[v]: 1.0, rec[r]: -1.0, keep[c]: 1.0}, lo=0.0)

    peak = B.var(lb=float(model.g_star), ub=np.inf)
    total = sum(cls.nbytes for cls in classes) + sum(nb_ for bufs in model.rec_bufs for nb_, _ in bufs)
    kb = [[None] * len(classes)]
    for s in range(1, S + 1):
        row = []
        for k, cls in enumerate(classes):
            var = B.var()
            B.row({var: 1.0, keep[k]: -1.0, x[s][cls.root]: -1.0}, lo=-1.0)
            row.append(var)
        kb.append(row)
    stashed = [k for k, cls in enumerate(classes) if cls.stashed]
    with_bufs = [v for v in range(n) if model.rec_bufs[v]]
    for s in range(1, S + 1):
        ks = {}
        for k in stashed:
            ks[k] = B.var()
            B.row(seg_terms(s, classes[k].root, -1.0, {ks[k]: 1.0, keep[k]: -1.0}), lo=-1.0)
        rx = {}
        for v in with_bufs:
            rx[v] = B.var()
            B.row(seg_terms(s, v, -1.0, {rx[v]: 1.0, rec[v]: -1.0}), lo=-1.0)
        for b in range(nb):
            first_ok = [k for k in stashed if classes[k].first <= b]
            last_ok = [k for k in stashed if classes[k].last >= b]
            if not first_ok or not last_ok:
                continue
            a, z, act = B.var(), B.var(), B.var()
            for k in first_ok:
                B.row(seg_terms(s, classes[k].root, -1.0, {a: 1.0}), lo=0.0)
            for k in last_ok:
                B.row(seg_terms(s, classes[k].root, -1.0, {z: 1.0}), lo=0.0)
            B.row({act: 1.0, a: -1.0, z: -1.0}, lo=-1.0)
            big = float(total + model.g[b])
            terms = {peak: -1.0, act: big}
            if s > 1:
                for k in range(len(classes)):
                    _add(terms, kb[s - 1][k], float(classes[k].nbytes))
            for k in last_ok:
                _add(terms, ks[k], float(classes[k].nbytes))
            for v in with_bufs:
                nbytes = sum(by for by, last in model.rec_bufs[v] if last >= b)
                if nbytes:
                    _add(terms, rx[v], float(nbytes))
            B.row(terms, hi=big - float(model.g[b]))
    # the stored stage
    kst = {}
    for k in stashed:
        kst[k] = B.var()
        B.row({kst[k]: 1.0, keep[k]: -1.0, x[S][classes[k].root]: 1.0}, lo=0.0)  # >= keep - x[S,p]
    for b in range(max(nb, 1)):
        last_ok = [k for k in stashed if classes[k].last >= b]
        g = float(model.g[b]) if b < nb else 0.0
        terms = {peak: -1.0}
        for k in range(len(classes)):
            _add(terms, kb[S][k], float(classes[k].nbytes))
        for k in last_ok:
            _add(terms, kst[k], float(classes[k].nbytes))
        if b == 0:
            B.row(terms, hi=-g)
            continue
        if not last_ok:
            continue
        act = B.var()
        for k in last_ok:
            B.row({act: 1.0, x[S][classes[k].root]: 1.0}, lo=1.0)   # act >= stored[p]
        big = float(total + g)
        terms[act] = big
        B.row(terms, hi=big - g)
    return B, x, keep, rec, peak


def _solve(B: _Builder, time_limit: float, objective: str, peak: int):
    status, *rest = _solve_once(B, time_limit, objective, peak, True)
    if status == "Infeasible":
        # HiGHS 1.16's presolve has declared feasible instances of this model infeasible
        # (seen on a 10-op graph; the same model solves with presolve off or another seed)
        status, *rest = _solve_once(B, time_limit, objective, peak, False)
        if status != "Infeasible":
            status += " (presolve off)"
    return (status, *rest)


def _solve_once(B: _Builder, time_limit: float, objective: str, peak: int, presolve: bool):
    import highspy
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    if not presolve:
        h.setOptionValue("presolve", "off")
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 1e-12)
    h.setOptionValue("threads", 1)
    ncol = len(B.lb)
    cost = np.zeros(ncol) if objective == "peak" else np.array(B.cost, dtype=float)
    if objective == "peak":
        cost[peak] = 1.0
    h.addCols(ncol, cost, np.array(B.lb, dtype=float), np.array(B.ub, dtype=float), 0,
              np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([], dtype=float))
    ints = [j for j in range(ncol) if B.integer[j]]
    h.changeColsIntegrality(len(ints), np.array(ints, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * len(ints)))
    inf = h.getInfinity()
    lo = np.array([max(r[0], -inf) for r in B.rows], dtype=float)
    hi = np.array([min(r[1], inf) for r in B.rows], dtype=float)
    starts, index, value = [], [], []
    for _, _, terms in B.rows:
        starts.append(len(index))
        for j, c in terms.items():
            if c != 0.0:
                index.append(j)
                value.append(c)
    h.addRows(len(B.rows), lo, hi, len(index), np.array(starts, dtype=np.int32),
              np.array(index, dtype=np.int32), np.array(value, dtype=float))
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    has_solution = info.primal_solution_status == 2
    values = list(h.getSolution().col_value) if has_solution else None
    return status, (info.objective_function_value if has_solution else None), values, info.mip_gap


def milp(graph: CostGraph, budget_bytes: int | None = None, time_limit_seconds: float = 60.0) -> Plan:
    """Least recompute time with model peak <= budget (least model peak, then time, without)."""
    started = time.perf_counter()
    if not graph.stashed_tensors:     # nothing is ever recomputed: every set is the same plan
        return make_plan(graph, "milp", graph.candidate_checkpoints, exact=True, status="Optimal (trivial)")
    model = build_model(graph)
    B, x, keep, rec, peak = _formulate(model)
    notes = {"variables": len(B.lb), "constraints": len(B.rows)}
    if budget_bytes is None:
        status, objective, values, gap = _solve(B, time_limit_seconds, "peak", peak)
        notes.update(peak_status=status, peak_objective=objective, peak_gap=gap)
        if values is None:
            raise RuntimeError(f"milp: no solution ({status})")
        least = int(round(objective))
        B.ub[peak] = least + 0.5
        notes["model_least_peak_bytes"] = least
    else:
        B.ub[peak] = float(budget_bytes) + 0.5
    status, objective, values, gap = _solve(B, time_limit_seconds, "time", peak)
    notes.update(status=status, objective=objective, mip_gap=gap)
    if values is None:
        if budget_bytes is not None:   # no plan fits: the least-peak plan (the caller reports it)
            return milp(graph, None, time_limit_seconds)
        raise RuntimeError(f"milp: no solution ({status})")
    chain = []
    for s in range(1, len(x)):
        mask = sum(1 << v for v in range(model.n) if values[x[s][v]] > 0.5)
        if mask and (not chain or mask != chain[-1]):
            chain.append(mask)
    model_peak, model_seconds, kept = evaluate_chain(model, chain)
    notes.update(model_peak_bytes=model_peak, model_recompute_seconds=model_seconds,
                 milp_peak_bytes=values[peak], segments=len(chain), chain=chain,
                 solve_seconds=time.perf_counter() - started, exact=status.startswith("Optimal"))
    return make_plan(graph, "milp", kept, **notes)
