"""Core: pool keys, block hashes, the chunk database (keys and address rows) and the pure-Python oracle.

Depends only on the native module and numpy; never imports :mod:`mooncake_kvaddr.driver`.
"""
