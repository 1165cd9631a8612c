"""Ban enforcement: a worker token banned by the integrity checks loses its access and its work.

orchestrator/integrity.py decides a ban (`max_strikes` strikes); this module carries it out. It
is called wherever a strike can happen: by the rollouts handler after ingest (orchestrator/
handlers.py) and by the verification scheduler after a check (orchestrator/verification.py).
"""

from __future__ import annotations

import logging

from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState

log = logging.getLogger("decentrl.orchestrator")


def enforce_bans(state: RunState, tokens: TokenRegistry) -> None:
    """Revoke the tokens banned since the last call and drop what they left waiting (open leases,
    held-back and ready groups: their prompts are leased again); their next request gets 401."""
    for name in state.integrity.newly_banned():
        dropped = state.drop_banned(name)
        try:
            tokens.revoke(name)
        except PermissionError as exc:  # an environment token: only its operator can remove it
            log.error("worker token %r is banned but cannot be revoked here (%s); its rollouts are refused", name, exc)
        log.warning("worker token %r banned after %d strikes; %d of its samples dropped", name,
                    state.integrity.workers[name].strikes, dropped)
