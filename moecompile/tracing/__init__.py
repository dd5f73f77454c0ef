"""How a model reaches the backend in one graph: Dynamo's trace, adjusted for MoE code.

    capture.py    turn on Dynamo's capture of data-dependent shapes (``nonzero()``, ``.tolist()``) during the moe
                  backend's own compiles only (compile-start/end callbacks), and trace a frame again with Dynamo's
                  defaults where the trace with them fails; ``moecompile.capture()`` for a block
    loops.py      prove that a loop over the experts that received tokens equals the loop over every expert (and a
                  loop that skips an expert with nothing to do the same loop without the skip), and give the
                  function code that runs that loop while a compiler traces, and the loop as written otherwise
    loop_ast.py   the source-level (``ast``) reading and rewriting that ``loops.py`` proves with: a loop's body
    loop_experts.py  which experts a loop runs: the hit mask its ``nonzero()`` reads, the skips it makes
    loop_offsets.py  the skip of a loop that runs each expert on sorted rows at a running offset (DeepSeek's remote
                  code), proved to change nothing
    frames.py     where the traced frame's module sits in the model being run (layer paths in the model's terms)

May import: ``moecompile.passes`` (alias tables, reasons). Never the rest of the front end, never ``runtime``.
Why apart from the front end: it acts on Dynamo, before any graph exists; the passes act on the graph after.
Topic page: ``docs/detection.md`` (Expert loops).
"""
