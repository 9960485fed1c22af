"""Attention store backends: ``file`` (embedded default) and ``mooncake``."""
