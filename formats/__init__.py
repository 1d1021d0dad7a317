"""Declarative data read by reshard: key conventions, manifest schema, model partition rules.

Shipped inside the wheel as the ``reshard.formats`` package so a non-editable install finds it.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent
