"""The native block copy, built with the package (``kvcached/native.py`` loads it with ctypes).

Optional: without a C compiler the install still succeeds and the copy engine uses numpy; ``kvcached
doctor`` says which one the daemon will use. Everything else is configured in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcached._copy", ["kvcached/_copy.c", "kvcached/_verify.c"], extra_compile_args=["-O3"], optional=True
        )
    ]
)
