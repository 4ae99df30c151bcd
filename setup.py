"""Build the one C extension; all metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mlxrt.ipc._atomics",
            sources=["src/ipc/_atomics.c"],
            # -O2 for the copies; no -std flag so gcc and Apple clang use their gnu17 default.
            extra_compile_args=["-O2"],
        )
    ]
)
