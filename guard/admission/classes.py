"""A request's priority class and named objective, from its tenant's config and two headers.

- ``X-Priority-Class: critical|standard|sheddable`` picks a class among the tenant's ``priority_classes``
  (none configured: its lane's class only). Any other class is 403 ``priority_class_not_allowed``; a value
  that is no class is 400 naming the header.
- ``x-gateway-inference-objective: NAME`` (the Gateway API Inference Extension's header) selects one of the
  tenant's ``objectives``: its class and its ``slo`` stand in for the lane's. The operator set it, so its
  class is not limited by ``priority_classes``. An unknown name is 400 naming the header.
- With both, the objective's class stands and ``X-Priority-Class`` may only lower it (critical > standard >
  sheddable): asking for a higher one is 403 ``priority_class_not_allowed``.

Invariant: the class returned is the lane's, one in the tenant's ``priority_classes``, or a named
objective's (or lower than it). The class then decides what the lane's class decided before: the critical
band, lending and borrowing, shedding and the ``slo`` filter (guard/admission/dispatch.py, slo.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from multidict import istr

from guard.config import Lane, Slo, Tenant
from guard.errors import GuardError, Outcome

CLASS_HEADER = istr("X-Priority-Class")
OBJECTIVE_HEADER = istr("x-gateway-inference-objective")
RANK = {"sheddable": 0, "standard": 1, "critical": 2}


class Selection(NamedTuple):
    priority_class: str
    objective: str | None  # the named objective's name (None: the lane's objective)
    slo: Slo | None  # the latency objective the headers X-SLO-* may then tighten


def select(tenant: Tenant, lane: Lane, headers: Mapping[str, str]) -> Selection:
    """The request's class, named objective and SLO (see the module docstring); raises ``GuardError``."""
    asked, name = headers.get(CLASS_HEADER), headers.get(OBJECTIVE_HEADER)
    if asked is None and name is None:  # the usual case: one lookup each, nothing else
        return Selection(lane.priority_class, None, lane.slo)
    if asked is not None and asked not in RANK:
        raise GuardError(400, f"header X-Priority-Class: expected critical, standard or sheddable, got "
                         f"{asked[:32]!r}", param="X-Priority-Class", code="invalid_priority_class",
                         outcome=Outcome.REJECTED_INVALID)
    if name is not None:
        chosen = tenant.objectives.get(name)
        if chosen is None:
            raise GuardError(400, f"header x-gateway-inference-objective: no objective {name[:64]!r} for this "
                             "API key", param="x-gateway-inference-objective", code="unknown_objective",
                             outcome=Outcome.REJECTED_INVALID)
        if asked is not None and RANK[asked] > RANK[chosen.priority_class]:
            raise _not_allowed(asked, f"above its objective's class ({chosen.priority_class}); "
                               "X-Priority-Class may only lower it")
        return Selection(asked or chosen.priority_class, name, chosen.slo)
    assert asked is not None
    allowed = tenant.priority_classes if tenant.priority_classes is not None else (lane.priority_class,)
    if asked not in allowed:
        raise _not_allowed(asked, f"not among this API key's classes ({', '.join(allowed)})")
    return Selection(asked, None, lane.slo)


def _not_allowed(asked: str, why: str) -> GuardError:
    return GuardError(403, f"priority class {asked!r} is {why}", param="X-Priority-Class",
                      code="priority_class_not_allowed", outcome=Outcome.REJECTED_INVALID)
