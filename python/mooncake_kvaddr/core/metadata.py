"""Key metadata and pool keys: how a KV chunk is named in the Mooncake store (docs/keys.md).

Drop-in for vLLM's ``KeyMetadata`` and ``PoolKey`` (same fields, same strings, same hashing and ordering).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KeyMetadata:
    """The namespace part of a pool key: model, ranks, KV-cache group and an optional deployment prefix."""

    model_name: str
    tp_rank: int
    pcp_rank: int
    dcp_rank: int
    pp_rank: int
    group_id: int = 0
    #: Prepended to every key (with ``@``) when non-empty, so deployments can share one master.
    cache_prefix: str = ""
    #: Inserted right after the model name in every key (vLLM 0.32+, docs/vllm.md): a TP-shared store
    #: format's namespace. Empty keeps the historical keys byte-identical.
    store_namespace: str = ""


@dataclass(order=True)
class PoolKey:
    """One chunk's key: ``[cache_prefix@]model[store_namespace]@tp_rank:T@pcpC@dcpD@pp_rank:P@group:G@<hex>``."""

    key_metadata: KeyMetadata
    chunk_hash: str

    def __hash__(self) -> int:
        md = self.key_metadata
        return hash(
            (
                md.cache_prefix,
                md.model_name,
                md.store_namespace,
                md.tp_rank,
                md.pcp_rank,
                md.dcp_rank,
                md.pp_rank,
                md.group_id,
                self.chunk_hash,
            )
        )

    @staticmethod
    def build_prefix(
        key_metadata: KeyMetadata,
        *,
        tp_rank: int | None = None,
        pcp_rank: int | None = None,
        dcp_rank: int | None = None,
        pp_rank: int | None = None,
    ) -> str:
        """The key up to (not including) the ``@<hash>`` suffix; non-None overrides replace the ranks."""
        md = key_metadata
        tp = md.tp_rank if tp_rank is None else tp_rank
        pcp = md.pcp_rank if pcp_rank is None else pcp_rank
        dcp = md.dcp_rank if dcp_rank is None else dcp_rank
        pp = md.pp_rank if pp_rank is None else pp_rank
        namespace = f"{md.cache_prefix}@" if md.cache_prefix else ""
        # Irregular punctuation is the wire format: "pcp"/"dcp" carry no colon.
        head = f"{namespace}{md.model_name}{md.store_namespace}"
        return f"{head}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{md.group_id}"

    @staticmethod
    def build_key_string(key_prefix: str, chunk_hash: str) -> str:
        """``key_prefix + "@" + chunk_hash``."""
        return f"{key_prefix}@{chunk_hash}"

    def to_string(self) -> str:
        """The full pool key string."""
        return self.build_key_string(self.build_prefix(self.key_metadata), self.chunk_hash)


def model_name_from_path(model: str) -> str:
    """The key's model name for a model path or hub id: the last ``/`` component, trailing ``/`` ignored."""
    return model.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class TailKeyBoundary:
    """The token boundary whose key stores group ``group_id``'s tail block (vLLM 0.33's shape).

    A loader keys the block that ends the hit with ``block_hashes[num_tokens // hash_block_size - 1]``
    instead of the hash at the hit length; ``num_tokens`` equals the hit length unless the group holds only
    a longer partial (or full) key of that block.
    """

    group_id: int
    num_tokens: int
