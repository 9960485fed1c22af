"""kvcached: a per-host daemon that owns the KV cache of every inference rank.

This package's ``__init__`` stays empty on purpose: ``runner_client`` imports ``kvcached.protocol``, and
a runner must not pay for the daemon, click or structlog.
"""
