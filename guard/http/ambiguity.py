"""Headers that must come once: a request that carries one of them twice is refused (400 naming it), never
served by whichever copy a parser happens to keep.

Two ``Authorization`` headers are the sharpest case: a proxy in front of the guard may check one key while
the guard serves the other's tenant. Two request ids, classes, objectives or SLO headers leave the record,
the trace and admission each free to read a different one. Other repeated headers (``Accept``, ``Cookie``)
are the client's business.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDictProxy, istr

from guard.admission.slo import HEADERS as SLO_HEADERS
from guard.errors import GuardError, Outcome

# istr: looked up without lower-casing the name again on every request (about 0.5 us for all of them).
ONCE = tuple(istr(name) for name in ("Authorization", "X-Request-Id", "X-Priority-Class",
                                     "x-gateway-inference-objective", *SLO_HEADERS.values()))


def refuse_ambiguous(headers: Mapping[str, str] | CIMultiDictProxy[str]) -> None:
    """Raise the 400 naming the first header that must come once but comes again in ``headers`` (a
    multidict: aiohttp's, or the front's). Every request runs it: one lookup per name for the usual
    request, which carries none of them but ``Authorization``."""
    for name in ONCE:
        if name in headers and len(headers.getall(name)) > 1:  # type: ignore[union-attr]
            raise GuardError(400, f"header {name} was sent more than once; send it once", param=str(name),
                             code="ambiguous_header", outcome=Outcome.REJECTED_INVALID)
