"""Build hook for the one native module: the pickle cost scan (reshard/storage/costscan.c).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is
found the install still succeeds and reshard uses the same scan written in Python
(`reshard.storage.safe_pickle`), only slower on very large `.metadata` files.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("reshard.storage.costscan", ["reshard/storage/costscan.c"], optional=True,
                             extra_compile_args=["-O2"])])
