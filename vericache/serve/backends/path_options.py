"""The paths a request may take now (`mode: auto`), each on the worker placement gave it, with
what its price depends on there (path_costs.py `PathOption`): the worker's load and the prefixes
it decodes, its co-runners, the link, and the tokens whose KV it keeps from a finished turn, as
the coordinator's handles (handles.py) know them."""

from __future__ import annotations

from vericache.engine.link import LinkSpec
from vericache.scheduler.path_choice import ServingPath
from vericache.serve.backends.co_runners import busy_co_runners, started_beside
from vericache.serve.backends.path_costs import PathOption


def path_options(
    verifier, drafter, workers: list, link: LinkSpec, prefix_id: str, after_prefix: tuple[int, ...]
) -> list[PathOption]:
    """FULL_LOCAL on `verifier`; VERICACHE with `drafter` beside it; full decoding on `drafter`,
    over its host tier where it is warm (FULL_WARM). Either worker may be None (none to place
    on). `link` joins them; `workers` are all the coordinator's; `after_prefix` is the prompt
    after the prefix, whose kept turns spare its prefill."""
    options = []
    if verifier is not None:
        at_verifier = verifier.turns.reusable(prefix_id, after_prefix)
        options.append(PathOption(
            ServingPath.FULL_LOCAL, verifier.name, _paced(verifier), reused=at_verifier,
            co_runners=busy_co_runners(verifier, workers),
            started_beside=started_beside([verifier], workers),
            **_batch_prefixes(verifier, prefix_id),
        ))  # fmt: skip
    if drafter is None:
        return options
    warm = prefix_id in drafter.warm_prefixes
    at_drafter = drafter.turns.reusable(prefix_id, after_prefix)
    beside_drafter = {
        "co_runners": busy_co_runners(drafter, workers),
        **_batch_prefixes(drafter, prefix_id),
    }
    if verifier is not None:  # a warm node verifies its rounds itself
        computing = [drafter] if warm else [drafter, verifier]
        options.append(PathOption(
            ServingPath.VERICACHE, drafter.name, _paced(drafter), _paced(verifier), warm, link,
            at_drafter if warm else at_verifier, started_beside=started_beside(computing, workers),
            **beside_drafter,
        ))  # fmt: skip
    options.append(PathOption(
        ServingPath.FULL_WARM if warm else ServingPath.FULL_REMOTE, drafter.name,
        _paced(drafter), link=link, reused=at_drafter,
        started_beside=started_beside([drafter], workers),
        holds_prefix=prefix_id in drafter.full_prefixes, **beside_drafter,
    ))  # fmt: skip
    return options


def _paced(worker) -> int:
    """Requests whose tokens come at the worker's pace now (VERICACHE's: its drafter's)."""
    return worker.decoding.count


def _batch_prefixes(worker, prefix_id: str) -> dict[str, int]:
    """Of the requests the worker paces now: those over `prefix_id`, and the other prefixes the
    rest decode over (PathOption's `same_prefix`, `other_prefixes`)."""
    prefixes = worker.paced_prefixes
    others = sum(1 for other in prefixes if other != prefix_id)
    return {"same_prefix": prefixes[prefix_id], "other_prefixes": others}
