"""Storage formats and file access: bytes and layouts, nothing of training."""
