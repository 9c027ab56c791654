"""Several scheduling profiles, one chosen per request (llm-d's EndpointPickerConfig: named plugin instances,
named profiles, and a rule that picks the profile a request is ranked by).

The ``default`` profile is ``routing.profile`` (or the ``routing.policy`` preset); ``routing.select`` rules
send a request to another named profile by the model it asks for or the objective it chose, first match
first. Every profile keeps its own picker (a round-robin's turn is its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from guard.config import ProfileRule
from guard.pool.scheduling.plugin import Candidate, Request
from guard.pool.scheduling.profile import Profile

if TYPE_CHECKING:
    from guard.pool.replica import Replica


class Profiles:
    def __init__(self, default: Profile, named: dict[str, Profile] | None = None,
                 rules: Sequence[ProfileRule] = ()) -> None:
        self.default = default
        self.named = dict(named or {})
        self.rules = tuple(rules)
        # Whether any profile reads prefix hits (the guard then hashes every prompt's blocks).
        self.needs_hashes = default.needs_hashes or any(p.needs_hashes for p in self.named.values())
        if not self.rules:  # the usual configuration: one profile, asked directly (no call in between)
            self.rank = default.rank  # type: ignore[method-assign]

    def pick(self, request: Request) -> Profile:
        """The profile that ranks ``request``."""
        for rule in self.rules:
            if ((rule.model is None or rule.model == request.model)
                    and (rule.objective is None or rule.objective == request.objective)):
                return self.named[rule.profile]
        return self.default

    def rank(self, replicas: Sequence[Replica], request: Request) -> list[Candidate]:
        return self.pick(request).rank(replicas, request)
