"""Who may write the public scope: the deployment's trusted publishers (issue 32, design point).

Every tenant reads the one public scope, and a block is stored once under its key (the first
writer's bytes stay), so whoever may write it decides what every tenant's model computes from a
public prefix. The trust list makes that the operator's decision: a principal writes the public
scope only when it holds ``publish:public`` *and* is trusted: it holds the ``operator`` role (an
operator may purge the public scope anyway, so trusting it adds no power) or the list names it.
Everyone else, another tenant's ``publish:public`` holder included, is skipped like a reader (the
block is not stored, and a Put lists it as rejected), so garbage it pre-publishes under a
document's keys never lands there, and the trusted publisher's blocks can. Deleting or purging
public content is the operator's alone (``policy.RULES``). The operator rule is the policy's
(``Policy._trusted``); this list is only the names.

Entries, separated by commas (spaces around them ignored): ``<tenant>/<user>`` (one principal),
``<tenant>/*`` (every principal of a tenant), ``*`` (every holder of ``publish:public`` of every
tenant: an explicit opt-in for a deployment whose tenants all trust each other, the behaviour
before the list existed; the daemon warns at start while it is on). The default, an empty list:
operators only, so in the default configuration no tenant changes what another reads.
Readers trust what the deployment trusts: there is one public scope, so one list per deployment
(per-tenant lists would need a public scope per trusted set and a lookup per set).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError, ScopeError
from kvtier.security.policy import Principal

#: Every holder of ``publish:public``, of any tenant (an explicit opt-in, never the default).
EVERYONE = "*"


@dataclass(slots=True, frozen=True)
class PublicTrust:
    """The deployment's trusted publishers of the public scope besides operators (see the module
    docstring). The default (no entries) trusts operators only."""

    publishers: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> PublicTrust:
        """The list from its configured text; ConfigError naming the first malformed entry."""
        entries = frozenset(e.strip() for e in text.split(",") if e.strip())
        for entry in entries:
            if entry == EVERYONE:
                continue
            tenant, sep, user = entry.partition("/")
            try:
                if not sep:
                    raise ScopeError("no '/'")
                Principal(tenant=tenant, user="x" if user == "*" else user)  # the one id rule
            except ScopeError:
                raise ConfigError(f"public publisher {entry!r}: expected <tenant>/<user>, <tenant>/* or *, "
                                  "with ids of letters, digits and ._@+=-") from None
        return cls(entries)

    @property
    def everyone(self) -> bool:
        return EVERYONE in self.publishers

    @property
    def mode(self) -> str:
        """``everyone`` (``*``), ``listed`` (operators and named publishers) or ``operators``
        (the default): what /metrics says, without naming anyone."""
        return "everyone" if self.everyone else "listed" if self.publishers else "operators"

    def trusts(self, tenant: str, user: str) -> bool:
        """Whether the list names principal ``<tenant>/<user>`` (it still needs the role; an
        operator is trusted without being named, by the policy)."""
        return self.everyone or f"{tenant}/{user}" in self.publishers or f"{tenant}/*" in self.publishers

    def __str__(self) -> str:
        return ", ".join(["operators", *sorted(self.publishers)]) if not self.everyone else \
            "* (every publish:public holder of every tenant)"
