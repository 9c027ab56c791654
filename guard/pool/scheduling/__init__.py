"""Replica choice as a scheduling profile of plugins, as llm-d's endpoint picker weighs filters, scorers and
a picker (``routing.profile``; ``routing.policy`` names a preset profile).

    usable replicas (circuit closed, current telemetry), in a rotating order
      -> filters   hold a replica back (ranked behind every replica that is not held), failing open
      -> scorers   each a value in [0, 1]; total = sum of weight x value
      -> picker    the order in which the dispatcher tries the replicas' gates

A profile only orders: the gates decide what fits, so no profile can overfill a replica. Writing a plugin:
guard/pool/scheduling/plugin.py and the README ("Writing a scheduling plugin").
"""

from guard.pool.scheduling.plugin import Candidate, Request
from guard.pool.scheduling.presets import PRESETS, profile_for
from guard.pool.scheduling.profile import Profile
from guard.pool.scheduling.profiles import Profiles

__all__ = ["PRESETS", "Candidate", "Profile", "Profiles", "Request", "profile_for"]
