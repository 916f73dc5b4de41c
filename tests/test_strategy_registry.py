"""The strategy registry's contract (graphopt/search/registry.py), on a small synthetic cost graph:
a budget reaches every strategy that takes one and is refused, with a message naming the ones
that can, by every strategy that cannot; a strategy's own options reach its solver; an unknown
name is refused naming the known ones. What the plans are worth is tested elsewhere
(tests/test_search.py, tests/test_oracles.py); this file is what mutation testing runs against
the registry."""
from __future__ import annotations

import pytest

from graphopt.errors import InvalidOptionError
from graphopt.search import DEFAULT_STRATEGY, STRATEGIES, get_strategy
from graphopt.search.registry import Strategy
from graphopt.search.store_all import store_all
from graphopt_zoo.synthetic import training_cost_graph

# the solvers whose papers have no budget (the registry's docs and each solver's signature)
NO_BUDGET = {"feng-huang", "chen-sqrt", "store-all"}


@pytest.fixture(scope="module")
def graph():
    return training_cost_graph(10, seed=3)


def test_the_registry_lists_each_strategy_under_its_own_name_and_auto_is_the_default():
    # the strategies in the registry's order (the order error messages name them in), each name
    # calling the solver of that name
    names = ["auto", "feng-huang", "kusumoto", "kusumoto-approx", "chain", "greedy", "chen-greedy", "chen-sqrt",
             "store-all", "milp"]
    assert {name: s.solve.__name__ for name, s in STRATEGIES.items()} == {n: n.replace("-", "_") for n in names}
    assert list(STRATEGIES) == names and all(isinstance(s, Strategy) for s in STRATEGIES.values())
    assert {name for name, s in STRATEGIES.items() if not s.takes_budget} == NO_BUDGET
    assert DEFAULT_STRATEGY == "auto" and STRATEGIES[DEFAULT_STRATEGY].takes_budget


@pytest.mark.parametrize("name", sorted(NO_BUDGET))
def test_a_budget_is_refused_naming_the_strategies_that_take_one(graph, name):
    strategy = STRATEGIES[name]
    with pytest.raises(InvalidOptionError) as refused:
        strategy(graph, budget_bytes=10 ** 6)
    message = str(refused.value)
    assert message.startswith(f"strategy {name!r} takes no memory budget ({strategy.description})"), message
    _, _, named = message.partition("; strategies that plan for a budget: ")
    assert named.split(", ") == [n for n in STRATEGIES if n not in NO_BUDGET], message
    with pytest.raises(InvalidOptionError):   # refused before any work, by the check alone
        strategy.check(0)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_without_a_budget_every_strategy_plans(graph, name):
    STRATEGIES[name].check(None)
    plan = STRATEGIES[name](graph)
    assert plan.peak_bytes <= store_all(graph).peak_bytes


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - NO_BUDGET))
def test_a_budget_reaches_the_strategy_that_takes_one(graph, name):
    """Without a budget these strategies plan for the least peak, which here needs recomputation;
    at a budget that keeping everything meets, the least recompute time whose peak fits is none."""
    strategy = STRATEGIES[name]
    loose = store_all(graph).peak_bytes
    assert strategy(graph).recompute_seconds > 0
    strategy.check(loose)
    plan = strategy(graph, budget_bytes=loose)
    assert plan.peak_bytes <= loose and plan.recompute_seconds == 0


@pytest.mark.parametrize("name,budget", [("store-all", None), ("chen-sqrt", None), ("greedy", None),
                                         ("greedy", 10 ** 6), ("milp", 10 ** 6)])
def test_an_option_the_solver_does_not_take_is_an_error_not_dropped(graph, name, budget):
    with pytest.raises(TypeError, match="no_such_option"):
        STRATEGIES[name](graph, budget_bytes=budget, no_such_option=1)


def test_a_solvers_own_options_reach_it(graph):
    """Each documented effort limit changes what the plan says about itself: Kusumoto's DP is
    approximate once its lower sets are capped at 0 (with and without a budget), Feng & Huang's
    search is no longer exact once its labels are capped at 1."""
    kusumoto, feng_huang = STRATEGIES["kusumoto"], STRATEGIES["feng-huang"]
    loose = store_all(graph).peak_bytes
    assert kusumoto(graph).exact and kusumoto(graph, budget_bytes=loose).exact
    assert not kusumoto(graph, max_lower_sets=0).exact
    assert not kusumoto(graph, budget_bytes=loose, max_lower_sets=0).exact
    assert feng_huang(graph).exact and not feng_huang(graph, max_labels=1).exact


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_get_strategy_finds_each_registered_strategy(name):
    assert get_strategy(name) is STRATEGIES[name]


@pytest.mark.parametrize("name", ["magic", "", "Auto", "feng_huang"])
def test_an_unknown_strategy_is_refused_naming_the_known_ones(name):
    with pytest.raises(InvalidOptionError) as refused:
        get_strategy(name)
    message = str(refused.value)
    assert message.startswith(f"unknown strategy {name!r} (known: ") and message.endswith(")"), message
    assert message[len(f"unknown strategy {name!r} (known: "):-1].split(", ") == list(STRATEGIES)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__   # no KeyError chained
