"""The Mooncake driver: store configuration, the embedded master, the store client, staging buffers, the
transfer paths (multi-buffer, direct, staged) and the rank-namespace lookup.

Imports ``mooncake.store`` only when a store is set up.
"""
