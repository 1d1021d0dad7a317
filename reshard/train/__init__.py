"""Runtime helpers a trainer imports: an elastic global-cursor sampler, per-rank RNG
capture/restore, and the manifest writer (re-exported from :mod:`reshard.semantics.manifest`)."""
from reshard.semantics.manifest import Manifest, read_manifest, write_manifest
from reshard.train.rng import capture as capture_rng
from reshard.train.rng import rank_entry, restore as restore_rng, rng_key, seed_all
from reshard.train.sampler import ElasticSampler

__all__ = ["ElasticSampler", "capture_rng", "restore_rng", "rng_key", "rank_entry", "seed_all",
           "Manifest", "read_manifest", "write_manifest"]
