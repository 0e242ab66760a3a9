"""lightning-sink callbacks (top-level package per the design card; may import ``lightning_sink``, never the reverse).

The monitoring and resharding callbacks are built in their own issue; this package exists so that the
distribution installs both import packages from the start.
"""

__all__: list[str] = []
