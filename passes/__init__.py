"""Graph passes over the captured FX graph, one pass per file, run in the order of ``moecompile/pipeline.py``;
beside them the helpers they share (the ``MoESpec`` contract, alias tables, the canonical form, graph helpers).

May import: ``moecompile.runtime`` (the ops they insert), never the front end (``moecompile/``) or ``models``.
Passes take explicit arguments and never read global configuration. What each file holds and the invariants
between passes: ``passes/README.md``.
"""
