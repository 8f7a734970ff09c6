"""Which peer identities the GPU daemon serves, and with what limits (config ``access:``).

An identity (see ``rrtod.tls.peer_identity``) is admitted by the rule written for exactly its
name, else by the first rule, in file order, whose name is a glob (``*``, ``?``, ``[...]``) that
matches it. Certificate identities are admitted only by a rule. The two identities that carry no
certificate are admitted without one, because the operator already chose who reaches them:
``local`` (the unix peer socket: its file mode is the access control) and
``anonymous`` (a TCP port with ``tls.mode: insecure`` or ``tls``, written out in the config).
A rule written for exactly ``local`` or ``anonymous`` sets their limits; globs never match them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from rrtod.config import AccessRule, Config
from rrtod.tls import ANONYMOUS, LOCAL, RESERVED

GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class Grant:
    """What an admitted identity may do here."""

    identity: str
    rule: str | None  # the access key that admitted it; None: admitted without a rule
    max_sessions: int | None
    memory_quota: int
    allow_extra: tuple[str, ...]


class AccessPolicy:
    def __init__(self, config: Config):
        self.config = config
        self.rules = config.access

    def rule_for(self, identity: str) -> tuple[str, AccessRule] | None:
        if identity in self.rules:
            return identity, self.rules[identity]
        if identity in RESERVED:
            return None
        for pattern, rule in self.rules.items():
            if GLOB_CHARS & set(pattern) and fnmatch.fnmatchcase(identity, pattern):
                return pattern, rule
        return None

    def grant(self, identity: str) -> Grant | None:
        """The grant for ``identity``, or None when no rule admits it."""
        executor = self.config.executor
        found = self.rule_for(identity)
        if found is None:
            if identity not in RESERVED:
                return None
            return Grant(identity, None, None, executor.memory_quota, executor.allow_extra)
        key, rule = found
        quota = executor.memory_quota if rule.memory_quota is None else rule.memory_quota
        extra = tuple(dict.fromkeys(executor.allow_extra + rule.allow_extra))
        return Grant(identity, key, rule.max_sessions, quota, extra)


__all__ = ["ANONYMOUS", "LOCAL", "AccessPolicy", "Grant"]
