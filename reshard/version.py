"""The version of reshard, in the base layer: plans, manifests, lineages and reports record the tool
that wrote them (``reshard 0.1.0``), and every layer that writes one takes it from here, below the
package's facade (`reshard/__init__.py`, which sits at the top with the API it exposes)."""

__version__ = "0.1.0"
