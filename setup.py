"""Builds the optional C kernel (shmkv/pool/_ckernel.c). Without a C compiler the build of the
extension fails softly and shmkv runs on its pure-Python kernel (shmkv/pool/_pykernel.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmkv.pool._ckernel",
            ["shmkv/pool/_ckernel.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
        )
    ]
)
