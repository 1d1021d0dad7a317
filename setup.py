"""Build hook for the native modules: the pickle cost scan (reshard/storage/pickles/costscan.c) and the
streaming `.metadata` decoder (reshard/storage/pickles/metadecode.c).

Everything else is in pyproject.toml. The extensions are optional: where no C compiler is
found the install still succeeds and reshard uses the same scan written in Python
(`reshard.storage.pickles.safe_pickle`), only slower on very large `.metadata` files, and reads
`.metadata` through the safe unpickler instead of the decoder (more memory at frontier scale).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("reshard.storage.pickles.costscan", ["reshard/storage/pickles/costscan.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("reshard.storage.pickles.metadecode", ["reshard/storage/pickles/metadecode.c"], optional=True,
                             extra_compile_args=["-O2"])])
