"""Training semantics: what keys mean, partition rules, trainer state, the manifest; nothing of bytes."""
