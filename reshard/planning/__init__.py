"""Planning: from a source and the user's options to plain data (an `Inspection`, a `Plan`), reading metadata, never tensor bytes beyond the few small objects the semantics need."""
