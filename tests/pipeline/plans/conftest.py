import pytest


@pytest.fixture(autouse=True)
def _plan_afresh():
    """auto's search is cached by its sizes and costs: each plan test plans again, so that what it
    checks is what the code does now (a mutation run forks its mutants from a process whose cache
    earlier tests filled, and a mutant of the search would otherwise never run)."""
    from brigade.pipeline.plans.generate import _search

    _search.cache_clear()
