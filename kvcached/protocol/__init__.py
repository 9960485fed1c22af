"""What the daemon and the runner client share: spec, ownership, names, layout, control block, errors.

Imports the standard library, numpy and posix_ipc only.
"""
