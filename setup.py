"""Build hook for the native modules: the pickle cost scan (reshard/storage/pickles/costscan.c), the
streaming `.metadata` decoder (reshard/storage/pickles/metadecode.c) and the CRC-32 of the data path
(reshard/storage/files/fastcrc.c: zlib's values by carry-less multiplication).

Everything else is in pyproject.toml. The extensions are optional: where no C compiler is
found the install still succeeds and reshard uses the same scan written in Python
(`reshard.storage.pickles.safe_pickle`), only slower on very large `.metadata` files, and reads
`.metadata` through the safe unpickler instead of the decoder (more memory at frontier scale), and checksums bytes with zlib.crc32 (about 3x the CPU).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("reshard.storage.pickles.costscan", ["reshard/storage/pickles/costscan.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("reshard.storage.pickles.metadecode", ["reshard/storage/pickles/metadecode.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("reshard.storage.files.fastcrc", ["reshard/storage/files/fastcrc.c"], optional=True,
                             extra_compile_args=["-O2"])])
