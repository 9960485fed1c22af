"""Memory backends of the device tier: ``host`` (POSIX shm, the embedded default) and ``xpu`` (Kunlun XPU)."""
