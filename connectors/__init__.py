"""Engine connectors: translate an engine's pages and requests into kvtier keys, scopes and plans.

Connectors hold no storage logic. Every read and write goes through ``kvtier.cache.KVCache``
(policy on every call); tiers, encryption and eviction stay in the core. Modules:

- ``connectors.identity``: who a request belongs to (cache salts -> principals, never trusted blindly);
- ``connectors.provision``: the KVCache an engine process uses, built once per process from config;
- ``connectors.transformers_connector``: generation with a Hugging Face model, prefix served by kvtier;
- ``connectors.vllm_connector``: a vLLM v1 ``KVConnectorBase_V1`` (needs the ``vllm`` package);
- ``connectors.sglang_storage``: an SGLang ``HiCacheStorage`` backend (needs the ``sglang`` package).
"""

from kvtier.aliases import alias_modules

# Moved in 0.2 to kvtier/dataplane/ (both ends of the shared-memory protocol live there); the old
# path works until the next release.
alias_modules({"connectors.shared_pages": "kvtier.dataplane.shared_pages"})
