"""The byte engine: target items spliced from source bytes, checkpoints compared byte for byte."""
