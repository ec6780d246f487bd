"""Adapters that plug mooncake_kvaddr into serving engines (vLLM)."""
