"""PublicTrust: the deployment's trusted publishers of the public scope, and its configuration."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import PUBLIC
from kvtier.security.policy import ROLE_OPERATOR, ROLE_PUBLISH_ORG, ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.public_trust import PublicTrust
from kvtier.server.config import config_from_dict
from tests.helpers import DERIVER


def test_entries_name_principals_tenants_or_everyone() -> None:
    trust = PublicTrust.parse("kvtier/curator, docs/*")
    assert trust.trusts("kvtier", "curator") and trust.trusts("docs", "anyone")
    assert not trust.trusts("kvtier", "other") and not trust.trusts("evil", "curator")
    assert PublicTrust.parse("*").trusts("evil", "mallory") and PublicTrust.parse("*").everyone
    assert not PublicTrust().everyone, "everyone is an opt-in, never the default"
    assert PublicTrust.parse("") == PublicTrust() and not PublicTrust().trusts("kvtier", "curator")
    assert str(PublicTrust()) == "operators" and str(trust) == "operators, docs/*, kvtier/curator"
    assert [t.mode for t in (PublicTrust(), trust, PublicTrust.parse("*"))] == ["operators", "listed", "everyone"]


@pytest.mark.parametrize("bad", ["curator", "acme/al ice/x", "acme/", "/alice", "*/alice", "acme/a:b", "ac me/*x"])
def test_a_malformed_entry_is_a_config_error_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError, match="public publisher"):
        PublicTrust.parse(bad)


def test_the_policy_lets_only_trusted_publishers_write_the_public_scope() -> None:
    policy = Policy(DERIVER, public_trust=PublicTrust.parse("kvtier/curator"))
    curator = Principal("kvtier", "curator", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    mallory = Principal("evil", "mallory", org="x", roles=frozenset({ROLE_PUBLISH_PUBLIC, ROLE_PUBLISH_ORG}))
    assert policy.may_write(curator, PUBLIC) and not policy.may_write(mallory, PUBLIC)
    # The list is about the public scope alone: mallory still publishes in its own org, and reads public.
    assert policy.may_write(mallory, mallory.org_scope()) and policy.may_read(mallory, PUBLIC)
    # Trust never stands in for the role: neither a listed principal's nor an operator's.
    assert not policy.may_write(Principal("kvtier", "curator"), PUBLIC)
    assert not policy.may_write(Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR})), PUBLIC)
    # An operator (who may purge the public scope anyway) is trusted without being named.
    assert policy.may_write(Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC})), PUBLIC)
    assert policy.may_delete(Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR})), PUBLIC)
    assert not policy.may_delete(curator, PUBLIC)


def test_the_default_list_trusts_operators_only_and_none_is_the_embedders_own() -> None:
    publisher = Principal("kvtier", "curator", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    operator = Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC}))
    daemon_default = Policy(DERIVER, public_trust=PublicTrust())  # what the daemon passes unconfigured
    assert not daemon_default.may_write(publisher, PUBLIC) and daemon_default.may_write(operator, PUBLIC)
    # In process, without a list, the embedding code (which makes every principal) trusts every publisher.
    embedded = Policy(DERIVER)
    assert embedded.may_write(publisher, PUBLIC) and embedded.may_write(operator, PUBLIC)


def _config(publishers: str) -> dict:
    return {"auth": {"token_key_file": "/k/token"},
            "security": {"server_secret_file": "/k/secret", "master_key_file": "/k/master",
                         "public_publishers": publishers},
            "tiers": {"memory": {"capacity_bytes": 1 << 20}}}


def test_the_daemon_config_checks_the_list() -> None:
    unset = _config("")
    del unset["security"]["public_publishers"]
    assert config_from_dict(unset, env={}).security.public_publishers == "", "the default: operators only"
    assert config_from_dict(_config("kvtier/curator,docs/*"), env={}).security.public_publishers == \
        "kvtier/curator,docs/*"
    with pytest.raises(ConfigError, match=r"security\.public_publishers: must be a list of trusted publishers"):
        config_from_dict(_config("kvtier/cur ator/x"), env={})
    env = {"KVTIER_SECURITY__PUBLIC_PUBLISHERS": "bad entry/"}
    with pytest.raises(ConfigError, match=r"public_publishers.*KVTIER_SECURITY__PUBLIC_PUBLISHERS"):
        config_from_dict(_config("*"), env=env)
