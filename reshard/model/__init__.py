"""A checkpoint in global terms as plain data: boxes, topology, placements."""
