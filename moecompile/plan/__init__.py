"""``python -m moecompile plan``: before a run, every way to run a model on a cluster, priced.

Lives here: reading a model's ``config.json`` into MoE shapes (``shapes.py``, through the alias tables detection
uses: ``passes/aliases.py``), the cluster file (``cluster.py``), one plan's time, bytes and memory
(``cost.py``), the search over plans and its outputs (``search.py``, ``cli.py``). It may import the passes and
the runtime (the expected traffic under uniform routing is ``runtime/comm/expected.py``, beside the measured-
routing models the passes use), never the distributed front end.
"""

from .cluster import Cluster, read_cluster
from .search import plan
from .shapes import MoEShape, read_config

__all__ = ["Cluster", "MoEShape", "plan", "read_cluster", "read_config"]
